"""Worker processes that generate and validate kernels in parallel (as Inductor's compile workers do).

Most of a cold start is Triton compiling each kernel (Python front end, then ptxas) at each validation
shape; threads share one GIL for the Python part, so candidates go to worker processes instead. The
pool is started once per process (`start()`; the first `generate` starts it if nobody did) and kept
for later calls; each worker imports torch, triton and the generator once.

Workers are spawned, never forked (a forked CUDA context is unusable), and without re-importing the
user's `__main__`: a script that calls `optimize` at top level, unguarded by `if __name__ ...`, would
otherwise run again in every worker. How many: $FUSION_ADVISOR_COMPILE_WORKERS if set (0 or 1 = in
process, one after another), else one per CPU up to 8 (each holds a CUDA context) on a GPU, and in
process under the interpreter (pure Python on the CPU, where the CI's cores are shared).
"""
from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.spawn
import os
import sys
import threading
from concurrent.futures import ProcessPoolExecutor

ENV = "FUSION_ADVISOR_COMPILE_WORKERS"
MAX_WORKERS = 8
_pool: ProcessPoolExecutor | None = None
_size = 0
_lock = threading.Lock()


def wanted(jobs: int, interpreted: bool) -> int:
    """Worker processes for `jobs` independent jobs; 0 = work in process."""
    text = os.environ.get(ENV)
    if text is not None and text.strip():
        try:
            n = int(text)
        except ValueError:
            n = 0
    else:
        n = 0 if interpreted else min(MAX_WORKERS, os.cpu_count() or 1)
    n = min(n, jobs) if jobs else n
    return n if n > 1 else 0


def start(n: int | None = None) -> ProcessPoolExecutor | None:
    """The shared pool with at least `n` workers (started now, so that their imports overlap whatever
    the caller does next, e.g. profiling); None when workers are off or could not start."""
    global _pool, _size
    n = wanted(0, _interpreted()) if n is None else n
    if n <= 1:
        return None
    with _lock:
        if _pool is not None and _size >= n:
            return _pool
        if _pool is not None:
            _pool.shutdown(wait=False, cancel_futures=True)
        prep = multiprocessing.spawn.get_preparation_data
        multiprocessing.spawn.get_preparation_data = _without_main(prep)
        try:
            _pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"), initializer=_init)
            _size = n
            list(_pool.map(_ready, range(n)))  # every worker started now, while the patch is in place
        finally:
            multiprocessing.spawn.get_preparation_data = prep
        return _pool


def discard() -> None:
    """Forget a broken pool (a worker died): the next `start` makes a new one."""
    global _pool, _size
    with _lock:
        if _pool is not None:
            _pool.shutdown(wait=False, cancel_futures=True)
        _pool, _size = None, 0


atexit.register(discard)


def _without_main(prep):
    def data(name):
        d = prep(name)
        d.pop("init_main_from_path", None)
        d.pop("init_main_from_name", None)
        d["sys_path"] = sys.path  # the parent's path: advisor importable from a checkout (PYTHONPATH, tests)
        return d
    return data


def _init() -> None:
    import advisor  # noqa: F401  (first: sets the interpreter up where there is no GPU, as in the parent)
    import advisor.workflows.generate  # noqa: F401  (torch, triton and the generator, once per worker)


def _ready(_: int) -> int:
    return os.getpid()


def _interpreted() -> bool:
    from advisor.validate import interpreted  # function-level: triton only when someone asks

    return interpreted()
