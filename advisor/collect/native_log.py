"""Keep torch's C++ profiler chatter out of the user's terminal.

Each profiler start and stop makes torch's C++ side write to file descriptor 2, bypassing sys.stderr:
`[W... execution_trace_observer.cpp:989] Enabling Execution Trace Observer` (c10 logging; only
TORCH_CPP_LOG_LEVEL set before torch is imported hides it, too late in a user's process where
`advisor.optimize` runs) and Kineto's `USDT:... profiler_start` (no environment variable hides it,
KINETO_LOG_LEVEL included: tried with torch 2.13). So fd 2 is sent to a temporary file around the
start and the stop, and whatever else was written there meanwhile is passed on afterwards.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

NOISE = re.compile(rb"execution_trace_observer\.cpp:\d+\] (Enabling|Disabling) Execution Trace Observer"
                   rb"|USDT:.*\] profiler_(start|stop)")


@contextlib.contextmanager
def without_profiler_chatter():
    """Drop NOISE lines written to fd 2 inside the block; every other line is written out after it."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no fd 2 (a detached process): nothing to protect
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().splitlines(keepends=True) if not NOISE.search(line)]
            if kept:
                os.write(2, b"".join(kept))


@contextlib.contextmanager
def quiet_profile(prof):
    """`with quiet_profile(profile(...)) as prof:` is `with profile(...) as prof:` without the chatter."""
    with without_profiler_chatter():
        prof.__enter__()
    try:
        yield prof
    finally:
        with without_profiler_chatter():
            prof.__exit__(None, None, None)


def stop_execution_trace(observer) -> None:
    """Unregister an ExecutionTraceObserver quietly: called in a `finally`, after the run's own error if
    there was one, so a failure to stop is not allowed to replace it."""
    try:
        with without_profiler_chatter():
            observer.unregister_callback()
    except Exception:  # pragma: no cover
        pass
