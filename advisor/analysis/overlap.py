"""Communication against compute on one rank, per steady-state iteration: how long a collective is in flight,
and how much of that the rank spends waiting (exposed) rather than computing beside it (overlapped).

The rule, one for both devices: exposed = the time communication is in flight and no compute runs on the
same device; overlapped = the rest of the communication time. Each is measured as a union of spans within
each steady-state window (a collective running past the window's end counts only inside it), summed and
divided by the iterations.

- GPU (`gpu_kernels`): communication is the communication kernels (NCCL's, on their own stream); compute is
  every other kernel on any stream (memcpy and memset are not compute: they hide nothing). An NCCL kernel
  beside a GEMM is overlapped; one alone on the device is the step waiting on the network.
- CPU (`cpu_calling_thread`, gloo): a collective runs on gloo's own threads, and the calling thread (the one
  that issued the `c10d::` op) carries on. Communication is the calling thread's `c10d::` ops and the
  backend's spans on its threads (`gloo:all_reduce`). Compute is the calling thread's other ops, less the
  `c10d::` ops they enclose (DDP's hook runs the all-reduce inside `AccumulateGrad`). So the `c10d::` op's
  own duration is exposed (the calling thread is in the collective, not computing), and so is the gap where
  it waits for the work to finish (DDP's wait at the end of backward records no op: the thread is idle while
  gloo's threads work), while the async work beside the calling thread's ops is overlapped. The other
  threads' ops (copies on gloo's threads) are the collective's, not compute. Python between two ops is
  not an op: a few microseconds per op of gap count as exposed where a collective is in flight then. A gloo
  thread's span can close well after the calling thread went on (the recorded DDP trace's last all-reduce:
  5.7 ms on gloo's thread, 0.3 ms of wait on the calling thread); the calling thread's ops beside it count it
  overlapped, so the exposed time stays what the calling thread lost, and only the communication time is
  the longer for it.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from advisor.documents import CommunicationTime
from advisor.ops.registry import is_communication
from advisor.trace.load import Trace

GPU_RULE = "gpu_kernels"
CPU_RULE = "cpu_calling_thread"


def communication_time(trace: Trace, windows: list[tuple[float, float]]) -> CommunicationTime | None:
    """The rank's communication per iteration of WINDOWS (the steady-state iterations); None where the trace
    holds no communication (a one-process trace)."""
    if not windows:
        return None
    if trace.has_gpu:
        k = trace.kernels
        comm = _is_comm(k["name"])
        compute = ~comm & (k["cat"].astype(str) == "kernel").to_numpy()
        if not comm.any():
            return None
        return _measure(GPU_RULE, windows, _spans(k, comm), _spans(k, compute), _spans(k, comm), None)
    ops = trace.ops
    if not len(ops):
        return None
    comm = _is_comm(ops["name"])
    if not comm.any():
        return None
    tid = ops["tid"].to_numpy()
    cpu_op = (ops["cat"].astype(str) == "cpu_op").to_numpy()
    calling_comm = comm & cpu_op & np.isin(tid, np.unique(tid[comm & cpu_op]))
    # The calling threads: those that issued a collective; without one recorded, the thread with the most ops
    calling = np.unique(tid[calling_comm]) if calling_comm.any() else [pd.Series(tid[cpu_op]).mode().iloc[0]]
    on_calling = np.isin(tid, calling)
    calls = _spans(ops, calling_comm)
    compute = _spans(ops, cpu_op & on_calling & ~comm)
    return _measure(CPU_RULE, windows, _spans(ops, comm), compute, calls if len(calls[0]) else _spans(ops, comm),
                    calls)


def _is_comm(names: pd.Series) -> np.ndarray:
    cats = names.astype("category")
    flags = np.array([is_communication(c) for c in cats.cat.categories], dtype=bool)
    codes = cats.cat.codes.to_numpy()
    return np.where(codes >= 0, flags[codes], False) if len(flags) else np.zeros(len(names), bool)


def _spans(frame: pd.DataFrame, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ts = frame["ts"].to_numpy(np.float64)[mask]
    return ts, ts + frame["dur"].to_numpy(np.float64)[mask]


def _measure(rule: str, windows, comm, compute, started, calls) -> CommunicationTime:
    """`comm`, `compute`: (starts, ends) of the spans; `started`: the spans counted as collectives started;
    `calls`: on the CPU, the calling thread's collectives, taken out of the compute that encloses them."""
    total = exposed = count = 0.0
    for a, b in windows:
        c = _union(*_clip(*comm, a, b))
        busy = _union(*_clip(*compute, a, b))
        if calls is not None:
            busy = _minus(busy, _union(*_clip(*calls, a, b)))
        total += _length(c)
        exposed += _length(_minus(c, busy))
        count += int(((started[0] >= a) & (started[0] < b)).sum())
    n = len(windows)
    iteration = sum(b - a for a, b in windows) / n
    return CommunicationTime(rule=rule, iteration_us=iteration, communication_us=total / n, exposed_us=exposed / n,
                             overlapped_us=(total - exposed) / n, collectives=round(count / n, 3))


def _clip(starts: np.ndarray, ends: np.ndarray, a: float, b: float) -> tuple[np.ndarray, np.ndarray]:
    keep = (ends > a) & (starts < b)
    return np.maximum(starts[keep], a), np.minimum(ends[keep], b)


def _union(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint, sorted spans covering exactly what the given spans cover."""
    if not len(starts):
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], np.maximum.accumulate(ends[order])
    new = np.ones(len(s), bool)
    new[1:] = s[1:] > e[:-1]  # a span starting after every earlier one ended opens a new run
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(s) - 1)
    return s[first], e[last]


def _minus(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The parts of disjoint sorted spans A outside disjoint sorted spans B."""
    if not len(a[0]) or not len(b[0]):
        return a
    # Cut at every boundary; keep each piece that lies in A and not in B (tested at its midpoint).
    points = np.unique(np.concatenate([a[0], a[1], b[0], b[1]]))
    lo, hi = points[:-1], points[1:]
    mid = (lo + hi) / 2
    keep = _inside(mid, a) & ~_inside(mid, b)
    return _union(lo[keep], hi[keep])


def _inside(x: np.ndarray, spans: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    k = np.searchsorted(spans[0], x, side="right") - 1
    return (k >= 0) & (x < spans[1][np.maximum(k, 0)])


def _length(spans: tuple[np.ndarray, np.ndarray]) -> float:
    return float((spans[1] - spans[0]).sum())
