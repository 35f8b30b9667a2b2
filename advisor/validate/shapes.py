"""The shapes a kernel is validated at: the recorded ones, odd ones, and all-ones.

Sizes are chosen per class of unified size symbols (see `advisor.codegen.ir`); classes pinned by the
pattern (broadcast 1s, sizes fixed by slices) keep their recorded value, so the program's broadcast
structure is the same in every case. The recorded case is capped (fewer rows, same row width; fewer
elements for pointwise kernels) so validation stays cheap: hard under Triton's interpreter (CI), and
on a GPU at 16 M elements, where a kernel's masks and index arithmetic are exercised as at full size
(offsets stay 32-bit below 2^31 elements either way) and a full-size fp64 reference of a 1 GB
activation would cost seconds of the cold start. The result says when a case was capped.

Matmul-anchored (tiled) kernels under the interpreter are capped by every value they read or compute,
not only their outputs: a GEMM's K, the rows a matmul + amax reduces and attention's score matrix are
in none of the outputs, and SPLADE's matmul + amax (B x L x V x K = 32 x 256 x 237 x 384 after the
output cap) took 190 s of a CI run, GPT-2's attention (16 heads x 1021 x 1021 keys at its odd case)
280 s. A tile walks every dim in blocks, so no row width is kept for them (attention's softmax runs a
block of keys at a time), and a dim recorded over one interpreter block keeps two (`_floor`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from advisor.codegen.ir import Dim, Program

INTERPRETER_MAX_ROWS = 24
INTERPRETER_MAX_NUMEL = 1 << 13
# The largest block the generated matmul-anchored kernels take under the interpreter (their `_small`).
INTERPRETER_MAX_BLOCK = 64
GPU_MAX_ROWS = 1 << 14
GPU_MAX_NUMEL = 1 << 24
ODD = [3, 5, 7, 11, 13, 17, 19, 23]


@dataclass
class Case:
    name: str  # "recorded" | "odd" | "ones"
    values: dict  # size symbol -> size, for every symbol of the program
    note: str = ""

    def size(self, prog: Program, d: Dim) -> int:
        d = prog.sizes.norm(d)
        return d.const + sum(self.values[t] for t in d.terms)

    def shape(self, prog: Program, dims) -> list:
        return [self.size(prog, d) for d in dims]


def free_classes(prog: Program) -> dict:
    """Representative symbol -> recorded size, for the classes validation may resize."""
    s = prog.sizes
    return {s.find(t): s.value[t] for t in s.parent if s.find(t) not in s.pinned and s.find(t) not in s.defs}


def tiled(prog: Program) -> bool:
    """Matmul-anchored: the kernel walks every dim in tiles (`advisor.codegen.matmul`), none in one block."""
    return any(o.low.kind == "anchor" for o in prog.ops)


def row_class(prog: Program) -> str | None:
    if not prog.row_ops:
        return None
    view = next(v for v in prog.row_ops[0].args.values() if hasattr(v, "identity"))
    n = prog.sizes.norm(view.shape[-1])
    return n.terms[0] if len(n.terms) == 1 else None


def _case(prog: Program, name: str, chosen: dict, note: str = "") -> Case:
    s = prog.sizes
    values = {t: chosen.get(s.find(t), s.value[t]) for t in s.parent}
    return Case(name, values, note)


def domain_numel(prog: Program, case: Case) -> tuple[int, int]:
    """(rows, elements) of the biggest output under `case` (rows: 1 for pointwise programs)."""
    numel = max((math.prod(case.shape(prog, v.shape)) for v in prog.outputs), default=1)
    if prog.row_ops:
        view = next(v for v in prog.row_ops[0].args.values() if hasattr(v, "identity"))
        shape = case.shape(prog, view.shape)
        return math.prod(shape[:-1]), max(numel, math.prod(shape))
    return 1, numel


def all_values_numel(prog: Program, case: Case) -> int:
    """Elements of the biggest value `prog` reads or computes under `case`: inputs, intermediates, outputs."""
    shapes = [i.shape for i in prog.inputs] + [v.shape for v in prog.values.values()]
    return max((math.prod(case.shape(prog, s)) for s in shapes), default=1)


def cases(prog: Program, interpreter: bool) -> list:
    free = free_classes(prog)
    by_tiles = interpreter and tiled(prog)
    n_cls = None if by_tiles else row_class(prog)  # tiles hold no whole row: none to keep
    recorded = dict(free)
    limits = (INTERPRETER_MAX_ROWS, INTERPRETER_MAX_NUMEL) if interpreter else (GPU_MAX_ROWS, GPU_MAX_NUMEL)
    where = "interpreter" if interpreter else "GPU"
    recorded, note = _cap_tiles(prog, recorded) if by_tiles else _cap(prog, recorded, n_cls, *limits, where)
    odd = {}
    for k, (rep, v) in enumerate(sorted(free.items())):
        if rep == n_cls:  # row width: not a power of two, so the block has a masked tail
            odd[rep] = v - 3 if v > 8 else v + 3
        else:
            odd[rep] = ODD[k % len(ODD)]
    out = [_case(prog, "recorded", recorded, note), _case(prog, "odd", odd)]
    # All ones; rows keep their width (a norm over one element is degenerate: eager CUDA's layer_norm
    # returns NaN there), so this is one row, or one element for pointwise programs.
    ones = {rep: 1 for rep in free if rep != n_cls}
    if ones:
        out.append(_case(prog, "ones", {**ones, **({n_cls: recorded[n_cls]} if n_cls in recorded else {})}))
    return out


def _cap(prog: Program, chosen: dict, n_cls: str | None, max_rows: int, max_numel: int,
         where: str) -> tuple[dict, str]:
    """Shrink the biggest resizable classes (never the row width) until the recorded case is small."""
    def too_big(case: Case) -> bool:
        rows, numel = domain_numel(prog, case)
        return (rows > max_rows or numel > max_numel) if prog.row_ops else numel > max_numel

    chosen, shrunk = _shrunk(prog, chosen, too_big, lambda r, v: r != n_cls)
    if not shrunk:
        return chosen, ""
    what = "rows" if prog.row_ops else "elements"
    return chosen, f"{where}: recorded shape capped to fewer {what}" + (" (same row width)" if prog.row_ops else "")


def _cap_tiles(prog: Program, chosen: dict) -> tuple[dict, str]:
    """`_cap` for a tiled kernel under the interpreter: the biggest resizable class shrinks until every value
    the kernel reads or computes has at most INTERPRETER_MAX_NUMEL elements, or each is at its `_floor`."""
    chosen, shrunk = _shrunk(prog, chosen, lambda case: all_values_numel(prog, case) > INTERPRETER_MAX_NUMEL,
                             lambda r, v: _halve(v, prog.sizes.value.get(r, 0)) >= _floor(prog.sizes.value.get(r, 0)))
    if not shrunk:
        return chosen, ""
    return chosen, ("interpreter: recorded shape capped to fewer elements (every value the tiles read or "
                    "compute; a dim of several blocks keeps two)")


def _shrunk(prog: Program, chosen: dict, too_big, resizable) -> tuple[dict, bool]:
    """(`chosen` with its biggest `resizable(rep, size)` class halved (`_halve`) while `too_big(case)` holds and
    one is left, whether anything was)."""
    chosen, shrunk = dict(chosen), False
    for _ in range(64):
        if not too_big(_case(prog, "cap", chosen)):
            break
        cands = [r for r, v in chosen.items() if v > 1 and resizable(r, v)]
        if not cands:
            break
        big = max(cands, key=lambda r: chosen[r])
        chosen[big] = _halve(chosen[big], free_value=prog.sizes.value.get(big, 0))
        shrunk = True
    return chosen, shrunk


def _floor(recorded: int) -> int:
    """The least a tiled kernel's dim recorded at `recorded` is capped to under the interpreter: two of its
    largest blocks where it had more, so each loop (K, reduced rows, attention's keys) still carries its
    running sum or max from one step to the next and the grid still has two programs along it; else two
    indices where it had them, so that its stride is exercised (sizes of 1 are the all-ones case's)."""
    return min(recorded, 2 * INTERPRETER_MAX_BLOCK) if recorded > INTERPRETER_MAX_BLOCK else min(recorded, 2)


def _halve(v: int, free_value: int) -> int:
    """About half of `v`, in the recorded size's divisibility class: a multiple of 16 stays one (Triton
    specialises on it, so the capped case compiles and checks the variant the real shape runs), any
    other size becomes odd (not a multiple of any block: the masked tail is exercised)."""
    half = v // 2
    if free_value % 16 == 0 and half >= 16:
        return half - half % 16
    return max(1, half - 1 if half % 2 == 0 else half)
