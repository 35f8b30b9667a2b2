"""`advisor.region(name)`: mark the steady-state region of a workload.

Inside a profile it shows as a record_function `advisor.region::NAME` (which the collector selects
with `--region NAME`) and as an NVTX range of the same name (seen by Nsight Systems).
"""
from __future__ import annotations

import contextlib

REGION_PREFIX = "advisor.region::"


@contextlib.contextmanager
def region(name: str):
    import torch

    from advisor.collect.nvtx_ranges import nvtx_range

    with nvtx_range(name), torch.profiler.record_function(REGION_PREFIX + name):
        yield
