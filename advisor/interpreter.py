"""Where generated kernels run without a GPU: Triton's interpreter, which triton chooses when it is imported.

`TRITON_INTERPRET=1` is read as `@triton.jit` decorates a function, and `triton.language`'s own
reductions (`tl.sum`, `tl.max`) are decorated when triton is first imported. Imported earlier without
the flag (transformers imports triton), kernels with reductions fail inside the interpreter, so
`import advisor` sets the flag on a machine without a GPU, and `interpreter_problem` names the case
where it came too late.
"""
from __future__ import annotations

import os
import sys


def use_interpreter_without_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreter_problem() -> str | None:
    """Why generated kernels cannot run in Triton's interpreter in this process, or None."""
    if os.environ.get("TRITON_INTERPRET") != "1" or "triton.language" not in sys.modules:
        return None
    import triton.language as tl

    if type(tl.standard.sum).__name__ == "InterpretedFunction":
        return None
    return ("triton was imported before TRITON_INTERPRET=1 was set (e.g. by transformers), so its reductions "
            "cannot run in the interpreter: import advisor first, or set TRITON_INTERPRET=1 in the environment")
