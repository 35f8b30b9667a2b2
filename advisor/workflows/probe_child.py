"""The probe process of `optimize(..., isolate=True)` (`probe.py`): loads the model and inputs it was handed and
runs `optimize` on them. A Python error is not a crash (the parent's own run meets it and reports it): only the
process ending otherwise tells the parent anything.

    python -m advisor.workflows.probe_child HANDED_FILE
"""
from __future__ import annotations

import os
import sys

import torch

from advisor.errors import exception_reason
from advisor.workflows.live_model import optimize
from advisor.workflows.probe import UNLOADABLE


def main(handed: str) -> int:
    """Load what the parent handed over, run `optimize` on it; the process's exit status."""
    try:
        doc = torch.load(handed, weights_only=False)
    except Exception as e:  # noqa: BLE001
        sys.stderr.write(exception_reason(e) + "\n")
        return UNLOADABLE
    try:
        optimize(doc["model"], doc["inputs"], **doc["options"], isolate=False)
    except Exception as e:  # noqa: BLE001
        sys.stderr.write(f"optimize raised in the probe: {exception_reason(e)}\n")
    return 0


if __name__ == "__main__":
    status = main(sys.argv[1])
    sys.stderr.flush()
    os._exit(status)  # not the interpreter's teardown (dynamo's, Triton's): its end is not the model's to answer for
