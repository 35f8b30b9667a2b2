"""The dataflow graph: nodes are the ops that do work, edges are tensor versions.

Which ops are nodes is the registry's call: walking the ET op tree top-down, the first op the
registry knows as work (pointwise, reduction, norm, matmul, ...) becomes a node and swallows its
subtree (so `aten::layer_norm` is one node whatever it calls); views and composites are seen
through; an unknown aten op becomes a barrier node. Kernels are charged to the node that owns the
cpu op that launched them.

Tensors are resolved by storage id with the last-writer rule: a read of storage S (through any
view) depends on the last node that wrote S before it. That one rule handles views, in-place ops
and ids reused after a free — except for a tensor allocated by no recorded op (the dispatcher's
wrapped scalars) at a freed address: a read binds to the last writer only if it fits what was
written (same dtype, inside the written range), otherwise it is a new outside tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from advisor.ops.registry import TRANSPARENT, OpClass, is_aten, is_operator, lookup
from advisor.trace.load import Trace


@dataclass
class Use:
    value: int  # value id
    pos: int  # argument position in the op
    bytes: int  # bytes this access touches (a broadcast view at its true size)
    shape: tuple
    strides: tuple
    dtype: str
    offset: int = 0


@dataclass
class Node:
    idx: int
    et_id: int
    rf_id: int
    op: str
    cls: OpClass
    schema: str
    ts: float
    dur: float
    iteration: int
    module: str = ""
    kernels: list = field(default_factory=list)  # kernel names
    kernel_spans: list = field(default_factory=list)  # (name, ts, dur) per kernel
    kernel_us: float = 0.0
    reads: list = field(default_factory=list)  # [Use]
    writes: list = field(default_factory=list)  # [Use]
    # Positional inputs: ("t", value id) | ("tl", [value ids]) for tensor lists | ("s", scalar)
    args: list = field(default_factory=list)
    inplace: bool = False

    @property
    def time_us(self) -> float:
        # GPU traces: kernel time; CPU traces: the op's own duration (it swallowed its subtree).
        return self.kernel_us if self.kernels else self.dur

    @property
    def bytes(self) -> int:
        return sum(u.bytes for u in self.reads) + sum(u.bytes for u in self.writes)


@dataclass
class Value:
    vid: int
    storage: int
    producer: int  # node idx, or -1 for a tensor from outside the window (weights, inputs)
    shape: tuple
    strides: tuple
    dtype: str
    bytes: int
    consumers: list = field(default_factory=list)  # node idxs
    offset: int = 0  # storage offset of the write, in elements
    tensor_id: int = -1  # ET tensor id of the first access


@dataclass
class Graph:
    nodes: list[Node]
    values: list[Value]
    iterations: int
    confidence: str  # "high" (ET dataflow) or "low" (shapes and order)
    device_type: str  # "cuda" or "cpu"
    unknown_ops: pd.DataFrame  # name, count, time_us

    def node_frame(self) -> pd.DataFrame:
        return pd.DataFrame({
            "node": [n.idx for n in self.nodes], "op": pd.Categorical([n.op for n in self.nodes]),
            "cls": pd.Categorical([n.cls.value for n in self.nodes]), "ts": [n.ts for n in self.nodes],
            "time_us": [n.time_us for n in self.nodes], "n_kernels": [len(n.kernels) for n in self.nodes],
            "bytes": [n.bytes for n in self.nodes], "module": pd.Categorical([n.module for n in self.nodes]),
            "iteration": [n.iteration for n in self.nodes],
        })


def true_bytes(shape, strides, itemsize) -> int:
    """Bytes a tensor really occupies: dims with stride 0 (broadcast/expand) count once."""
    if not shape:
        return int(itemsize)
    if strides and len(strides) == len(shape):
        n = math.prod(s for s, st in zip(shape, strides) if st != 0)
    else:
        n = math.prod(shape)
    return int(n) * int(itemsize)


def steady_windows(trace: Trace) -> list[tuple[float, float]]:
    iters = (trace.meta.get("steady_state") or {}).get("iterations") or []
    wins = [(float(a), float(b)) for a, b in iters]
    if wins:
        return wins
    if len(trace.ops):
        return [(float(trace.ops["ts"].min()), float(trace.ops["end"].max()))]
    return [(float(trace.kernels["ts"].min()), float(trace.kernels["end"].max()))]


def _iteration_of(ts: np.ndarray, wins: list[tuple[float, float]]) -> np.ndarray:
    out = np.full(len(ts), -1, dtype=np.int64)
    for k, (a, b) in enumerate(wins):
        out[(ts >= a) & (ts <= b)] = k
    return out


def build_graph(trace: Trace) -> Graph:
    wins = steady_windows(trace)
    ops = trace.ops
    ops = ops.assign(iteration=_iteration_of(ops["ts"].to_numpy(), wins))
    modules = module_paths(trace, ops)
    kernels_by_ext = _kernels_by_ext(trace)
    device_type = "cuda" if trace.has_gpu else "cpu"
    if len(trace.et_nodes):
        nodes, values = _nodes_from_et(trace, ops, modules, kernels_by_ext)
        confidence = "high"
    else:
        from advisor.graph.fallback import nodes_from_kineto

        nodes, values = nodes_from_kineto(trace, ops, modules, kernels_by_ext)
        confidence = "low"
    for v in values:
        v.consumers = []
    for n in nodes:
        for u in n.reads:
            values[u.value].consumers.append(n.idx)
    unknown = [(n.op, n.time_us) for n in nodes if n.cls == OpClass.OTHER]
    udf = pd.DataFrame(unknown, columns=["name", "time_us"])
    udf = (udf.groupby("name", observed=True).agg(count=("time_us", "size"), time_us=("time_us", "sum")).reset_index()
           if len(udf) else pd.DataFrame({"name": [], "count": [], "time_us": []}))
    return Graph(nodes, values, max(len(wins), 1), confidence, device_type, udf)


def _kernels_by_ext(trace: Trace) -> dict[int, list[tuple[str, float, float]]]:
    """External id of the innermost cpu op -> [(kernel name, dur)], joined through the launch's correlation."""
    k = trace.kernels
    if not len(k):
        return {}
    ext = k["ext_id"].to_numpy().copy()
    if len(trace.runtime) and (ext <= 0).any():
        # Some kernels carry no External id; their launching runtime call does.
        rt = trace.runtime[trace.runtime["correlation"] > 0].drop_duplicates("correlation")
        by_corr = dict(zip(rt["correlation"].to_numpy(), rt["ext_id"].to_numpy()))
        corr = k["correlation"].to_numpy()
        missing = ext <= 0
        ext[missing] = [by_corr.get(c, -1) for c in corr[missing]]
    out: dict[int, list] = {}
    for e, name, ts, dur in zip(ext, k["name"].astype(str), k["ts"].to_numpy(), k["dur"].to_numpy()):
        if e <= 0:
            continue  # unattributable (e.g. launched outside any recorded op)
        out.setdefault(int(e), []).append((name, float(ts), float(dur)))
    return out


def module_paths(trace: Trace, ops: pd.DataFrame) -> np.ndarray:
    """Innermost nn.Module path of each op, by interval nesting of the module call events.

    Prefers qualified names from the collector's `nn.Module::<qualname>` annotations; falls back to
    the python tracer's `nn.Module: Class_N` events (class instance chain).
    """
    ann = ops[ops["name"].astype(str).str.startswith("nn.Module::")]
    if len(ann):
        spans = [(r.ts, r.end, r.tid, str(r.name)[len("nn.Module::"):], True) for r in ann.itertuples()]
    else:
        m = trace.modules
        spans = [(r.ts, r.end, r.tid, str(r.name)[len("nn.Module: "):], False) for r in m.itertuples()]
    out = np.full(len(ops), "", dtype=object)
    if not spans:
        return out
    spans.sort(key=lambda s: (s[2], s[0], -s[1]))
    order = np.lexsort((ops["ts"].to_numpy(), ops["tid"].to_numpy()))
    ts, tid = ops["ts"].to_numpy(), ops["tid"].to_numpy()
    stack: list[tuple[float, str]] = []  # (end, path)
    si, cur_tid = 0, None
    for i in order:
        if tid[i] != cur_tid:
            cur_tid, stack = tid[i], []
        while si < len(spans) and (spans[si][2], spans[si][0]) <= (tid[i], ts[i]):
            s_ts, s_end, s_tid, name, qualified = spans[si]
            si += 1
            if s_tid != cur_tid:
                continue
            while stack and stack[-1][0] < s_ts:
                stack.pop()
            path = name if qualified or not stack else f"{stack[-1][1]}/{name}"
            stack.append((s_end, path))
        while stack and stack[-1][0] < ts[i]:
            stack.pop()
        out[i] = stack[-1][1] if stack else ""
    return out


def _nodes_from_et(trace: Trace, ops: pd.DataFrame, modules: np.ndarray, kernels_by_ext: dict):
    et = trace.et_nodes.sort_values("id")
    # Kineto op per rf_id (only ops inside a steady-state window become nodes).
    rf = ops[(ops["rf_id"] > 0)]
    rf_row = {int(r): i for i, r in zip(rf.index, rf["rf_id"].to_numpy())}
    ids = et["id"].to_numpy()
    names = et["name"].astype(str).to_numpy()
    parents = et["parent"].to_numpy()
    rfs = et["rf_id"].to_numpy()
    schemas = et["schema"].astype(str).to_numpy()
    has_child = set(parents.tolist())
    ext_of_row = ops["ext_id"].to_numpy()
    launched = _subtree_launched(ids, parents, rfs, rf_row, ext_of_row, kernels_by_ext) if trace.has_gpu else None

    args_by_node = {nid: g for nid, g in trace.et_args.groupby("node", sort=False)}
    owner: dict[int, int] = {}  # ET id -> graph node idx (for ops swallowed by a node)
    nodes: list[Node] = []
    values: list[Value] = []
    last_writer: dict[int, int] = {}

    for nid, name, parent, rfid, schema in zip(ids, names, parents, rfs, schemas):
        nid = int(nid)
        if parent in owner:
            owner[nid] = owner[parent]
            row = rf_row.get(int(rfid))
            if row is not None:
                _charge_kernels(nodes[owner[nid]], kernels_by_ext.get(int(ext_of_row[row]), ()))
            continue
        row = rf_row.get(int(rfid))
        if row is None or ops.at[row, "iteration"] < 0:
            continue
        info = lookup(name)
        direct = kernels_by_ext.get(int(ext_of_row[row]), ())
        if info is None:
            if not is_operator(name) or (is_aten(name) and nid in has_child and not direct):
                continue  # a scope (record_function, module) or an unknown aten composite: look inside
            cls = OpClass.OTHER  # an unknown op (custom ops included): an opaque barrier
        elif info.cls in TRANSPARENT and not direct:
            continue
        else:
            cls = info.cls if info.cls not in TRANSPARENT else OpClass.DATA_MOVEMENT
        a = args_by_node.get(nid)
        if a is not None and cls != OpClass.OTHER and _is_alias(a, info):
            continue  # e.g. `to` / `contiguous` / eval dropout that returned its input
        node = Node(idx=len(nodes), et_id=nid, rf_id=int(rfid), op=name, cls=cls, schema=schema,
                    ts=float(ops.at[row, "ts"]), dur=float(ops.at[row, "dur"]),
                    iteration=int(ops.at[row, "iteration"]), module=modules[row],
                    inplace=bool(info and info.inplace))
        if launched is not None and nid not in launched:
            continue  # on a GPU trace an op whose subtree launched nothing did no device work
        _charge_kernels(node, direct)
        owner[nid] = node.idx
        nodes.append(node)
        if a is not None:
            _resolve_args(node, a, values, last_writer)
    return nodes, values


def _subtree_launched(ids, parents, rfs, rf_row, ext_of_row, kernels_by_ext) -> set[int]:
    """ET ids whose op or any descendant launched a kernel (children have larger ids than parents)."""
    launched: set[int] = set()
    for nid, parent, rfid in zip(ids[::-1], parents[::-1], rfs[::-1]):
        row = rf_row.get(int(rfid))
        if int(nid) in launched or (row is not None and int(ext_of_row[row]) in kernels_by_ext):
            launched.add(int(nid))
            launched.add(int(parent))
    return launched


def _charge_kernels(node: Node, kernels) -> None:
    for name, ts, dur in kernels:
        node.kernels.append(name)
        node.kernel_spans.append((name, ts, dur))
        node.kernel_us += dur


def _is_alias(args: pd.DataFrame, info) -> bool:
    if info is None or info.inplace:
        return False
    t = args[args["storage_id"] >= 0]
    outs = t[t["io"] == "o"]
    ins = t[t["io"] == "i"]
    if not len(outs) or not len(ins):
        return False
    in_keys = set(zip(ins["storage_id"], ins["offset"]))
    return all(k in in_keys for k in zip(outs["storage_id"], outs["offset"]))


def _resolve_args(node: Node, a: pd.DataFrame, values: list[Value], last_writer: dict[int, int]) -> None:
    list_arg: tuple[int, list] | None = None  # (pos, value ids) of a tensor-list argument being read
    for r in a.itertuples(index=False):
        is_tensor = r.storage_id >= 0 and r.shape is not None
        if r.io == "i":
            if not is_tensor:
                node.args.append(("s", r.value))
                continue
            vid, nbytes = _read(values, last_writer, r)
            node.reads.append(Use(vid, int(r.pos), nbytes, tuple(r.shape), tuple(r.strides), str(r.dtype), int(r.offset)))
            if r.sub >= 0:
                if list_arg is None or list_arg[0] != r.pos:
                    list_arg = (int(r.pos), [])
                    node.args.append(("tl", list_arg[1]))
                list_arg[1].append(vid)
            else:
                node.args.append(("t", vid))
        elif is_tensor:
            nbytes = true_bytes(r.shape, r.strides, r.itemsize)
            vid = len(values)
            values.append(Value(vid, int(r.storage_id), node.idx, tuple(r.shape), tuple(r.strides), str(r.dtype), nbytes,
                                offset=int(r.offset)))
            last_writer[r.storage_id] = vid
            node.writes.append(Use(vid, int(r.pos), nbytes, tuple(r.shape), tuple(r.strides), str(r.dtype), int(r.offset)))


def _read(values: list[Value], last_writer: dict[int, int], r) -> tuple[int, int]:
    """The value a tensor argument reads: the storage's last writer, or a new outside tensor."""
    nbytes = true_bytes(r.shape, r.strides, r.itemsize)
    vid = last_writer.get(r.storage_id)
    if vid is not None and not _fits(values[vid], r):
        vid = None  # a stale id: the address was freed and reused by an unrecorded allocation
    if vid is None:
        vid = len(values)
        values.append(Value(vid, int(r.storage_id), -1, tuple(r.shape), tuple(r.strides), str(r.dtype), nbytes,
                            offset=int(r.offset), tensor_id=int(r.tensor_id)))
        last_writer[r.storage_id] = vid
    elif values[vid].producer < 0 and nbytes > values[vid].bytes:
        values[vid].bytes = nbytes  # several views of one outside tensor: read once, at its widest
    return vid, nbytes


def _extent(shape, strides) -> int:
    if not shape:
        return 1
    strides = strides if strides and len(strides) == len(shape) else [1] * len(shape)
    return 1 + sum((d - 1) * abs(st) for d, st in zip(shape, strides) if d > 0)


def _fits(written: Value, r) -> bool:
    if str(r.dtype) != written.dtype:
        return False
    if written.producer < 0:
        # Two outside tensors on one storage: views of a weight share it; two wrapped scalars
        # (0-dim, allocated unrecorded one after another at one address) do not.
        return bool(r.shape) or int(r.tensor_id) == written.tensor_id
    if not r.shape and written.shape:
        return False
    lo, hi = written.offset, written.offset + _extent(written.shape, written.strides)
    return lo <= r.offset and r.offset + _extent(r.shape, r.strides) <= hi
