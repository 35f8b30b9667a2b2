"""Worker processes that generate and validate kernels in parallel (as Inductor's compile workers do).

Most of a cold start is Triton compiling each kernel (Python front end, then ptxas) at each validation
shape; threads share one GIL for the Python part, so candidates go to worker processes instead. The
pool is started once per `generate` (`start_soon()` before profiling, so that it starts meanwhile; else
`generate` starts it), and discarded after it: each worker holds a CUDA context (~0.5 GB of GPU memory).

Workers are spawned, never forked (a forked CUDA context is unusable), and without re-importing the
user's `__main__`: a script that calls `optimize` at top level, unguarded by `if __name__ ...`, would
otherwise run again in every worker. How many: $FUSION_ADVISOR_COMPILE_WORKERS if set (0 or 1 = in
process, one after another), else one per CPU up to 8 (each holds a CUDA context) on a GPU, and in
process under the interpreter (pure Python on the CPU, where the CI's cores are shared). Unless the
variable is set, `generate` also works in process when its jobs would be done there before the workers
would have started (`generate.WORKERS_START_S`).
"""
from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.spawn
import os
import threading
from concurrent.futures import ProcessPoolExecutor

from advisor import config
from advisor.interpreter import forced

ENV = config.COMPILE_WORKERS
MAX_WORKERS = 8
_pool: ProcessPoolExecutor | None = None
_size = 0
_lock = threading.Lock()
_let_go = False  # `discard_soon` was asked since the last `start_soon`: the pool it starts goes once started


def wanted(jobs: int, interpreted: bool) -> int:
    """Worker processes for `jobs` independent jobs; 0 = work in process."""
    asked = config.current().compile_workers
    if asked is not None:
        n = asked
    else:
        n = 0 if interpreted else min(MAX_WORKERS, _cpus())
    n = min(n, jobs) if jobs else n
    return n if n > 1 else 0


def chosen_by_user() -> bool:
    """Whether $FUSION_ADVISOR_COMPILE_WORKERS says how many: then `generate` uses that many, however few its jobs."""
    return config.current().compile_workers is not None


def _cpus() -> int:
    """The CPUs this process may run on (a container's or `taskset`'s share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def start(n: int, warm=None) -> ProcessPoolExecutor | None:
    """The shared pool with at least `n` workers, all started before this returns; None when `n` < 2.
    `warm`: a module-level function each worker runs first (pickled by reference, so its module and
    what that imports, torch and triton, load at start-up rather than with the first job)."""
    global _pool, _size
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
            _pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"), initializer=warm)
            _size = n
            list(_pool.map(_ready, range(n)))  # every worker started now, while the patch is in place
        finally:
            multiprocessing.spawn.get_preparation_data = prep
        return _pool


def start_soon(warm=None) -> None:
    """Start the pool in the background (returns at once), as many workers as `wanted` allows: a caller
    about to profile and analyse calls this first, so that the workers' imports run meanwhile; `start`
    later waits for it (one lock)."""
    global _let_go
    _let_go = False
    n = wanted(0, forced())  # callers start it on a GPU: interpreted only where the user asked for it
    threading.Thread(target=_start_quietly, args=(n, warm), name="fusion-advisor-workers", daemon=True).start()


def _start_quietly(n: int, warm) -> None:
    try:
        start(n, warm)
    except Exception:  # noqa: BLE001  (the generate stage tries again and says why in one line)
        discard()
    if _let_go:  # let go before this thread had even begun the start
        discard()


def discard() -> None:
    """Forget a broken pool (a worker died), or one no longer needed: the next `start` makes a new one."""
    with _lock:
        _drop()


def discard_soon() -> None:
    """`discard` without waiting: a pool `start_soon` is still starting (the lock held while its workers
    spawn, seconds) is let go from a thread once it has started. For a `generate` with fewer than two jobs,
    which does them in this process: it waited for the whole start (the MLP block's warm run: 4.9 s of a
    5.2 s `optimize` for no kernel at all), or left every worker and its CUDA context alive until exit."""
    global _let_go
    _let_go = True  # a start not yet begun goes too, once done (`_start_quietly`)
    if _lock.acquire(blocking=False):
        try:
            _drop()
        finally:
            _lock.release()
    else:
        threading.Thread(target=discard, name="fusion-advisor-workers-discard", daemon=True).start()


def _drop() -> None:
    global _pool, _size
    if _pool is not None:
        _pool.shutdown(wait=False, cancel_futures=True)
    _pool, _size = None, 0


atexit.register(discard)


def _without_main(prep):
    def data(name):
        d = prep(name)
        d.pop("init_main_from_path", None)
        d.pop("init_main_from_name", None)
        return d
    return data


def _ready(_: int) -> int:
    return os.getpid()
