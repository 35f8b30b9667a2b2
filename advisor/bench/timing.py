"""Before/after timing of a callable in this process.

On a GPU each iteration is bracketed by CUDA events (device time of everything it launched, host
overheads included when they stall the stream), after warm-up, and the median is reported. On the
CPU generated kernels run in Triton's interpreter, so times say nothing about fusion: callers mark
them `timing_meaningful: false` and claim no speedup.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

WARMUP = 5
ITERS = 20


@dataclass
class Timing:
    median_ms: float
    iters: int
    method: str  # "cuda_events" | "perf_counter"
    samples_ms: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"median_ms": round(self.median_ms, 4), "iters": self.iters, "method": self.method,
                "min_ms": round(min(self.samples_ms), 4), "max_ms": round(max(self.samples_ms), 4)}


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
    import os

    return device == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
