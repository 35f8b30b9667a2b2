"""Fresh inputs for a validation case, with the recorded dtypes and memory structure.

Each input keeps its recorded layout at the case's sizes: the same dim order, stride-0 (expanded)
dims, and padding between rows (a slice of a wider tensor stays a slice). Its storage also covers
every element the program reads through other views of it (a shifted slice may read before the
view's first element). Values: random normal floats, never zero; strictly positive where an op
needs it (log, sqrt, rsqrt, pow with a fractional exponent, ...); 0-dim float inputs (Python
scalars in the model: eps, scales) in [0.5, 1.5]; integers in ±[1, 9]; random bools.
"""
from __future__ import annotations

import torch

from advisor.codegen.ir import Input, Program, View, _order
from advisor.ops.registry import tagged
from advisor.validate.shapes import Case


def positive_inputs(prog: Program) -> set:
    """Inputs that must be > 0: read (directly or through a conversion) by an op whose domain needs it."""
    need = set()
    for op in prog.ops:
        names = op.low.positive
        if tagged(op.name, "power") and isinstance(op.args.get("exponent"), float) \
                and not float(op.args["exponent"]).is_integer():
            names = ("self",)
        for n in names:
            v = op.args.get(n)
            if isinstance(v, View):
                need |= _roots(prog, v.src)
    return need


def _roots(prog: Program, sid: str) -> set:
    if sid not in prog.values:
        return {sid}
    op = prog.values[sid].op
    if not tagged(op.name.rstrip("_"), "keeps_positive"):
        return set()
    return {r for v in op.args.values() if isinstance(v, View) for r in _roots(prog, v.src)}


def layout(inp: Input, shape: list) -> list:
    """Strides for `shape` with the recorded structure: same order, stride-0 dims, row padding."""
    live = [d for d in _order(inp.rec_strides, inp.rec_shape) if inp.rec_strides[d] and inp.rec_shape[d] != 1]
    strides = [0 if inp.rec_strides[d] == 0 and inp.rec_shape[d] != 1 else 1 for d in range(len(shape))]
    acc = None
    for j, d in enumerate(reversed(live)):  # innermost first
        rec = inp.rec_strides[d]
        strides[d] = rec if acc is None else acc  # the innermost keeps its step (a column of a wider tensor)
        pad = 0
        if j + 1 < len(live):  # padding between this dim's rows when recorded (a slice of a wider dim)
            pad = max(inp.rec_strides[live[-2 - j]] // rec - inp.rec_shape[d], 0)
        acc = strides[d] * (max(shape[d], 1) + pad)
    return strides


def draw(prog: Program, case: Case, device, generator: torch.Generator) -> dict:
    """{input id: tensor} for one case."""
    positive = positive_inputs(prog)
    out = {}
    for inp in prog.inputs:
        shape, strides, lo, hi = _placed(prog, case, inp)
        storage = _values(inp, hi - lo + 1, inp.id in positive, generator)
        out[inp.id] = torch.as_strided(storage.to(device), shape, strides, -lo)  # drawn on the generator's device
    return out


def meta_inputs(prog: Program, case: Case) -> dict:
    """{input id: tensor} for one case as `draw` lays them out, on the meta device (shapes, strides and
    dtypes, no memory): enough for a kernel's launch code to choose the Triton signature it would launch."""
    out = {}
    for inp in prog.inputs:
        shape, strides, lo, hi = _placed(prog, case, inp)
        out[inp.id] = torch.empty(hi - lo + 1, dtype=inp.dtype, device="meta").as_strided(shape, strides, -lo)
    return out


def _placed(prog: Program, case: Case, inp: Input) -> tuple[list, list, int, int]:
    """Input `inp`'s shape and strides at `case`, and the lowest and highest element offset any read touches."""
    shape = case.shape(prog, inp.shape)
    strides = layout(inp, shape)
    return (shape, strides, *_extent(prog, case, inp, shape, strides))


def _extent(prog: Program, case: Case, inp: Input, shape, strides) -> tuple[int, int]:
    """Lowest and highest element offset (relative to the input's start) any read of it touches."""
    spans = [(0, sum((n - 1) * s for n, s in zip(shape, strides) if n > 0))]
    for op in prog.ops:
        for a in op.args.values():
            for v in (a if isinstance(a, list) else [a]):
                if isinstance(v, View) and v.src == inp.id and not v.identity:
                    base = sum(st * s for st, s in zip(v.starts, strides))
                    lo = hi = base
                    for d, w in enumerate(v.walks()):
                        if w is not None:
                            n = case.size(prog, v.shape[d])
                            step = (n - 1) * strides[w[0]] * w[1]
                            lo, hi = lo + min(step, 0), hi + max(step, 0)
                    spans.append((lo, hi))
    return min(0, *(s[0] for s in spans)), max(s[1] for s in spans)


def _values(inp: Input, n: int, positive: bool, g: torch.Generator) -> torch.Tensor:
    dt = inp.dtype
    on = {"generator": g, "device": g.device}  # a CUDA generator draws on the GPU: no host copy of big inputs
    if dt == torch.bool:
        return torch.rand(n, **on) < 0.5
    if not dt.is_floating_point:
        mag = torch.randint(1, 10, (n,), **on)
        sign = torch.where(torch.rand(n, **on) < 0.5, -1, 1) if not positive else torch.ones(n, dtype=torch.int64, device=g.device)
        return (mag * sign).to(dt)
    if not inp.shape:
        return (0.5 + torch.rand(n, dtype=torch.float64, **on)).to(dt)
    x = torch.randn(n, dtype=torch.float64, **on)
    if positive:
        x = x.abs() + 0.05
    x = x.to(dt)
    return torch.where(x == 0, torch.ones_like(x), x)  # never zeros
