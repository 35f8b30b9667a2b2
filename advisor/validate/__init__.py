"""Validation: every generated kernel, every time, before anything uses it.

For each case (`shapes.cases`: recorded, odd sizes, all ones) it draws fresh inputs, runs the
program through PyTorch in float64 and in the native dtypes, runs the kernel on copies of the
inputs into NaN-poisoned outputs, and compares (`compare`). Without a GPU the kernel runs in
Triton's interpreter (chosen per launch from the tensors' device: `advisor.interpreter`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch

from advisor.interpreter import forced
from advisor.stopwatch import Stopwatch
from advisor.validate.compare import TOLERANCES, compare, poison
from advisor.validate import launchers
from advisor.validate.inputs import draw, meta_inputs
from advisor.validate.memo import memo_key, recall, remember
from advisor.validate.reference import run_reference
from advisor.validate.shapes import cases

__all__ = ["validate", "Validation", "TOLERANCES", "interpreted", "compile_jobs", "compile_ahead", "launch_signatures"]


def interpreted() -> bool:
    """Whether kernels are validated on the CPU, in Triton's interpreter: without a GPU, or where the user set
    TRITON_INTERPRET=1 (each launch on CPU tensors is interpreted: `advisor.interpreter`)."""
    return forced() or not torch.cuda.is_available()


@dataclass
class Validation:
    validated: bool
    reason: str | None
    errors: dict = field(default_factory=dict)
    # Wall seconds per step (signatures: finding what the cases will compile; inputs, reference, `kernel <case>`:
    # a case's first launch, which waits for its Triton compile, compare), summed over the cases: a row kernel's
    # validation took 4-5 s in its H100 worker, and compiling its cases ahead as jobs of their own did not shorten
    # it (reports/cold-start/validation-cases-ahead/); these say which step does.
    steps: dict = field(default_factory=dict)


def validate(gen, module, seed: int = 0, memo: bool | None = None, compile_at_once: bool = False) -> Validation:
    """Check `module.run` against the program it was generated from (`gen`: a codegen.Generated).

    `memo` (default: on a GPU) reuses a success recorded for the same kernel source, runner, shapes,
    device and versions (`advisor.validate.memo`): the cold start of a second run pays no validation.
    `compile_at_once`: the cases' kernels compile in threads from the start (`launchers.compiling`), for a
    process that has nothing else to do meanwhile (a compile worker): their Python front end takes the GIL
    from whatever else this process runs."""
    interp = interpreted()
    use_memo = (not interp) if memo is None else memo
    key = memo_key(gen, module, seed, interp) if use_memo else None
    if key and (hit := recall(key)):
        return Validation(True, None, hit)
    result = _validate(gen, module, seed, interp, compile_at_once)
    if key and result.validated:
        remember(key, result.errors)
    return result


def _validate(gen, module, seed: int, interp: bool, compile_at_once: bool = False) -> Validation:
    clock = Stopwatch()
    ahead = []
    if compile_at_once and not interp:  # the cases' kernels, compiled from here on, at once
        with clock("signatures"):
            ahead = launch_signatures(gen, module)
    with launchers.compiling(ahead):
        result = _checked(gen, module, seed, interp, clock)
    result.steps = clock.seconds
    return result


def _checked(gen, module, seed: int, interp: bool, clock: Stopwatch) -> Validation:
    prog = gen.program
    device = "cpu" if interp else "cuda"
    g = torch.Generator(device=device).manual_seed(seed)
    worst = {"rel_l2": 0.0, "max_abs": 0.0, "eager_rel_l2": 0.0, "eager_max_abs": 0.0}
    shapes, notes = [], []
    dtypes = sorted({str(v.dtype)[6:] for v in prog.outputs})
    matmul = any(o.low.kind == "anchor" for o in prog.ops)  # matmul-anchored kernels: compare.MATMUL_TOLERANCES
    for case in cases(prog, interp):
        with clock("inputs"):
            inputs = draw(prog, case, device, g)
        shapes.append({"case": case.name, "inputs": [list(t.shape) for t in inputs.values()]})
        if case.note:
            notes.append(case.note)
        try:
            with clock("reference"):
                ref64, mutated64 = run_reference(prog, case, inputs, "fp64")
                native, mutated_native = run_reference(prog, case, inputs, "native")
        except Exception as e:  # the trace's program itself does not replay
            return Validation(False, f"reference replay failed at {case.name} shape: {type(e).__name__}: {e}")
        try:
            with _tuning(module, case.name == "recorded"), clock(f"kernel {case.name}"):
                outs, after = _run_kernel(module, prog, inputs)
        except Exception as e:
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else ""
            return Validation(False, f"kernel failed to compile or run ({case.name} shape): {type(e).__name__}: {msg}"[:500])
        with clock("compare"):
            checks = [compare(o, ref64[v.id], native[v.id], f"{v.id} ({case.name} shape)", matmul,
                              _through(prog, v.id))
                      for o, v in zip(outs, prog.outputs[:prog.returned])]
            checks += [compare(after[k], mutated64[k], mutated_native[k], f"{k} written in place ({case.name} shape)",
                               matmul, _through(prog, _writer(prog, k))) for k in _mutated(prog)]
        for c in checks:
            if not c.ok:
                return Validation(False, c.reason, _errors(worst, c, dtypes, shapes, notes))
            for key in worst:
                worst[key] = max(worst[key], getattr(c, key))
    return Validation(True, None, _errors(worst, None, dtypes, shapes, notes))


@contextlib.contextmanager
def _tuning(module, on: bool):
    """A tuned kernel (matmul-anchored: `TUNE`, its configs timed at each new shape) times its configs at
    the recorded shape only: that compiles every config into Triton's cache for the
    patched model's own first call, which tunes again in its process. At the odd and all-ones shapes the
    default config is all validation needs (three shapes x eight configs were ~24 Triton compiles per
    matmul epilogue, the longest job of the H100's 44-50 s empty-cache generate)."""
    if not hasattr(module, "TUNE"):
        yield
        return
    old = module.TUNE
    module.TUNE = old and on
    try:
        yield
    finally:
        module.TUNE = old


def compile_jobs(gen, module, seed: int = 0) -> list[tuple[str, int | None]]:
    """The Triton compiles `validate` is about to make, as independent jobs for `compile_ahead` (in other
    processes: `workflows.generate` runs them in its compile workers before the validation): each tile
    config a tuned kernel times at the recorded shape, and its default config at each other shape (as
    `_tuning` runs them). [] for a kernel with nothing to tune, or whose validation is memoised (it will
    not run the kernel), or under the interpreter (nothing compiles)."""
    configs = getattr(module, "CONFIGS", None)
    if interpreted() or not configs or not getattr(module, "TUNE", False):
        return []
    if recall(memo_key(gen, module, seed, False)):
        return []
    others = [c.name for c in cases(gen.program, False) if c.name != "recorded"]
    return [("recorded", i) for i in range(len(configs))] + [(name, None) for name in others]


def compile_ahead(gen, module, case_name: str, config: int | None, seed: int = 0) -> None:
    """Run `module.run` once on inputs of that case's shapes, at tile config `config` (an index into
    `module.CONFIGS`; None: the kernel's default, untuned), so that Triton compiles that specialisation
    into its on-disk cache, which every process shares: `validate` in another process then loads it
    instead of compiling it (the results are not looked at: `validate` checks them)."""
    prog, interp = gen.program, interpreted()
    case = next(c for c in cases(prog, interp) if c.name == case_name)
    device = "cpu" if interp else "cuda"
    inputs = draw(prog, case, device, torch.Generator(device=device).manual_seed(seed))
    real_config = module._config
    if config is not None:
        fixed = module.CONFIGS[config]
        module._config = lambda key, launch, tune, *interpreted: fixed  # (modules before and after that argument)
    try:
        with _tuning(module, False):
            _run_kernel(module, prog, inputs)
    finally:
        module._config = real_config


def launch_signatures(gen, module) -> list:
    """The Triton kernel signatures `validate` will launch, one `launchers.Launch` per kernel launch of each
    case, found without compiling or running anything: the kernel's launch code runs on meta tensors of the
    case's shapes and layouts, its JIT handing over what it would compile (`launchers.collecting`; for
    `launchers.build` and `launchers.compiling`). A case whose launch code needs real data is left out."""
    prog, found = gen.program, []
    for case in cases(prog, False):
        inputs = meta_inputs(prog, case)
        with launchers.collecting() as launched, _tuning(module, False):
            try:
                module.run(*[inputs[i.id] for i in prog.inputs])
            except Exception:  # noqa: BLE001  (its validation launches it as before)
                pass
        found += launched
    return found


def _errors(worst, failed, dtypes, shapes, notes) -> dict:
    src = failed or worst
    get = (lambda k: getattr(src, k)) if failed else (lambda k: src[k])
    return {"rel_l2": get("rel_l2"), "max_abs": get("max_abs"), "eager_rel_l2": get("eager_rel_l2"),
            "eager_max_abs": get("eager_max_abs"), "dtype": ",".join(dtypes), "shapes": shapes,
            "note": "; ".join(dict.fromkeys(notes)) or None}


def _through(prog, vid: str | None):
    """The lowest float precision an op on `vid`'s dependency path rounds its result to (inputs are data,
    not roundings, so they do not count). Found by tests/test_fuzz.py: `x_fp32 + tanh(x_bf16)` was held to
    fp32's tolerance although eager itself is only bf16-accurate there."""
    from advisor.codegen.ir import View

    low, seen, stack = None, set(), [vid]
    while stack:
        sid = stack.pop()
        if sid in seen or sid not in prog.values:
            continue
        seen.add(sid)
        val = prog.values[sid]
        if val.dtype in TOLERANCES and (low is None or TOLERANCES[val.dtype].rel_l2 > TOLERANCES[low].rel_l2):
            low = val.dtype
        for a in val.op.args.values():
            stack.extend(x.src for x in (a if isinstance(a, list) else [a]) if isinstance(x, View))
    return low


def _writer(prog, input_id: str) -> str | None:
    """The value written last into an input (in place)."""
    return next((v.id for v in reversed(prog.outputs) if v.id in prog.inplace and prog.inplace[v.id].src == input_id),
                None)


def _mutated(prog) -> list:
    return sorted({prog.inplace[v.id].src for v in prog.outputs if v.id in prog.inplace})


def _run_kernel(module, prog, inputs: dict) -> tuple[list, dict]:
    from advisor.validate.reference import _clone_strided

    args = {k: _clone_strided(t, t.dtype) for k, t in inputs.items()}
    real_empty = getattr(module, "_empty", None)  # absent where no output is allocated (a view is returned)
    if real_empty is not None:
        module._empty = lambda *a, **k: poison(real_empty(*a, **k))
    try:
        with np.errstate(all="ignore"):  # the interpreter's numpy warns on log(0) etc., as the GPU does not
            outs = module.run(*[args[i.id] for i in prog.inputs])
    finally:
        if real_empty is not None:
            module._empty = real_empty
    if torch.cuda.is_available() and not interpreted():
        torch.cuda.synchronize()
    return list(outs), args
