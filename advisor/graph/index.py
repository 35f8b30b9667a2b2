"""Vectorised joins of the Kineto frames: kernels by launching op, module path of every op."""
from __future__ import annotations

import numpy as np
import pandas as pd

from advisor.ops.registry import PHASE_SCOPES
from advisor.trace.load import Trace


def as_strings(col: pd.Series) -> np.ndarray:
    """A string column as an object array of str; a categorical shares one str per category."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        cats = np.array([str(c) for c in col.cat.categories] + [""], dtype=object)
        return cats[col.cat.codes.to_numpy()]  # code -1 (missing) -> ""
    return np.array([str(x) for x in col], dtype=object)


def starts_with(col: pd.Series, prefix: str) -> np.ndarray:
    """Boolean mask of a string column (tested once per category when categorical)."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        flags = np.array([str(c).startswith(prefix) for c in col.cat.categories] + [False], dtype=bool)
        return flags[col.cat.codes.to_numpy()]
    return np.array([str(x).startswith(prefix) for x in col], dtype=bool)


def equals(col: pd.Series, value: str) -> np.ndarray:
    """Boolean mask col == value (tested once per category when categorical)."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        flags = np.array([str(c) == value for c in col.cat.categories] + [False], dtype=bool)
        return flags[col.cat.codes.to_numpy()]
    return np.array([str(x) == value for x in col], dtype=bool)


class KernelIndex:
    """External id of the innermost cpu op -> its kernels, joined through the launch's correlation when a
    kernel carries no External id of its own. Kernels of one op keep their trace order."""

    def __init__(self, trace: Trace) -> None:
        k = trace.kernels
        ext = k["ext_id"].to_numpy().astype(np.int64)
        if len(trace.runtime) and (ext <= 0).any():
            rt = trace.runtime[trace.runtime["correlation"] > 0].drop_duplicates("correlation")
            corr, rext = rt["correlation"].to_numpy(), rt["ext_id"].to_numpy()
            missing = ext <= 0
            ext[missing] = lookup(corr, rext, k["correlation"].to_numpy()[missing], -1)
        keep = np.flatnonzero(ext > 0)  # unattributable kernels (launched outside any recorded op) are dropped
        self.rows = keep[np.argsort(ext[keep], kind="stable")]
        self.keys, self.lo = np.unique(ext[self.rows], return_index=True)
        self.hi = np.append(self.lo[1:], len(self.rows)).astype(np.int64)
        self.names = as_strings(k["name"])
        self.ts, self.dur = k["ts"].to_numpy(), k["dur"].to_numpy()

    def bounds(self, ext: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per external id, the [lo, hi) range of its kernels in `rows` (empty when it launched none)."""
        at = np.clip(np.searchsorted(self.keys, ext), 0, max(len(self.keys) - 1, 0))
        found = (self.keys[at] == ext) if len(self.keys) else np.zeros(len(ext), dtype=bool)
        lo = np.where(found, self.lo[at] if len(self.keys) else 0, 0)
        return lo, np.where(found, self.hi[at] if len(self.keys) else 0, 0)

    def count(self, ext: np.ndarray) -> np.ndarray:
        lo, hi = self.bounds(ext)
        return hi - lo

    def get(self, ext: int, default=()) -> list:
        """[(name, ts, dur)] of the kernels one op launched."""
        lo, hi = self.bounds(np.array([ext], dtype=np.int64))
        if hi[0] == lo[0]:
            return default
        r = self.rows[lo[0]:hi[0]]
        return list(zip(self.names[r], self.ts[r].tolist(), self.dur[r].tolist()))


def lookup(keys: np.ndarray, values: np.ndarray, query: np.ndarray, default) -> np.ndarray:
    """values[keys == q] for each q (the first such key), `default` where there is none; keys unique."""
    if not len(keys):
        return np.full(len(query), default, dtype=values.dtype if len(values) else np.int64)
    order = np.argsort(keys, kind="stable")
    at = np.clip(np.searchsorted(keys[order], query), 0, len(keys) - 1)
    hit = keys[order][at] == query
    return np.where(hit, values[order][at], default)


def module_paths(trace: Trace, ops: pd.DataFrame) -> np.ndarray:
    """Innermost nn.Module path of each op, by interval nesting of the module call events.

    Prefers qualified names from the collector's `nn.Module::<qualname>` annotations; falls back to
    the python tracer's `nn.Module: Class_N` events (class instance chain).

    Per thread, the module of an op at time t is the latest-opened span (opened at or before t) that
    has not closed before t. Walking the spans once gives each its parent (the innermost span still
    open when it opened) and so its path; every op then starts at the last span opened before it and
    steps to the parent while that span has already closed -- all ops at once, one step per level.
    """
    ann = np.flatnonzero(starts_with(ops["name"], "nn.Module::"))
    if len(ann):
        src, qualified, cut = ops.iloc[ann], True, len("nn.Module::")
        s_names = as_strings(src["name"])
    else:
        src, qualified, cut = trace.modules, False, len("nn.Module: ")
        s_names = as_strings(src["name"]) if len(src) else np.empty(0, dtype=object)
    out = np.full(len(ops), "", dtype=object)
    if not len(src):
        return out
    s_ts, s_end, s_tid = src["ts"].to_numpy(), src["end"].to_numpy(), src["tid"].to_numpy()
    order = np.lexsort((-s_end, s_ts, s_tid))  # spans by (tid, ts, -end), as they open
    s_ts, s_end, s_tid, s_names = s_ts[order], s_end[order], s_tid[order], s_names[order]
    parent = np.full(len(order), -1, dtype=np.int64)
    paths = np.empty(len(order), dtype=object)
    stack: list[int] = []
    for j in range(len(order)):
        if j and s_tid[j] != s_tid[j - 1]:
            stack = []
        while stack and s_end[stack[-1]] < s_ts[j]:
            stack.pop()
        name = s_names[j][cut:]
        if stack:
            parent[j] = stack[-1]
        paths[j] = name if qualified or not stack else f"{paths[stack[-1]]}/{name}"
        stack.append(j)
    ts, tid = ops["ts"].to_numpy(), ops["tid"].to_numpy()
    last = np.full(len(ops), -1, dtype=np.int64)  # the last span of the op's thread opened at or before it
    for t in np.unique(tid):
        lo, hi = np.searchsorted(s_tid, t, "left"), np.searchsorted(s_tid, t, "right")
        mine = np.flatnonzero(tid == t)
        last[mine] = lo + np.searchsorted(s_ts[lo:hi], ts[mine], "right") - 1
        last[mine[last[mine] < lo]] = -1
    open_ = last >= 0
    while True:
        closed = open_ & (s_end[np.maximum(last, 0)] < ts)
        if not closed.any():
            break
        last[closed] = parent[last[closed]]
        open_ = last >= 0
    out[open_] = paths[last[open_]]
    return out


def phases(ops: pd.DataFrame) -> np.ndarray:
    """Which part of a training step each op ran in: `backward` or `optimizer` inside one of their scopes
    (`PHASE_SCOPES`) on the same thread, else `forward`. Per thread, an op is inside a scope when the
    scopes opened at or before it reach past it (the latest end among them: scopes may nest)."""
    out = np.full(len(ops), "forward", dtype=object)
    ts, end, tid = ops["ts"].to_numpy(), ops["end"].to_numpy(), ops["tid"].to_numpy()
    for phase, prefixes in PHASE_SCOPES.items():
        mark = np.zeros(len(ops), dtype=bool)
        for p in prefixes:
            mark |= starts_with(ops["name"], p)
        for t in np.unique(tid[mark]):
            scope = mark & (tid == t)
            order = np.argsort(ts[scope], kind="stable")
            s_ts, s_reach = ts[scope][order], np.maximum.accumulate(end[scope][order])
            mine = np.flatnonzero(tid == t)
            at = np.searchsorted(s_ts, ts[mine], "right") - 1
            inside = (at >= 0) & (s_reach[np.maximum(at, 0)] >= ts[mine])
            out[mine[inside]] = phase
    return out
