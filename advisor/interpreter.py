"""Where generated kernels run without a GPU: Triton's interpreter, which triton chooses when it is imported.

`TRITON_INTERPRET=1` is read as `@triton.jit` decorates a function, and `triton.language`'s own
reductions (`tl.sum`, `tl.max`) are decorated when triton is first imported. Imported earlier without
the flag (transformers imports triton), kernels with reductions fail inside the interpreter, so
`import advisor` sets the flag on a machine without a GPU, and `interpreter_problem` names the case
where it came too late. The interpreter also converts float32 to bfloat16 by truncation where the GPU
rounds to nearest even: `round_like_the_gpu` gives it the GPU's rounding before any kernel runs.

Not done yet: choosing the backend per launch from the tensors' device, without the process-wide flag (which
also sends the user's own later `@triton.jit` kernels to the interpreter). Triton 3.9 allows it: a JITFunction
kernel runs interpreted on CPU tensors as `InterpretedFunction(kernel.fn)[grid](...)` provided the `@jit`
functions it calls (`tl.sum`, our helpers; JITFunctions, whose `__call__` refuses outside a compile) are
called as `InterpretedFunction`s for the launch (`JITFunction.__call__` swapped within it, with
`knobs.runtime.interpret` on: constexpr functions read it). The launch point would be an instance-level `run`
on each kernel of a generated module (`codegen.cache.load_module`) and of `advisor/kernels`; what reads
TRITON_INTERPRET today (validate.interpreted, the hand-written kernels' `_INTERPRET`, workers, triton_setup,
`patch_interpreter`) would then ask the device instead.
"""
from __future__ import annotations

import os
import sys
import warnings


def use_interpreter_without_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        # The interpreter computes with numpy, which warns where a GPU and PyTorch's own ops return inf or nan
        # quietly (log(0) after a relu: "RuntimeWarning: divide by zero encountered in log" in the user's
        # terminal). Only warnings raised from the interpreter's own lines are silenced.
        warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")


def patch_interpreter(owner: str, method: str, marker: str, make) -> None:
    """Replace Triton's interpreter's `<owner>.<method>` (a class of `triton.runtime.interpreter`) by
    `make(original)`, marked `marker` so that a second call leaves it as it is. A no-op when not
    interpreting: the GPU runs Triton's own code."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    cls = getattr(interpreter, owner)
    if getattr(getattr(cls, method), marker, False):
        return
    patched = make(getattr(cls, method))
    setattr(patched, marker, True)
    setattr(cls, method, patched)


def round_like_the_gpu() -> None:
    """Make Triton's interpreter round float32 -> bfloat16 to nearest even, as the GPU does (the default of
    Triton's own `cast`) and as torch does. Truncating, every bf16 store carries twice the GPU's rounding
    error: over a 50-layer bf16 convnet the patched output drifted twice as far from float32 as eager's,
    and optimize's output check dropped patterns that are right. A no-op when not interpreting."""
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


def interpreter_problem() -> str | None:
    """Why generated kernels cannot run in Triton's interpreter in this process, or None."""
    if os.environ.get("TRITON_INTERPRET") != "1" or "triton.language" not in sys.modules:
        return None
    import triton.language as tl

    if type(tl.standard.sum).__name__ == "InterpretedFunction":
        return None
    return ("triton was imported before TRITON_INTERPRET=1 was set (by the script before `import advisor`, or by a "
            "library that imports it, e.g. transformers), so its reductions cannot run in Triton's interpreter: "
            "import advisor before triton, or set TRITON_INTERPRET=1 in the environment")
