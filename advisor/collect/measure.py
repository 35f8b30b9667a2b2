"""Device facts measured at collection time: what the device is, its sustained copy bandwidth, and launch cost.

Kept short (well under 2 s together) so they can run after every profile.
- bandwidth: bytes read + written per second by a large copy. GPU: device-to-device copy of a 256 MiB
  random buffer, timed with CUDA events, median of 10 after warm-up. CPU: `clone()` of a 256 MiB
  tensor, median (first clones, which mostly measure page faults, are warm-up).
- launch: cost of one empty kernel launch. GPU: a CUDA graph of back-to-back trivial kernels
  (`add_` on a 1-element tensor) replayed between two CUDA events, divided by their number; the host
  side is `dispatch_us`, back-to-back eager calls timed on the host clock. CPU: per-call time
  of the same trivial op, i.e. the dispatcher's cost.
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any, Dict, Optional

import torch

BW_BYTES = 256 << 20  # 256 MiB


def device_info(device: str) -> Dict[str, Any]:
    if device == "cuda":
        idx = torch.cuda.current_device()
        p = torch.cuda.get_device_properties(idx)
        info: Dict[str, Any] = {
            "type": "cuda",
            "index": idx,
            "name": p.name,
            "total_memory": int(p.total_memory),
            "sm_count": int(p.multi_processor_count),
            "capability": [int(p.major), int(p.minor)],
        }
        l2 = getattr(p, "L2_cache_size", None)
        if l2:
            info["l2_bytes"] = int(l2)
        return info
    return {"type": "cpu", "name": _cpu_name(), "threads": torch.get_num_threads(), "cores": os.cpu_count()}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def bandwidth_Bps(device: str) -> Optional[float]:
    """Sustained copy bandwidth, counting bytes read plus written (bytes/s)."""
    if device == "cuda":
        return _gpu_bandwidth()
    return _cpu_bandwidth()


def _gpu_bandwidth() -> float:
    n = BW_BYTES // 4
    src = torch.rand(n, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * BW_BYTES / statistics.median(times)


def _cpu_bandwidth(budget_s: float = 0.6) -> float:
    src = torch.ones(BW_BYTES // 4)
    times = []
    t_end = time.perf_counter() + budget_s
    i = 0
    while i < 12:
        t0 = time.perf_counter()
        y = src.clone()
        dt = time.perf_counter() - t0
        del y
        if i >= 2:  # first clones fault their pages in
            times.append(dt)
        i += 1
        if time.perf_counter() > t_end and len(times) >= 3:
            break
    del src
    return 2 * BW_BYTES / statistics.median(times)


def launch_us(device: str) -> Optional[float]:
    """GPU-side cost of one tiny kernel in a stream of them (GPU), or one trivial op dispatch (CPU), in µs.

    On a GPU this replays a CUDA graph of back-to-back tiny kernels, so host dispatch is out of the
    number: it is what one kernel fewer saves on the GPU timeline. Host cost is `dispatch_us`.
    """
    if device != "cuda":
        return dispatch_us(device)
    x = torch.zeros(1, device="cuda")
    n = 200
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            x.add_(1)  # warm-up on the capture stream, as graph capture requires
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / n)
    return statistics.median(samples)


def dispatch_us(device: str) -> Optional[float]:
    """Host-side cost of one trivial eager op (Python -> dispatcher -> launch), in µs."""
    x = torch.zeros(1, device=device)
    for _ in range(100):
        x.add_(1)
    n, samples = 500, []
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            x.add_(1)
        samples.append((time.perf_counter() - t0) * 1e6 / n)
    if device == "cuda":
        torch.cuda.synchronize()
    return statistics.median(samples)


def measure(device: str) -> Dict[str, Any]:
    """bandwidth_Bps and launch_us for `device`; a failed measurement is None with the reason kept."""
    out: Dict[str, Any] = {"bandwidth_Bps": None, "launch_us": None, "dispatch_us": None}
    errors = []
    with torch.inference_mode():
        for key, fn in (("bandwidth_Bps", bandwidth_Bps), ("launch_us", launch_us), ("dispatch_us", dispatch_us)):
            try:
                out[key] = float(fn(device))
            except Exception as e:  # e.g. the workload left the GPU in an error state
                errors.append(f"{key}: {type(e).__name__}: {e}")
    if errors:
        out["measure_error"] = "; ".join(errors)
    return out
