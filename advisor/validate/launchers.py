"""What a validation will launch, known before it launches: Triton's launchers built and its kernels compiled
ahead, several at once.

Up to Triton 3.6, the first launch of a kernel signature (its arguments' names and types, ints equal to 1
made constants) in a process has gcc build a C launcher for it into Triton's on-disk cache, 0.3-0.4 s each
on the H100's host. A validation launches two (its recorded and odd shapes share one; the all-ones shape's
sizes of 1 make another), each on its compile job's path: with the driver's utilities and Triton's hash,
most of a row kernel's first case (1.1 of its job's 2.2 s: reports/cold-start/triton-setup).

Which signatures a validation launches is known before anything compiles: the kernel's own launch code,
run on meta tensors of each case (`inputs.meta_inputs`), reaches Triton's JIT, which hands its cache hook
(`knobs.runtime.jit_cache_hook`) the signature before compiling and skips the compile when the hook says
so (`collecting`). `build` then has gcc make each launcher into the cache, several at once, while the
compile workers start; their jobs, and this process's first patched call, load it from there. Newer Triton
launches every kernel through one launcher of its driver: there is nothing to build.

A validation's own cases compile one after another as each first launches (its recorded, odd and all-ones
shapes: a Triton compile each, 0.1-0.6 s on the H100's host, most of a job's 0.8-1.7 s beside drawing inputs,
the references and comparing). `compiling` starts every one of them at the validation's start, in threads
(Triton's `AsyncCompileMode`), while the first case draws its inputs and runs its references; each launch
then waits for its own compile only. ptxas and part of the passes run outside the GIL, the front end does
not: the kernel steps shrink by 60-85% and the job's other steps slow meanwhile; jobs came out 0-35%
shorter on the H100 (reports/cold-start). So only a compile worker's jobs do it
(`validate(compile_at_once=True)`): in `optimize`'s own process they would slow the model's capture.
"""
from __future__ import annotations

import contextlib
import os
import threading
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

_STATE = threading.local()  # .found: the list this thread's launches are collected into, while collecting
_HOOK = threading.Lock()
_USERS = [0, None]  # collections going on in any thread, and the hook installed before the first of them
# What Triton's launcher reads from a compiled kernel's metadata besides its signature: none of it goes into
# the C source it builds (the launcher's cache key), only into the Python wrapper around it
_NO_METADATA = types.SimpleNamespace(num_ctas=1, tensordesc_meta=None, global_scratch_size=0, global_scratch_align=1,
                                     profile_scratch_size=0, profile_scratch_align=1,
                                     launch_cooperative_grid=False, launch_pdl=False)


class Launch(NamedTuple):
    """One kernel launch as Triton's JIT described it to its cache hook, before compiling."""
    fn: Any  # the JIT function
    signature: dict  # argument name -> Triton type
    constants: dict  # arguments made compile-time constants (constexprs, ints equal to 1)
    specialization: str | None  # the JIT's own description of the compile, for `JITFunction.preload`


@contextlib.contextmanager
def collecting():
    """Inside: a Triton kernel this thread launches compiles nothing and launches nothing (its JIT returns
    None); its (JIT function, signature, constants) goes into the list this yields. Other threads' launches
    go on as before (to the hook installed before, if any). Collections in several threads at once share one
    hook, installed by the first and taken out by the last (where it is still the one installed)."""
    from triton import knobs

    with _HOOK:
        if _USERS[0] == 0:
            _USERS[1] = knobs.runtime.jit_cache_hook
            knobs.runtime.jit_cache_hook = _collect
        _USERS[0] += 1
    _STATE.found = found = []
    try:
        yield found
    finally:
        _STATE.found = None
        with _HOOK:
            _USERS[0] -= 1
            if _USERS[0] == 0:
                if knobs.runtime.jit_cache_hook is _collect:
                    knobs.runtime.jit_cache_hook = _USERS[1]
                _USERS[1] = None


def _collect(**kw):
    found = getattr(_STATE, "found", None)
    if found is None:  # another thread's launch: as before
        return _USERS[1](**kw) if _USERS[1] else None
    compile_ = kw["compile"]
    found.append(Launch(kw["fn"].jit_function, dict(compile_["signature"]), dict(compile_["constants"]),
                        compile_.get("specialization_data")))
    return True  # skip the compile


def per_signature() -> bool:
    """Whether this Triton builds a launcher per kernel signature (3.6 and older: its driver's
    `make_launcher` writes the C source gcc compiles)."""
    try:
        from triton.backends.nvidia import driver as nvidia
    except ImportError:
        return False
    return hasattr(nvidia, "make_launcher")


def build(found: list, workers: int | None = None) -> int:
    """Have each distinct launcher among `found` (from `collecting`) built into Triton's cache, `workers` at
    once (gcc runs outside the GIL), or loaded where it is there already. Returns how many were made ready;
    one that fails is left to the launch that needs it (which builds it as before)."""
    if not found or not per_signature():
        return 0
    distinct = {}
    for fn, signature, constants, _ in found:
        if any(isinstance(t, str) and t.startswith("tensordesc") for t in signature.values()):
            continue  # a tensor descriptor's launcher depends on how it compiled: not known before
        distinct.setdefault((id(fn), tuple(signature.items())), (fn, signature, constants))
    if not distinct:
        return 0
    n = workers or min(len(distinct), os.cpu_count() or 1, 8)
    with ThreadPoolExecutor(n, thread_name_prefix="fusion-advisor-launcher") as pool:
        return sum(pool.map(_make, distinct.values()))


def _make(entry) -> bool:
    from triton.runtime.driver import driver

    fn, signature, constants = entry
    try:
        driver.active.launcher_cls(fn.ASTSource(fn, signature, constants, {}), _NO_METADATA)
        return True
    except Exception:  # noqa: BLE001  (another Triton's launcher: its first launch builds it)
        return False


@contextlib.contextmanager
def compiling(found: list, workers: int | None = None):
    """Inside: the distinct kernels of `found` (this thread's launches to come, from `collecting`) compile in
    `workers` threads, all started at once; this thread's launch of one of them waits for its compile (Triton's
    `AsyncCompileMode`, which hands a launch the compile already under way for the same kernel) instead of
    compiling it. Yields how many were started. One that fails to compile fails its launch as it would have;
    at the end the compiles still running are waited for, their errors left to the launches. Where this
    Triton has no such mode, or another is active in this thread, nothing is started (the launches compile)."""
    distinct = {}
    for launch in found:
        if launch.specialization:
            distinct.setdefault((id(launch.fn), launch.specialization), launch)
    async_mode = _async_compile_mode() if distinct else None  # (Triton's internals looked at only when needed)
    if async_mode is None:
        yield 0
        return
    n = workers or min(len(distinct), os.cpu_count() or 1, 8)
    pool = ThreadPoolExecutor(n, thread_name_prefix="fusion-advisor-compile")
    try:
        with async_mode(pool, ignore_errors=True):
            started = sum(_start(launch) for launch in distinct.values())
            yield started
    finally:
        pool.shutdown(wait=True)


def _async_compile_mode():
    """Triton's `AsyncCompileMode`, or None where this Triton has none or one is active in this thread already."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode, active_mode
    except ImportError:
        return None
    return AsyncCompileMode if active_mode.get() is None else None


def _start(launch: Launch) -> bool:
    try:
        launch.fn.preload(launch.specialization)  # under the mode: submitted to its threads, not compiled here
        return True
    except Exception:  # noqa: BLE001  (another Triton's description: its launch compiles it as before)
        return False
