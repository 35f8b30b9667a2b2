"""Dataflow without an Execution Trace: guessed from shapes and order (every candidate is low-confidence).

Kineto records each op's input shapes and dtypes but not its outputs or tensor identities. So:
ops nest by time (per thread) into a tree and become nodes by the same registry rule as with an ET;
a node's output shape is presumed (broadcast of its inputs for pointwise ops, the input for norms);
an input is taken to be the output of the node just before it when shape and dtype match and both
ran in the same module subtree, the same profiled iteration and the same thread (one iteration's last
output is not the next one's input: that guess once invented a "Residual add + LayerNorm" across
iterations); anything else is an outside tensor.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from advisor.graph.nodes import Node, Use, Value, true_bytes
from advisor.ops.args import parse_concrete
from advisor.ops.registry import TRANSPARENT, OpClass, is_aten, lookup
from advisor.trace.load import Trace

ITEMSIZE = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4, "bool": 1,
            "unsigned char": 1, "signed char": 1, "short int": 2}


def nodes_from_kineto(trace: Trace, ops: pd.DataFrame, modules: np.ndarray, kernels_by_ext: dict,
                      phase: np.ndarray | None = None):
    ops = ops[(ops["cat"] == "cpu_op") & (ops["iteration"] >= 0)]
    order = np.lexsort((-ops["end"].to_numpy(), ops["ts"].to_numpy(), ops["tid"].to_numpy()))
    rows = ops.iloc[order]
    nodes: list[Node] = []
    values: list[Value] = []
    recent: list[tuple] = []  # (shape, dtype, value id, module, (thread, iteration)) of the last output
    stack: list[tuple[float, int]] = []  # (end, owning node idx or -1) of enclosing ops
    cur_tid = None
    leaf = _leaves(rows) if not trace.has_gpu else None
    for i, (idx, r) in enumerate(zip(rows.index, rows.itertuples(index=False))):
        if r.tid != cur_tid:
            cur_tid, stack = r.tid, []
        while stack and stack[-1][0] <= r.ts:
            stack.pop()
        owner = next((o for _, o in reversed(stack) if o >= 0), -1)
        if owner >= 0:
            _charge(nodes[owner], kernels_by_ext.get(int(r.ext_id), ()))
            stack.append((r.end, owner))
            continue
        name = str(r.name)
        info = lookup(name)
        direct = kernels_by_ext.get(int(r.ext_id), ())
        is_node = (info is not None and info.cls not in TRANSPARENT) or (info is None and is_aten(name) and direct)
        if not is_node and info is None and is_aten(name) and not trace.has_gpu and leaf[i]:
            is_node = True  # an unknown aten leaf on a CPU trace: a barrier
        if not is_node:
            stack.append((r.end, -1))
            continue
        node = Node(idx=len(nodes), et_id=-1, rf_id=int(r.rf_id), op=name,
                    cls=info.cls if info else OpClass.OTHER, schema="", ts=float(r.ts), dur=float(r.dur),
                    iteration=int(r.iteration), module=modules[idx], inplace=bool(info and info.inplace),
                    phase=phase[idx] if phase is not None else "forward")
        _charge(node, direct)
        stack.append((r.end, node.idx))
        _guess_io(node, r, values, recent)
        nodes.append(node)
    if trace.has_gpu:
        nodes = [n for n in nodes if n.kernels or n.cls == OpClass.OTHER]
        remap = {n.idx: i for i, n in enumerate(nodes)}
        for i, n in enumerate(nodes):
            n.idx = i
        for v in values:
            v.producer = remap.get(v.producer, -1)
    return nodes, values


def _leaves(rows: pd.DataFrame) -> np.ndarray:
    """Per row (sorted by tid, ts): no other op of its thread starts strictly inside it. The first op of
    the thread that starts later is the one to check: it starts inside iff any does."""
    tid, ts, end = rows["tid"].to_numpy(), rows["ts"].to_numpy(), rows["end"].to_numpy()
    leaf = np.ones(len(rows), dtype=bool)
    for t in np.unique(tid):
        lo, hi = np.searchsorted(tid, t, "left"), np.searchsorted(tid, t, "right")
        nxt = lo + np.searchsorted(ts[lo:hi], ts[lo:hi], "right")
        inside = nxt < hi
        inside[inside] = ts[nxt[inside]] < end[lo:hi][inside]
        leaf[lo:hi] = ~inside
    return leaf


def _charge(node: Node, kernels) -> None:
    for name, ts, dur in kernels:
        node.kernels.append(name)
        node.kernel_spans.append((name, ts, dur))
        node.kernel_us += dur


def _guess_io(node: Node, r, values: list[Value], recent: list) -> None:
    dims, types = r.dims or [], r.types or []
    concrete = r.concrete or []
    tensor_shapes = []
    for pos, (shape, t) in enumerate(zip(dims, types)):
        if t in ITEMSIZE and isinstance(shape, list):
            shape = tuple(shape)
            nbytes = true_bytes(shape, None, ITEMSIZE[t])
            vid = next((v for s, d, v, m, w in recent[-1:]
                        if s == shape and d == t and _related(m, node.module) and w == (r.tid, node.iteration)), None)
            if vid is None:
                vid = len(values)
                values.append(Value(vid, -1, -1, shape, (), t, nbytes))
            node.reads.append(Use(vid, pos, nbytes, shape, (), t))
            node.args.append(("t", vid))
            tensor_shapes.append((shape, t))
        else:
            node.args.append(("s", parse_concrete(concrete[pos] if pos < len(concrete) else "")))
    out = _presumed_output(node, tensor_shapes)
    if out is None:
        recent.append(((None,), "", -1, node.module, None))  # an unknown output breaks the chain
    else:
        shape, t = out
        vid = len(values)
        nbytes = math.prod(shape) * ITEMSIZE.get(t, 4) if shape else ITEMSIZE.get(t, 4)
        values.append(Value(vid, -1, node.idx, shape, (), t, nbytes))
        node.writes.append(Use(vid, 0, nbytes, shape, (), t))
        recent.append((shape, t, vid, node.module, (r.tid, node.iteration)))


def _related(a: str, b: str) -> bool:
    return a == b or (bool(a) and bool(b) and (a.startswith(b) or b.startswith(a)))


def _presumed_output(node: Node, tensors: list) -> tuple | None:
    if not tensors:
        return None
    if node.cls in (OpClass.POINTWISE, OpClass.NORM):
        shapes = [s for s, _ in tensors]
        try:
            shape = tuple(np.broadcast_shapes(*shapes))
        except ValueError:
            shape = shapes[0]
        return shape, tensors[0][1]
    return None  # reductions, matmuls, data movement: output shape unknown without an ET


