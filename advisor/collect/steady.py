"""Find the steady-state iterations of a workload in its Kineto events.

Sources, in order:
  region  -- with `--region NAME`: `user_annotation` events named `advisor.region::NAME` (written by
             `advisor.region(NAME)` and by NVTX ranges NAME, which the collector turns into record
             functions while profiling); failing those, `user_annotation` events named exactly NAME
             (a plain `torch.profiler.record_function(NAME)`).
  module  -- the calls of the outermost nn.Module: `python_function` events `nn.Module: Class_N` with
             no nn.Module ancestor along `Python parent id` -> `Python id`; the most-called such module
             (ties: the one whose calls ran more cpu ops) is the iteration.
  whole   -- one iteration spanning every duration event of the trace.
A training loop (autograd's backward or an optimizer step after the module's calls) makes each module
call's window reach to the last backward or optimizer event before the next call: an iteration is then
a training step, forward, backward and optimizer (`training_step` in the result).
Nested occurrences of the chosen region are folded into the outermost one. With two or more iterations
the first (or the schedule's `warmup` first) is dropped as warm-up. Windows are `[ts, ts + dur]` in the Kineto `ts` time base (us).
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Optional, Tuple

from advisor.collect.nvtx_ranges import REGION_PREFIX
from advisor.ops.registry import PHASE_SCOPES

MODULE_PREFIX = "nn.Module: "


def _window(e: Dict[str, Any]) -> Tuple[float, float]:
    ts = float(e["ts"])
    return ts, ts + float(e.get("dur", 0) or 0)


def _outermost(events: List[Dict[str, Any]]) -> List[Tuple[float, float]]:
    """Windows of `events`, dropping any nested inside an earlier one on the same thread."""
    out: List[Tuple[float, float]] = []
    last_end: Dict[Any, float] = {}
    for e in sorted(events, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0) or 0))):
        b, en = _window(e)
        key = (e.get("pid"), e.get("tid"))
        if key in last_end and b < last_end[key]:
            continue
        last_end[key] = en
        out.append((b, en))
    return sorted(out)


def region_names(events: Iterable[Dict[str, Any]]) -> List[str]:
    names = {e["name"][len(REGION_PREFIX):] for e in events
             if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(REGION_PREFIX)}
    return sorted(names)


def find_region(events: List[Dict[str, Any]], name: str) -> List[Tuple[float, float]]:
    ua = [e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"]
    hits = [e for e in ua if e.get("name") == REGION_PREFIX + name]
    if not hits:
        hits = [e for e in ua if e.get("name") == name]
    return _outermost(hits)


def root_module_calls(events: List[Dict[str, Any]]) -> Tuple[Optional[str], List[Tuple[float, float]]]:
    """(name, windows) of the most-called outermost nn.Module, or (None, [])."""
    py = [e for e in events if e.get("cat") == "python_function" and e.get("ph") == "X"]
    by_id = {}
    for e in py:
        pid_ = (e.get("args") or {}).get("Python id")
        if pid_ is not None:
            by_id[pid_] = e
    roots: Dict[str, List[Dict[str, Any]]] = defaultdict(list)
    for e in py:
        name = str(e.get("name", ""))
        if not name.startswith(MODULE_PREFIX):
            continue
        parent = (e.get("args") or {}).get("Python parent id")
        seen = set()
        nested = False
        while parent is not None and parent not in seen:
            seen.add(parent)
            p = by_id.get(parent)
            if p is None:
                break
            if str(p.get("name", "")).startswith(MODULE_PREFIX):
                nested = True
                break
            parent = (p.get("args") or {}).get("Python parent id")
        if not nested:
            roots[name].append(e)
    if not roots:
        return None, []
    op_starts = sorted(float(e["ts"]) for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X")

    def ops_inside(windows: List[Tuple[float, float]]) -> int:
        return sum(bisect.bisect_right(op_starts, en) - bisect.bisect_left(op_starts, b) for b, en in windows)

    # Ties on calls (a model and its loss module, each called once a step) go to the one whose calls ran more
    # ops: a count the workload fixes. Their durations would not: on a loaded machine the lighter module's calls
    # can take longer, and the iteration, and everything analysed within it, would change from run to run.
    calls = {name: _outermost(evs) for name, evs in roots.items()}
    most = max(len(w) for w in calls.values())
    tied = [name for name, w in calls.items() if len(w) == most]
    name = max(tied, key=lambda n: (ops_inside(calls[n]), -calls[n][0][0])) if len(tied) > 1 else tied[0]
    return name[len(MODULE_PREFIX):], calls[name]


# Events that mark a training step's work after the forward (the backward's nodes, the optimizer's step)
TRAINING_MARKS = tuple(p for prefixes in PHASE_SCOPES.values() for p in prefixes)


def training_steps(events: List[Dict[str, Any]], windows: List[Tuple[float, float]]) -> Optional[List[Tuple[float, float]]]:
    """Each module-call window extended over the backward and optimizer events that start after it and
    before the next call; None when no call is followed by any (inference, or training with no backward)."""
    marks = sorted(_window(e) for e in events
                   if e.get("ph") == "X" and "ts" in e and str(e.get("name", "")).startswith(TRAINING_MARKS))
    if not marks:
        return None
    starts = [b for b, _ in marks]
    out, extended = [], False
    for k, (b, en) in enumerate(windows):
        nxt = windows[k + 1][0] if k + 1 < len(windows) else float("inf")
        lo, hi = bisect.bisect_left(starts, en), bisect.bisect_left(starts, nxt)
        if hi > lo:  # the marks of this step: those starting between this call's end and the next call
            en, extended = max(en, max(e for _, e in marks[lo:hi])), True
        out.append((b, en))
    return out if extended else None


def whole_trace(events: List[Dict[str, Any]]) -> List[Tuple[float, float]]:
    spans = [_window(e) for e in events if e.get("ph") == "X" and "ts" in e and e.get("cat") != "Trace"]
    if not spans:
        return []
    return [(min(b for b, _ in spans), max(en for _, en in spans))]


def steady_state(events: List[Dict[str, Any]], region: Optional[str] = None, warmup: int = 1,
                 wait: int = 0) -> Dict[str, Any]:
    """The `steady_state` block of meta.json (plus `requested_region` when --region found nothing); the first
    `warmup` iterations are dropped, as long as one is left. `calls` numbers each iteration kept (from 1): the
    call of the outermost module in the script (the `wait` unprofiled ones counted), or the region's occurrence
    among those recorded: what makes the ranks of a distributed job agree (advisor.collect.distributed)."""
    source, name, windows = None, None, []
    missing_region = None
    if region:
        windows = find_region(events, region)
        if windows:
            source, name = "region", region
        else:
            missing_region = region
    training = None
    if not windows:
        mod, windows = root_module_calls(events)
        if windows:
            source, name = "module", mod
            training = training_steps(events, windows)
            windows = training or windows
    if not windows:
        source, name, windows = "whole", None, whole_trace(events)
    found = len(windows)
    dropped = max(0, min(warmup, found - 1))
    out: Dict[str, Any] = {
        "source": source,
        "name": name,
        "iterations": [[round(b, 3), round(e, 3)] for b, e in windows[dropped:]],
        "calls": [(wait if source == "module" else 0) + k + 1 for k in range(dropped, found)],
        "warmup_dropped": dropped,
        "found": found,
    }
    if training:
        out["training_step"] = True
    if missing_region is not None:
        out["requested_region"] = missing_region
    return out


def in_windows(ts: float, windows: List[List[float]]) -> bool:
    return any(b <= ts <= e for b, e in windows)


def summarize(events: List[Dict[str, Any]], steady: Dict[str, Any]) -> Dict[str, Any]:
    """Counts and times for the terminal summary: totals and per steady iteration."""
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    aten = sum(1 for e in cpu_ops if str(e.get("name", "")).startswith("aten::"))
    wins = steady.get("iterations") or []
    n_it = max(len(wins), 1)

    # GPU time per steady iteration: kernels whose launch (runtime event, same correlation) lies in a window.
    launch_ts = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            c = (e.get("args") or {}).get("correlation")
            if c is not None:
                launch_ts[c] = float(e["ts"])
    k_steady = [k for k in kernels
                if in_windows(launch_ts.get((k.get("args") or {}).get("correlation"), float("nan")), wins)]

    # CPU op time: top-level cpu_ops only (children are inside their parents' time).
    top = []
    last_end: Dict[Any, float] = {}
    for e in sorted(cpu_ops, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0) or 0))):
        b, en = _window(e)
        key = (e.get("pid"), e.get("tid"))
        if key in last_end and b < last_end[key]:
            continue
        last_end[key] = en
        top.append(e)
    top_steady = [e for e in top if in_windows(float(e["ts"]), wins)]
    return {
        "cpu_ops": len(cpu_ops),
        "aten_ops": aten,
        "kernels": len(kernels),
        "kernels_per_iter": len(k_steady) / n_it,
        "gpu_us_per_iter": sum(float(k.get("dur", 0) or 0) for k in k_steady) / n_it,
        "gpu_us_total": sum(float(k.get("dur", 0) or 0) for k in kernels),
        "cpu_op_us_per_iter": sum(float(e.get("dur", 0) or 0) for e in top_steady) / n_it,
        "cpu_ops_per_iter": sum(1 for e in cpu_ops if in_windows(float(e["ts"]), wins)) / n_it,
    }
