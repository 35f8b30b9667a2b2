"""Wall seconds per named step: `optimize`'s phases, each kernel's generate and validate and their steps;
and the median time of a call (`time_call`).

Below every stage: validation times its own steps and patching times a generated backward against
PyTorch's, so the clocks live here; `advisor.measure.timing` (configurations of a call compared in
interleaved rounds, for the workflows) builds on `time_call`.

On a GPU each iteration is bracketed by CUDA events (device time of everything it launched, host
overheads included when they stall the stream), after warm-up, and the median is reported. On the
CPU generated kernels run in Triton's interpreter, so times say nothing about fusion: callers mark
them `timing_meaningful: false` and claim no speedup.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

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


WARMUP = 5
ITERS = 20


@dataclass
class Timing:
    median_ms: float
    iters: int
    method: str  # "cuda_events" | "perf_counter"
    samples_ms: list = field(default_factory=list)
    spread_ms: float = 0.0  # max - min of the medians of interleaved rounds (time_configs)
    rounds_ms: list = field(default_factory=list)  # the median of each interleaved round (time_configs)
    rounds_low_ms: list = field(default_factory=list)  # the fastest call of each interleaved round (time_configs)

    def as_dict(self) -> dict:
        return {"median_ms": round(self.median_ms, 4), "iters": self.iters, "method": self.method,
                "min_ms": round(min(self.samples_ms), 4), "max_ms": round(max(self.samples_ms), 4),
                "spread_ms": round(self.spread_ms, 4)}


def time_call(fn: Callable[[], object], device: str, warmup: int = WARMUP, iters: int = ITERS) -> Timing:
    """Median time of `fn()` over `iters` calls after `warmup` calls."""
    iters = max(1, iters)
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in pairs:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        samples = [s.elapsed_time(e) for s, e in pairs]
        return Timing(statistics.median(samples), iters, "cuda_events", samples)
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return Timing(statistics.median(samples), iters, "perf_counter", samples)


def timing_meaningful(device: str) -> bool:
    """Only GPU timings of compiled Triton kernels say anything about fusion."""
    from advisor.interpreter import forced

    return device == "cuda" and not forced()
