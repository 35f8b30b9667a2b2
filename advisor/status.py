"""Why a pattern is or is not patched: a code for programs to branch on (`status_code` in apply.json),
beside the words for people (`status`). One closed vocabulary, written by `optimize`/`apply`, read by
the reports and the plan cache; never parse the words."""
from __future__ import annotations

from enum import Enum


class Status(str, Enum):
    PATCHED = "patched"
    NOT_GENERATED = "not_generated"  # the generator refused it, or its kernel failed validation
    NOT_WORTH = "not_worth_patching"  # estimated saving too small to pay for a capture
    INTERPRETER = "interpreter_only"  # validated, but its kernel would run in Triton's interpreter (CPU)
    NOT_CAPTURED = "module_not_captured"  # its occurrences lie in modules the plan does not capture
    NOT_MATCHED = "not_matched"  # captured, but the matcher found no occurrence in the captured graphs
    ESCAPES = "intermediate_escapes"  # its ops are there, but a value inside it is used outside it (a cache)
    NOT_LAUNCHED = "not_launched"  # substituted, but the example inputs never ran its launcher
    NOT_CALLED = "module_not_called"  # no module of the plan ran
    LAUNCHER_FAILED = "launcher_failed"
    MISMATCH = "outputs_differ"  # patched outputs differed from the unpatched model's: unpatched again
    OVERLAP = "overlapped"  # another pattern took its ops first
    NOT_KEPT = "not_kept"  # patched and correct, but not faster on this GPU
    LEFT_TO_INDUCTOR = "left_to_inductor"  # `inductor=True`: Inductor fuses these ops with their neighbours
    CUBLASLT = "cublaslt_epilogue"  # a linear and its activation: one cuBLASLt GEMM where timed faster, not our kernel

    def __str__(self) -> str:  # json.dumps writes the value
        return self.value
