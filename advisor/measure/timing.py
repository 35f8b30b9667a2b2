"""Before/after timing of a callable in this process, for the workflows: one call is timed by
`advisor.stopwatch.time_call` (below every stage: patching times a generated backward with it too).

`time_configs` compares several configurations of one call (unpatched, patched, each pattern alone):
all are warmed up together for a fixed time first (`warm_up`: GPU clocks and the allocator settle: on
an H100 the first 20 calls of an 8-layer Llama ran 25% slower than later ones), then timed in interleaved
rounds, in reversed order every other round, so drift hits all alike. Each configuration keeps its
round medians (`rounds_ms`) and fastest calls (`rounds_low_ms`): two configurations are compared round by
round (paired: a host stall or a clock change in one round hits both), and `spread_ms` (max - min of a
configuration's round medians) says how much one drifted.

In a torch.distributed job every rank times, in step (the calls of a sharded model are collectives), and the
timings are rank 0's on every rank (`advisor.agreement`): the warm-up's end too, so every rank makes as many calls.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from typing import Callable

import torch

from advisor.agreement import agreed
# timing_meaningful: the workflows ask it here, and their tests replace it here
from advisor.stopwatch import ITERS, WARMUP, Timing, time_call, timing_meaningful  # noqa: F401


def time_configs(call: Callable[[], object], configs: dict, device: str, iters: int = ITERS, rounds: int = 3,
                 warmup_s: float = 0.5) -> dict:
    """{name: Timing} for `call()` under each configuration (name -> context-manager factory)."""
    configs = {k: v or contextlib.nullcontext for k, v in configs.items()}
    warm_up(call, configs, device, warmup_s)
    per_round = max(1, math.ceil(iters / rounds))
    samples: dict = {k: [] for k in configs}
    medians: dict = {k: [] for k in configs}
    lows: dict = {k: [] for k in configs}
    for r in range(rounds):
        for name in round_order(list(configs), r):
            ctx = configs[name]
            with ctx():
                t = time_call(call, device, warmup=2, iters=per_round)
            samples[name] += t.samples_ms
            medians[name].append(t.median_ms)
            lows[name].append(min(t.samples_ms))
    method = "cuda_events" if device == "cuda" else "perf_counter"
    return agreed({k: Timing(statistics.median(samples[k]), len(samples[k]), method, samples[k],
                      max(medians[k]) - min(medians[k]), medians[k], lows[k]) for k in configs}, "timings")


def round_order(names: list, r: int) -> list:
    """The order round r times its configurations in: as given, reversed every other round (ABBA), so a
    drift within a round (clocks, the allocator, a host that slows down) falls on every configuration
    alike over two rounds instead of always on the last."""
    return names if r % 2 == 0 else names[::-1]


def warm_up(call: Callable[[], object], configs: dict, device: str, warmup_s: float) -> None:
    """`WARMUP` calls in each configuration (its first-call work: CUDA-graph recordings, a tuned kernel's
    config search), then rounds of one call in each until `warmup_s` has passed since the start. What the
    time floor is for (clocks, the allocator) settles for the GPU as a whole, not per configuration, so
    it is paid once per comparison: the same floor per configuration cost the suite's BERT about 5 s
    of selection on the H100 (eight configurations timed, then five)."""
    t0 = time.perf_counter()
    first = True
    while first or agreed(time.perf_counter() - t0 < warmup_s, "warm-up rounds"):
        for ctx in configs.values():
            with ctx():
                for _ in range(WARMUP if first else 1):
                    call()
                    if device == "cuda":
                        torch.cuda.synchronize()
        first = False
