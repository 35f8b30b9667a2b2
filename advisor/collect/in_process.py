"""Profile a callable in this process and write a trace directory the analyzer reads (`advisor.optimize`
profiles the live model with it; `runner.py` is the collector for a script, run in a child process).

The same files the collector writes for a script (`trace/kineto.json.gz`, `et.json.gz`,
`meta.json`), made the same way: torch.profiler with shapes + ExecutionTraceObserver, module calls
named by qualified path (`advisor.collect.module_scopes`), each call wrapped in
`advisor.region(REGION)` so the steady state is exactly the calls after the first.
"""
from __future__ import annotations

import gzip
import json
import shutil
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ExecutionTraceObserver, ProfilerActivity, profile

from advisor.collect import steady
from advisor.collect.measure import device_info, measure
from advisor.collect.module_scopes import module_scopes
from advisor.collect.native_log import quiet_profile, stop_execution_trace
from advisor.collect.region import region
from advisor.fast_paths import module_level_paths
from advisor.jsonio import META_SCHEMA_VERSION, write_json

REGION = "advisor.optimize"


def profile_calls(fn: Callable[[], object], out_dir: Path, device: str, calls: int = 3) -> Path:
    """Run `fn` `calls` times under the profiler; returns the trace directory."""
    trace_dir = Path(out_dir) / "trace"
    trace_dir.mkdir(parents=True, exist_ok=True)
    kineto_tmp, et_tmp = trace_dir / "kineto.json.tmp", trace_dir / "et.json.tmp"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    et = ExecutionTraceObserver().register_callback(str(et_tmp))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
            with quiet_profile(profile(activities=activities, record_shapes=True, execution_trace_observer=et)) as prof:
                with module_scopes(), module_level_paths():  # the ops the capture will see
                    for _ in range(max(2, calls)):
                        with region(REGION):
                            fn()
                        if device == "cuda":
                            torch.cuda.synchronize()
    finally:
        stop_execution_trace(et)
    prof.export_chrome_trace(str(kineto_tmp))
    events = json.loads(kineto_tmp.read_text()).get("traceEvents", [])
    _gzip(kineto_tmp, trace_dir / "kineto.json.gz")
    if et_tmp.exists():
        _gzip(et_tmp, trace_dir / "et.json.gz")
    measured = _measured(device)
    meta = {"schema_version": META_SCHEMA_VERSION, "device": device_info(device), "script": None, "in_process": True,
            "steady_state": steady.steady_state(events, REGION), "complete": True, "error": None,
            **{k: measured.get(k) for k in ("bandwidth_Bps", "launch_us", "dispatch_us")}}
    write_json(trace_dir / "meta.json", meta, indent=2)
    return trace_dir


_MEASURED: dict = {}


def _measured(device: str) -> dict:
    """Device facts once per process: `optimize` may profile many models, the device does not change."""
    if device not in _MEASURED or _MEASURED[device].get("measure_error"):
        _MEASURED[device] = measure(device)
    return _MEASURED[device]


def _gzip(src: Path, dst: Path) -> None:
    with open(src, "rb") as fin, gzip.open(dst, "wb", compresslevel=6) as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
    src.unlink()
