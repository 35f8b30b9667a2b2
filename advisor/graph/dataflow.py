"""The dataflow graph: nodes are the ops that do work, edges are tensor versions.

Which ops are nodes is the registry's call: walking the ET op tree top-down, the first op the
registry knows as work (pointwise, reduction, norm, matmul, ...) becomes a node and swallows its
subtree (so `aten::layer_norm` is one node whatever it calls); views and composites are seen
through; an unknown aten op becomes a barrier node. Kernels are charged to the node that owns the
cpu op that launched them.

Tensors are resolved by storage id with the last-writer rule: a read of storage S (through any
view) depends on the last node that wrote S before it, unless an op outside the graph gave S a new
tensor since (an allocation in a scope, an unknown composite's output): storage ids are addresses,
reused whenever the heap hands a freed block out again, so the rule must not see through a new
allocation, or the edges would depend on the heap instead of the model. That handles views, in-place
ops and ids reused after a free — except for a tensor allocated by no recorded op (the dispatcher's
wrapped scalars) at a freed address: a read binds to the last writer only if it fits what was
written (same dtype, inside the written range), otherwise it is a new outside tensor.

Scale: the choice of which ET ops become nodes, who owns which kernels and which module each op ran
in are computed for all ops at once with numpy (tree walks as pointer jumps, one level at a time); only
the ops that become nodes get Python objects, and their arguments come from shared templates
(trace/et.py), so a million-kernel trace costs a few seconds here.
"""
from __future__ import annotations

from functools import reduce
from typing import Iterator
from operator import add

import numpy as np
import pandas as pd

from advisor.errors import AdvisorError
from advisor.graph.etnodes import _op_rows, choose
from advisor.graph.fallback import nodes_from_kineto
from advisor.graph.index import KernelIndex, equals, module_paths, phases  # noqa: F401 (module_paths: used from here too)
from advisor.graph.nodes import Graph, Node, Use, Value, true_bytes
from advisor.ops.args import parse_concrete
from advisor.ops.registry import OpClass
from advisor.trace.load import Trace, gc_paused


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
    with gc_paused():
        wins = steady_windows(trace)
        ops = trace.ops.assign(iteration=_iteration_of(trace.ops["ts"].to_numpy(), wins))
        modules = module_paths(trace, ops)
        phase = phases(ops)
        kernels = KernelIndex(trace)
        device_type = "cuda" if trace.has_gpu else "cpu"
        warnings = check_joins(trace, kernels)
        if len(trace.et_nodes) and not any("Record function id" in w for w in warnings):
            nodes, values = _nodes_from_et(trace, ops, modules, kernels, phase)
            confidence = "high"
        else:
            nodes, values = nodes_from_kineto(trace, ops, modules, kernels, phase)
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
    return Graph(nodes, values, max(len(wins), 1), confidence, device_type, udf, warnings)


def check_joins(trace: Trace, kernels: KernelIndex) -> list[str]:
    """The joins the analysis rests on, checked before anything is built on them (a trace whose parts
    do not fit together must say so, not silently yield nothing, or another workload's candidates).

    Raises AdvisorError when nothing can be analysed: GPU kernels but no cpu ops, or kernels none of which
    joins a cpu op (`External id` / `correlation` missing or renamed), or an execution trace recorded with
    another run (its record-function ids meet Kineto ops of other names). Returns warnings, one line each,
    when the ET cannot be used (Kineto without `Record function id`: the shape-and-order fallback runs)."""
    k, et = trace.files.kineto, trace.files.et
    n_kernels = len(trace.kernels)
    # All per category and on arrays (a 1M-kernel trace has millions of ops): no frame copies, no str per row.
    cpu = np.flatnonzero(equals(trace.ops["cat"], "cpu_op"))
    if n_kernels and not len(cpu):
        raise AdvisorError(f"{k} has {n_kernels} GPU kernels but no cpu_op events: nothing says which ops launched "
                           "them (profile with ProfilerActivity.CPU and record_shapes=True, as `fusion-advisor "
                           "profile` does)")
    if n_kernels and not len(kernels.rows):
        raise AdvisorError(f"none of the {n_kernels} GPU kernels in {k} joins a cpu op: its 'External id' / "
                           "'correlation' fields are missing or renamed (a trace from another torch version?)")
    warnings = []
    if not n_kernels and len(cpu) and (trace.meta.get("device") or {}).get("type") == "cuda":
        warnings.append(f"{k} was recorded on a GPU machine but holds no GPU kernels: the script ran no GPU work "
                        "(its tensors stayed on the CPU?), so these are CPU op times")
    if not len(trace.et_nodes) or not len(cpu):
        return warnings
    et_names = trace.et_nodes["name"]
    is_op = np.array(["::" in str(c) for c in et_names.cat.categories] + [False], dtype=bool)[et_names.cat.codes]
    rf = trace.ops["rf_id"].to_numpy()[cpu]
    if not (rf > 0).any():
        return warnings + [f"{k} carries no 'Record function id' (a trace from another torch version?), so the execution "
                f"trace {et} cannot be joined to it: dataflow guessed from shapes and order"]
    row = _op_rows(rf, trace.et_nodes["rf_id"].to_numpy())
    joined = is_op & (row >= 0)
    # Same name: compare category codes, the ET's mapped onto the Kineto ops' categories.
    op_names = trace.ops["name"]
    where = {str(c): i for i, c in enumerate(op_names.cat.categories)}
    et_as_op = np.array([where.get(str(c), -2) for c in et_names.cat.categories] + [-2])[et_names.cat.codes]
    same = joined & (op_names.cat.codes.to_numpy()[cpu[np.maximum(row, 0)]] == et_as_op)
    if is_op.any() and same.sum() < 0.9 * max(joined.sum(), 1):
        raise AdvisorError(f"the execution trace {et} does not belong to {k}: only {int(same.sum())} of its "
                           f"{int(is_op.sum())} ops meet a Kineto op of the same name by record-function id "
                           "(pass the ET recorded with this trace, or none)")
    lost = int(is_op.sum() - joined.sum())
    if lost > 0.2 * is_op.sum():
        return warnings + [f"{lost} of the {int(is_op.sum())} ops in the execution trace have no Kineto op (ops run in threads "
                "the profiler did not record?): those ops are not analysed"]
    return warnings


def _nodes_from_et(trace: Trace, ops: pd.DataFrame, modules: np.ndarray, kernels: KernelIndex, phase: np.ndarray):
    c = choose(trace, ops["iteration"].to_numpy(), kernels)
    spans = _kernel_spans(c, kernels)
    rows_ = c.row
    ts, dur, it = ops["ts"].to_numpy()[rows_].tolist(), ops["dur"].to_numpy()[rows_].tolist(), \
        ops["iteration"].to_numpy()[rows_].tolist()
    mods, phs = modules[rows_].tolist(), phase[rows_].tolist()
    templates = [_static_rows(rows) for rows in trace.et.templates]
    # Templates with a double argument the ET may have rounded (see `_full_precision`).
    rounded = [any(r[0] and isinstance(r[4][1], float) for r in rows) for _, rows in templates]
    concrete = trace.ops["concrete"].to_numpy() if "concrete" in trace.ops else np.array([None] * len(trace.ops))
    n_ids = np.array([n for n, _ in templates] or [0], dtype=np.int64)[c.tpl]  # tensor ids each node's template uses
    ids = _TensorIds(trace.et.tensor_ids, trace.et.storage_ids, c.t0, n_ids)
    template_of: dict[tuple, int] = {}  # (op, schema, argument template) -> Node.template
    nodes: list[Node] = []
    values: list[Value] = []
    last_writer: dict[int, int] = {}
    ends: list[int] = []  # per value: offset + extent of what its producer wrote (what a later read must fit in)
    # Storages given a new tensor by an op outside the graph, in id order: from there on a read starts a new
    # outside value instead of binding to the node that wrote that storage id before (etnodes._allocations).
    made_at, made = c.allocation_ids.tolist(), c.allocated.tolist()
    next_made = 0
    for idx, (et_id, rf, op, cls, schema, inplace, tpl, (names, k_ts, k_dur)) in enumerate(zip(
            c.ids.tolist(), c.rf.tolist(), c.names, c.cls, c.schemas, c.inplace, c.tpl.tolist(), spans)):
        while next_made < len(made_at) and made_at[next_made] < et_id:
            last_writer.pop(made[next_made], None)
            next_made += 1
        node = Node(idx, et_id, rf, op, cls, schema, ts[idx], dur[idx], it[idx], mods[idx], phs[idx], inplace=inplace,
                    template=template_of.setdefault((op, schema, tpl), len(template_of)))
        if names:
            node.kernels = names
            node.kernel_spans = list(zip(names, k_ts, k_dur))
            node.kernel_us = reduce(add, k_dur, 0.0)  # in charge order, like += one kernel at a time
        nodes.append(node)
        rows = templates[tpl][1]
        if rows:
            tids, sids, at = ids.of(idx)
            _resolve_args(node, rows, tids, sids, at, values, last_writer, ends)
            if rounded[tpl]:
                _full_precision(node, concrete[rows_[idx]])
    return nodes, values


def _full_precision(node: Node, concrete) -> None:
    """The execution trace writes doubles with 6 decimals: BERT's LayerNorm eps of 1e-12 reads 0.0, and a
    kernel built from it computed rsqrt(var + 0), NaN on a constant row where the model stays finite.
    Kineto's "Concrete Inputs" of the same op hold them in full: take those where they round to the ET's."""
    if not concrete:
        return
    for i, arg in enumerate(node.args):
        if arg[0] == "s" and isinstance(arg[1], float) and i < len(concrete):
            full = parse_concrete(concrete[i])
            if isinstance(full, float) and full != arg[1] and abs(full - arg[1]) <= 5e-7 * max(1.0, abs(arg[1])):
                node.args[i] = ("s", full)


class _TensorIds:
    """The tensor and storage ids of node after node, fetched from the flat arrays a block of nodes at a time
    (one numpy gather per block instead of two slices and two tolist() per node)."""

    BLOCK = 4096

    def __init__(self, tids: np.ndarray, sids: np.ndarray, t0: np.ndarray, n: np.ndarray) -> None:
        self.all_tids, self.all_sids, self.t0, self.n = tids, sids, t0, n
        self.start = np.cumsum(n) - n  # where each node's ids begin in its block's lists, block-relative below
        self.block, self.base = -1, 0
        self.tids: list = []
        self.sids: list = []

    def of(self, idx: int) -> tuple[list, list, int]:
        """(tensor ids, storage ids, offset of node idx's first one in those lists)."""
        block = idx // self.BLOCK
        if block != self.block:
            lo, hi = block * self.BLOCK, min((block + 1) * self.BLOCK, len(self.n))
            n, t0 = self.n[lo:hi], self.t0[lo:hi]
            at = np.repeat(t0 - (np.cumsum(n) - n), n) + np.arange(n.sum())
            self.tids, self.sids = self.all_tids[at].tolist(), self.all_sids[at].tolist()
            self.block, self.base = block, self.start[lo]
        return self.tids, self.sids, int(self.start[idx] - self.base)


def _kernel_spans(c, kernels: KernelIndex) -> Iterator[tuple[list, list, list]]:
    """(names, ts, durs) of the kernels each chosen node owns, node by node: its own op's, then those of the ops
    it swallowed in id order (each op's kernels in trace order). Yielded, so each node's lists go once used."""
    n_nodes = len(c.ids)
    if not len(c.charged_ext) or not len(kernels.rows):
        yield from [((), (), ())] * n_nodes
        return
    lo, hi = kernels.bounds(c.charged_ext)
    n = hi - lo
    rep = np.repeat(np.arange(len(n)), n)
    krow = kernels.rows[np.repeat(lo, n) + np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)]
    node_of = c.charged_owner[rep]
    order = np.argsort(node_of, kind="stable")  # by owning node; within it in id order, then trace order
    node_of, krow = node_of[order], krow[order]
    bounds = np.searchsorted(node_of, np.arange(n_nodes + 1)).tolist()
    names, ts, dur = kernels.names[krow].tolist(), kernels.ts[krow].tolist(), kernels.dur[krow].tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        yield names[a:b], ts[a:b], dur[a:b]


def _static_rows(rows) -> tuple[int, list]:
    """(number of tensor ids the template uses (max slot + 1), its rows with what the dataflow needs
    precomputed). A scalar argument's ("s", value) is made here once, shared by every node of the template."""
    out = []
    for r in rows:
        shape = tuple(r.shape) if r.shape is not None else None
        strides = tuple(r.strides) if r.strides is not None else None
        nbytes = true_bytes(shape, strides, r.itemsize) if shape is not None else 0
        extent = _extent(shape, strides) if shape is not None else 0
        out.append((r.io == "i", r.slot, r.pos, r.sub, ("s", r.value), r.tensor_id, r.storage_id, r.offset, shape,
                    strides, str(r.dtype), nbytes, extent))
    return max([r.slot for r in rows] + [-1]) + 1, out


def _resolve_args(node: Node, rows: list, tids: list, sids: list, at: int, values: list[Value], last_writer: dict,
                  ends: list) -> None:
    list_arg: tuple[int, list] | None = None  # (pos, value ids) of a tensor-list argument being read
    for is_in, slot, pos, sub, scalar, tid, sid, offset, shape, strides, dtype, nbytes, extent in rows:
        if slot >= 0:
            tid, sid = tids[at + slot], sids[at + slot]
        is_tensor = sid >= 0 and shape is not None
        if is_in:
            if not is_tensor:
                node.args.append(scalar)
                continue
            vid = _read(values, last_writer, ends, sid, tid, offset, shape, strides, dtype, nbytes, extent)
            node.reads.append(Use(vid, pos, nbytes, shape, strides, dtype, offset))
            if sub >= 0:
                if list_arg is None or list_arg[0] != pos:
                    list_arg = (pos, [])
                    node.args.append(("tl", list_arg[1]))
                list_arg[1].append(vid)
            else:
                node.args.append(("t", vid))
        elif is_tensor:
            vid = len(values)
            values.append(Value(vid, sid, node.idx, shape, strides, dtype, nbytes, offset=offset))
            ends.append(offset + extent)
            last_writer[sid] = vid
            node.writes.append(Use(vid, pos, nbytes, shape, strides, dtype, offset))


def _read(values: list[Value], last_writer: dict, ends: list, sid, tid, offset, shape, strides, dtype, nbytes,
          extent) -> int:
    """The value a tensor argument reads: the storage's last writer, or a new outside tensor."""
    vid = last_writer.get(sid)
    if vid is not None and not _fits(values[vid], ends[vid], tid, offset, shape, dtype, extent):
        vid = None  # a stale id: the address was freed and reused by an unrecorded allocation
    if vid is None:
        vid = len(values)
        values.append(Value(vid, sid, -1, shape, strides, dtype, nbytes, offset=offset, tensor_id=tid))
        ends.append(0)  # not used: an outside tensor is matched by shape or tensor id, not by range
        last_writer[sid] = vid
    elif values[vid].producer < 0 and nbytes > values[vid].bytes:
        values[vid].bytes = nbytes  # several views of one outside tensor: read once, at its widest
    return vid


def _extent(shape, strides) -> int:
    if not shape:
        return 1
    strides = strides if strides and len(strides) == len(shape) else [1] * len(shape)
    return 1 + sum((d - 1) * abs(st) for d, st in zip(shape, strides) if d > 0)


def _fits(written: Value, end: int, tid: int, offset: int, shape: tuple, dtype: str, extent: int) -> bool:
    if dtype != written.dtype:
        return False
    if written.producer < 0:
        # Two outside tensors on one storage: views of a weight share it; two wrapped scalars
        # (0-dim, allocated unrecorded one after another at one address) do not.
        return bool(shape) or tid == written.tensor_id
    if not shape and written.shape:
        return False
    return written.offset <= offset and offset + extent <= end
