"""Triton's own source hash, computed in a thread before this process's first kernel launch.

Triton hashes its compiler's sources and its library (hundreds of MB) the first time a process launches
any kernel, cached or not: 0.45 s (under cProfile) of a warm-cache Llama's first patched call on the H100
(reports/cold-start-h100-session23). Reading and hashing release the GIL, so `start` runs it while the
model is profiled or captured. Where the capture is short (a UNet's blocks: dynamo 0.4 s), the first
launch came while the thread was still hashing, and Triton computed the same hash again beside it
(both under cProfile: 0.56 s in the launching thread, 0.29 s in ours, reports/cold-start-session26);
`wait`, called before a recording's first launches, waits for the thread instead.
"""
from __future__ import annotations

import os
import threading

import torch

_THREAD: list = []  # the thread computing it, once a process


def start() -> None:
    """Start computing Triton's key in a thread (once a process; not under the interpreter or without a GPU)."""
    if _THREAD or os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return
    _THREAD.append(threading.Thread(target=_compute, name="fusion-advisor-triton-key", daemon=True))
    _THREAD[0].start()


def wait(timeout: float = 30.0) -> None:
    """Until the thread `start` began has the key (no-op without one, or from that thread itself)."""
    if _THREAD and _THREAD[0] is not threading.current_thread():
        _THREAD[0].join(timeout)


def _compute() -> None:
    try:
        try:
            from triton.runtime.cache import triton_key
        except ImportError:  # older Triton
            from triton.compiler.compiler import triton_key
        triton_key()  # (an lru_cache: the launch finds it there)
    except Exception:  # noqa: BLE001  (an optimisation: the first launch computes it as before)
        pass
