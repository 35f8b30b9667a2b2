"""Where Triton kernels run: chosen per launch from the tensors' device, never for the whole process.

Triton reads `TRITON_INTERPRET=1` as `@triton.jit` decorates a function, and `triton.language`'s own
reductions (`tl.sum`, `tl.max`) are decorated when triton is first imported: a process-wide flag set by us
would come too late where triton was imported first (transformers imports it) and would send the user's
own later `@triton.jit` kernels to the interpreter. So nothing here sets it. Instead each kernel of a
generated module (`codegen.cache.load_module`) and of `advisor/kernels` gets `interpret_on_cpu`: an
instance-level `run` that, when a tensor argument lives on the CPU, launches the kernel as Triton's
`InterpretedFunction`, and otherwise calls the JIT's own `run` (the GPU, or meta tensors when launchers are
built ahead). Within an interpreted launch (`interpreting`) the `@jit` functions the kernel calls (`tl.sum`,
`tl.max`, our helpers: JITFunctions, whose `__call__` refuses outside a compile) are called as
`InterpretedFunction`s, and `knobs.runtime.interpret` is on (constexpr functions read it) without touching
the environment; both are put back when the launch ends. Triton's interpreter is not thread-safe anyway
(it patches `triton.language` for each launch), so interpreted launches take one lock.

A user who sets TRITON_INTERPRET=1 themselves is honoured: every kernel is then an `InterpretedFunction`
from the start, and our kernels' launches still go through `interpreting` (so they run even where triton
was imported before the flag). `forced()` says whether they did.

The interpreter also converts float32 to bfloat16 by truncation where the GPU rounds to nearest even:
`round_like_the_gpu` (and `codegen.helpers.reduce_helpers_in_numpy`) patch the interpreter's classes, applied
before the first interpreted launch; the GPU never runs that code.
"""
from __future__ import annotations

import os
import threading
import warnings
from contextlib import contextmanager

_LOCK = threading.RLock()  # one interpreted launch at a time (the interpreter patches triton.language per launch)
_DEPTH = [0]  # interpreted launches under way (in the thread holding _LOCK): one inside another keeps the swap
_PATCHES: dict = {}  # marker -> (owner, method, make): the interpreter patches, applied before its first launch
_PATCHED: set = set()  # the markers applied
_INTERPRETED: dict = {}  # a @jit function's Python function -> its InterpretedFunction


def forced() -> bool:
    """Whether the user asked for Triton's interpreter everywhere (TRITON_INTERPRET=1 in the environment: we
    never set it)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def runs_interpreted(device) -> bool:
    """Whether a kernel launched on tensors of `device` (a torch.device or its type's name) runs in Triton's
    interpreter: on the CPU, or everywhere when the user asked for it."""
    kind = device if isinstance(device, str) else getattr(device, "type", str(device))
    return kind == "cpu" or forced()


def _quiet_numpy_warnings() -> None:
    """The interpreter computes with numpy, which warns where a GPU and PyTorch's own ops return inf or nan
    quietly (log(0) after a relu: "RuntimeWarning: divide by zero encountered in log" in the user's
    terminal). Only warnings raised from the interpreter's own lines are silenced."""
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")


def interpret_on_cpu(kernel):
    """Make `kernel` (a @triton.jit function, an InterpretedFunction, or an autotuner/heuristics around one)
    run in Triton's interpreter when launched on CPU tensors, and as before otherwise. Returns `kernel`."""
    target = kernel
    while not _is_kernel(target) and hasattr(target, "fn"):  # Autotuner, Heuristics: their run calls fn.run
        target = target.fn
    if not _is_kernel(target) or "run" in vars(target):
        return kernel
    original = target.run  # the class's run, bound
    interpreted_already = type(target).__name__ == "InterpretedFunction"

    def run(*args, grid, warmup, **kwargs):
        if interpreted_already or _on_cpu(args, kwargs):
            if warmup:  # nothing compiles in the interpreter
                return None
            launch = original if interpreted_already else _interpreted(target).run
            with interpreting():
                return launch(*args, grid=grid, warmup=False, **kwargs)
        return original(*args, grid=grid, warmup=warmup, **kwargs)

    run.advisor_interprets_on_cpu = True
    target.run = run
    return kernel


def interpret_module_on_cpu(module) -> None:
    """`interpret_on_cpu` for every Triton kernel among `module`'s globals (a generated module, advisor/kernels)."""
    for value in list(vars(module).values()):
        if _is_kernel(value) or _is_kernel(getattr(value, "fn", None)):
            interpret_on_cpu(value)


def _is_kernel(obj) -> bool:
    return type(obj).__name__ in ("JITFunction", "InterpretedFunction") and hasattr(obj, "run")


def _on_cpu(args, kwargs) -> bool:
    """Whether the launch's first tensor argument lives on the CPU (a launch's tensors share one device)."""
    import torch

    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type == "cpu"
    for a in kwargs.values():
        if isinstance(a, torch.Tensor):
            return a.device.type == "cpu"
    return False


def _interpreted(fn):
    """`fn` as an InterpretedFunction (itself where it is one)."""
    if type(fn).__name__ == "InterpretedFunction":
        return fn
    hit = _INTERPRETED.get(fn.fn)
    if hit is None:
        from triton.runtime.interpreter import InterpretedFunction

        hit = _INTERPRETED[fn.fn] = InterpretedFunction(fn.fn)
    return hit


def _call_interpreted(self, *args, **kwargs):
    """`JITFunction.__call__` within an interpreted launch: a @jit function called from the kernel (tl.sum, a
    helper) runs interpreted, as it would had it been decorated under TRITON_INTERPRET=1."""
    return _interpreted(self)(*args, **kwargs)


@contextmanager
def interpreting():
    """Within: @jit functions called from a kernel run in the interpreter, and `knobs.runtime.interpret` is on
    (not written to the environment). One at a time; re-entrant."""
    with _LOCK:
        if _DEPTH[0]:
            _DEPTH[0] += 1
            try:
                yield
            finally:
                _DEPTH[0] -= 1
            return
        from triton import knobs
        from triton.runtime.jit import JITFunction

        _apply_patches()
        _quiet_numpy_warnings()
        runtime = knobs.runtime
        call = JITFunction.__dict__.get("__call__")
        knob = runtime.__dict__.get("interpret", _MISSING)
        JITFunction.__call__ = _call_interpreted
        runtime.__dict__["interpret"] = True  # as env_base.__set__ would, without writing TRITON_INTERPRET
        _DEPTH[0] = 1
        try:
            yield
        finally:
            _DEPTH[0] = 0
            JITFunction.__call__ = call
            if knob is _MISSING:
                runtime.__dict__.pop("interpret", None)
            else:
                runtime.__dict__["interpret"] = knob


_MISSING = object()


def patch_interpreter(owner: str, method: str, marker: str, make) -> None:
    """Replace Triton's interpreter's `<owner>.<method>` (a class of `triton.runtime.interpreter`) by
    `make(original)`, marked `marker` so that it is done once. Applied before the first interpreted launch
    (at once where one has run): only interpreted launches run that code, the GPU runs Triton's own."""
    _PATCHES.setdefault(marker, (owner, method, make))
    if _PATCHED or forced():
        _apply_patches()


def _apply_patches() -> None:
    with _LOCK:
        pending = [m for m in _PATCHES if m not in _PATCHED]
        if not pending and _PATCHED:
            return
        from triton.runtime import interpreter

        _PATCHED.add(None)  # an interpreted launch has been prepared: later patches apply at once
        for marker in pending:
            owner, method, make = _PATCHES[marker]
            cls = getattr(interpreter, owner)
            if not getattr(getattr(cls, method), marker, False):
                patched = make(getattr(cls, method))
                setattr(patched, marker, True)
                setattr(cls, method, patched)
            _PATCHED.add(marker)


def round_like_the_gpu() -> None:
    """Make Triton's interpreter round float32 -> bfloat16 to nearest even, as the GPU does (the default of
    Triton's own `cast`) and as torch does. Truncating, every bf16 store carries twice the GPU's rounding
    error: over a 50-layer bf16 convnet the patched output drifted twice as far from float32 as eager's,
    and optimize's output check dropped patterns that are right. Applied before the first interpreted launch."""
    patch_interpreter("InterpreterBuilder", "cast_impl", "rounds_to_nearest_even", _rounding_cast)


def _rounding_cast(truncating):
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return truncating(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)  # NaN stays NaN
        return interpreter.TensorHandle(rounded.reshape(np.shape(src.data)), dst_type.scalar)

    return cast_impl
