"""Wall seconds per named step: `optimize`'s phases, each kernel's generate and validate and their steps.

Below every stage: validation times its own steps, and `advisor.bench` (the timing of whole calls, output
comparison) reads validation's tolerances, so the clock cannot live there.
"""
from __future__ import annotations

import contextlib
import time

import torch


class Stopwatch:
    """Wall seconds per named step, summed over repeats (`with watch("compare"): ...`). Synchronised on a
    GPU, so work a step queued is charged to it and not to the next."""

    def __init__(self):
        self.seconds: dict = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - t0, 3)
