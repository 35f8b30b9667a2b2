"""`advisor.region(name)`: mark the steady-state region of a workload.

Inside a profile it shows as a record_function `advisor.region::NAME` (which the collector selects
with `--region NAME`) and as an NVTX range of the same name (seen by Nsight Systems). Observers
(`observe_regions`) are entered inside every region: `apply` times a script's regions with one.
"""
from __future__ import annotations

import contextlib

REGION_PREFIX = "advisor.region::"

_observers: list = []  # callables (region name) -> context manager, entered inside every region


@contextlib.contextmanager
def region(name: str):
    import torch  # with nvtx_ranges (nvtx), loaded by the first region, not by `import advisor` (which imports this module)

    from advisor.collect.nvtx_ranges import nvtx_range

    with nvtx_range(name), torch.profiler.record_function(REGION_PREFIX + name), contextlib.ExitStack() as inside:
        for observer in list(_observers):
            inside.enter_context(observer(name))
        yield


@contextlib.contextmanager
def observe_regions(observer):
    """While the block runs, `observer(name)` is entered inside every `region(name)`."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)
