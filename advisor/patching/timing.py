"""Where a patched model's first call spends its time: seconds per phase, summed over the process.

    from advisor.patching import timing
    before = timing.snapshot(); model(x); print(timing.since(before))

Phases: `dynamo` (dynamo's own compile time: bytecode tracing, guards; from its metrics, less the
backend), `backend` (our backend as dynamo timed it: AOTAutograd + the rewrite), `rewrite` (matching
and substituting every pattern), `patterns` (building the patterns from their programs), `find` (the
matcher), `substitute`, `recompile` (`gm.recompile`), `launchers` (importing the generated kernel
modules), `record` (CUDA-graph recordings, their warm-up call included), `captures` (graphs dynamo
handed the backend), `aot` (the backend less the rewrite: AOTAutograd), `rewrites` (graphs rewritten:
shared graphs are rewritten once). Cheap enough to stay on: a clock read per phase entered, none on the
replay path.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

SECONDS: dict = defaultdict(float)


@contextlib.contextmanager
def timed(phase: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        SECONDS[phase] += time.perf_counter() - t0


def count(what: str, n: int = 1) -> None:
    SECONDS[what] += n


def snapshot() -> dict:
    """Our phases plus dynamo's (its compile time less the backend's)."""
    out = dict(SECONDS)
    try:
        from torch._dynamo.utils import compilation_time_metrics as m
    except Exception:  # noqa: BLE001  (another torch: dynamo's metrics are a bonus)
        m = {}
    total = sum(m.get("_compile.compile_inner", []))
    backend = sum(m.get("OutputGraph.call_user_compiler", []))
    out["dynamo"] = total - backend
    out["backend"] = backend
    out["aot"] = backend - out.get("rewrite", 0.0)  # AOTAutograd (and the little else our backend does)
    return out


def since(before: dict) -> dict:
    """Seconds (and counts) per phase between a `snapshot` and now, rounded; phases that did not move left out."""
    now = snapshot()
    return {k: round(v - before.get(k, 0.0), 3) for k, v in sorted(now.items()) if v - before.get(k, 0.0) > 5e-4}
