"""Triton's once-a-process set-up, done in a thread before this process's first kernel launch or compile.

Two costs come with a process's first Triton kernel, cached or not:
- its own source hash (`triton_key`: its compiler's sources and its library, hundreds of MB): 0.45 s (under
  cProfile) of a warm-cache Llama's first patched call on the H100 (reports/cold-start/first-call-profile);
- its CUDA driver, whose C utilities gcc builds into Triton's cache the first time any process uses that
  cache (0.3-0.5 s; a compile worker's first validation paid it, reports/cold-start/triton-setup).
Reading, hashing and gcc release the GIL, so `start` runs both while the model is profiled or captured (in
`optimize`, `patch`, and each compile worker's start-up while the parent profiles). Where the capture is
short (a UNet's blocks: dynamo 0.4 s), the first launch came while the thread was still hashing, and Triton
computed the same hash again beside it (both under cProfile: 0.56 s in the launching thread, 0.29 s in
ours, reports/cold-start/triton-setup); `wait`, called before a recording's first launches, waits instead.
"""
from __future__ import annotations

import threading

import torch

from advisor.interpreter import forced

_THREAD: list = []  # the thread setting Triton up, once a process


def start() -> None:
    """Start setting Triton up in a thread (once a process; not under the interpreter or without a GPU)."""
    if _THREAD or forced() or not torch.cuda.is_available():
        return
    _THREAD.append(threading.Thread(target=_set_up, name="fusion-advisor-triton-setup", daemon=True))
    _THREAD[0].start()


def wait(timeout: float = 30.0) -> None:
    """Until the thread `start` began is done (no-op without one, or from that thread itself)."""
    if _THREAD and _THREAD[0] is not threading.current_thread():
        _THREAD[0].join(timeout)


def _set_up() -> None:
    try:
        try:
            from triton.runtime.cache import triton_key
        except ImportError:  # older Triton
            from triton.compiler.compiler import triton_key
        triton_key()  # (an lru_cache: the launch finds it there)
        from triton.runtime.driver import driver

        driver.active.get_current_device()  # the driver, made once a process: its utilities built or loaded
    except Exception:  # noqa: BLE001  (an optimisation: the first launch does it as before)
        pass
