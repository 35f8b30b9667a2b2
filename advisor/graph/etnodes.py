"""Which ET ops become graph nodes, and which node owns each op (and so its kernels): all ops at once.

The rules are the ones dataflow.py states, applied the way a walk of the ET in id order applies them:
an op is swallowed when its parent (walked earlier: a smaller id) is a node or swallowed; otherwise it
becomes a node when the op ran inside a steady-state window and the registry calls it work (plus, on
GPU traces, something in its subtree launched a kernel, and it is not a `to`/`contiguous` that returned
its own input). "Parent walked earlier" and "subtree" are pointer jumps over the parent links, one tree
level per numpy step, so millions of ET ops cost no Python loop.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from advisor.graph.index import KernelIndex
from advisor.ops.registry import TRANSPARENT, OpClass, is_aten, is_operator, lookup
from advisor.trace.et import EtArgs
from advisor.trace.load import Trace

# Per distinct op name, what the registry says: never a node / an unknown aten op (a node unless it is a
# composite that launched nothing itself) / an unknown op of another namespace / a view-like op (a node
# only if it launched a kernel itself) / work.
SCOPE, UNKNOWN_ATEN, UNKNOWN_OP, SEE_THROUGH, WORK = range(5)


@dataclass
class Choice:
    """The chosen graph nodes in id order (one entry each), and the ops whose kernels they own."""

    ids: np.ndarray
    rf: np.ndarray
    row: np.ndarray  # Kineto op row of each node
    names: list
    schemas: list
    tpl: np.ndarray
    t0: np.ndarray
    cls: list  # OpClass per node
    inplace: list  # bool per node
    charged_owner: np.ndarray  # per op that charges kernels (in id order): index of its node in the lists above
    charged_ext: np.ndarray  # ... and its External id
    allocation_ids: np.ndarray  # ET id of each tensor made by an op outside every node (`_allocations`), in id order
    allocated: np.ndarray  # ... and its storage id


def choose(trace: Trace, iteration: np.ndarray, kernels: KernelIndex) -> Choice:
    en = trace.et_nodes
    order = np.argsort(en["id"].to_numpy(), kind="stable")
    ids, parents = en["id"].to_numpy()[order], en["parent"].to_numpy()[order]
    code = en["name"].cat.codes.to_numpy()[order]
    cats = [str(c) for c in en["name"].cat.categories]
    row = _op_rows(trace.ops["rf_id"].to_numpy(), en["rf_id"].to_numpy()[order])
    parents = _callers(ids, parents, row, trace.ops)
    ext = np.where(row >= 0, trace.ops["ext_id"].to_numpy()[np.maximum(row, 0)], -1)
    direct = kernels.count(ext) > 0 if trace.has_gpu else np.zeros(len(ids), dtype=bool)
    # A parent counts only if the id-order walk met it first (a smaller id): the root is its own parent.
    at = np.clip(np.searchsorted(ids, parents), 0, max(len(ids) - 1, 0))
    pidx = np.where((ids[at] == parents) & (parents < ids), at, -1) if len(ids) else at
    del at

    infos = [lookup(c) for c in cats]
    verdict = np.array([_verdict(c, i) for c, i in zip(cats, infos)] + [SCOPE], dtype=np.int8)[code]
    has_child = np.isin(ids, parents)
    ok = ((verdict == WORK) | (verdict == UNKNOWN_OP) | ((verdict == SEE_THROUGH) & direct)
          | ((verdict == UNKNOWN_ATEN) & ~(has_child & ~direct)))
    del has_child
    ok &= row >= 0
    ok[ok] = iteration[row[ok]] >= 0  # ran inside a steady-state window
    if trace.has_gpu:
        ok &= _launched(ids, parents, pidx, direct)
    del direct, parents
    tpl, t0 = en["tpl"].to_numpy()[order], en["t0"].to_numpy()[order]
    ok &= ~_aliases(ok, verdict, code, infos, tpl, t0, trace.et)

    node = np.zeros(len(ids), dtype=bool)
    owner = np.full(len(ids), -1, dtype=np.int64)
    for level in _levels(pidx):
        p = pidx[level]
        inherited = np.where(p >= 0, owner[np.maximum(p, 0)], -1)
        mine = (inherited < 0) & ok[level]
        node[level] = mine
        owner[level] = np.where(inherited >= 0, inherited, np.where(mine, level, -1))
    chosen = np.flatnonzero(node)
    made_at, made = _allocations(owner < 0, tpl, t0, trace.et)
    charged = np.flatnonzero((owner >= 0) & (row >= 0))  # a node's own op and every op it swallowed
    cls = [(i.cls if i.cls not in TRANSPARENT else OpClass.DATA_MOVEMENT) if i else OpClass.OTHER for i in infos]
    c = code[chosen]
    schema = en["schema"].array
    schemas = np.array([str(x) for x in schema.categories] + [""], dtype=object)[schema.codes[order[chosen]]]
    return Choice(ids[chosen], en["rf_id"].to_numpy()[order[chosen]], row[chosen],
                  [cats[i] for i in c], schemas.tolist(), tpl[chosen], t0[chosen], [cls[i] for i in c],
                  [bool(infos[i] and infos[i].inplace) for i in c], np.searchsorted(chosen, owner[charged]),
                  ext[charged], ids[made_at], made)


def _callers(ids: np.ndarray, parents: np.ndarray, row: np.ndarray, ops) -> np.ndarray:
    """The parent id of each op (ids in id order): for an op with a Kineto op, the innermost op whose Kineto
    op encloses it on its thread (none: -1, unless its ET parent has no Kineto op, a thread's root); the ET's
    link otherwise. The two agree wherever every record function begins and ends on one thread. An
    asynchronous collective's does not (`gloo:all_reduce`, begun for the main thread, ended by the worker that
    ran it): it stays open on the main thread's ET stack until the worker ends it, and that end pops whatever
    is on top, so the ET made the ops the main thread ran meanwhile its children (the next call's forward,
    which the collective, a barrier node, then swallowed) or an op's grandparent its parent (an addmm a node
    beside its own linear); how far that reached depended on when the worker finished. Per thread, sorted as
    calls open (start, then the longer first, then id), an op's caller is the nearest earlier op that ends no
    sooner: found for all ops at once by jumping from the previous op to its own guess, one level a step."""
    have = np.flatnonzero(row >= 0)
    if not len(have):
        return parents
    r = row[have]
    ts, end, tid = ops["ts"].to_numpy()[r], ops["end"].to_numpy()[r], ops["tid"].to_numpy()[r]
    order = np.lexsort((ids[have], -end, ts, tid))
    end, tid = end[order], tid[order]
    caller = np.arange(len(order)) - 1
    caller[np.flatnonzero(np.r_[True, tid[1:] != tid[:-1]])] = -1
    while True:
        c = np.maximum(caller, 0)
        up = (caller >= 0) & (end[c] < end)
        if not up.any():
            break
        caller[up] = caller[c[up]]
    out = parents.copy()
    mine = have[order]
    joined_ids = ids[have]
    et_parent_joined = np.isin(parents[mine], joined_ids)
    out[mine] = np.where(caller >= 0, ids[mine[np.maximum(caller, 0)]], np.where(et_parent_joined, -1, parents[mine]))
    return out


def _verdict(name: str, info) -> int:
    if info is None:
        if not is_operator(name):
            return SCOPE  # a scope (record_function, module): look inside
        return UNKNOWN_ATEN if is_aten(name) else UNKNOWN_OP  # unknown ops (custom ones too): opaque barriers
    return SEE_THROUGH if info.cls in TRANSPARENT else WORK


def _op_rows(ops_rf: np.ndarray, rfs: np.ndarray) -> np.ndarray:
    """Kineto op row per record-function id: the last op with that id (ids > 0), -1 if none."""
    have = np.flatnonzero(ops_rf > 0)
    if not len(have) or not len(rfs):
        return np.full(len(rfs), -1, dtype=np.int64)
    order = have[np.argsort(ops_rf[have], kind="stable")]
    keys = ops_rf[order]
    at = np.searchsorted(keys, rfs, "right") - 1
    hit = (at >= 0) & (keys[np.maximum(at, 0)] == rfs)
    return np.where(hit, order[np.maximum(at, 0)], -1)


def _launched(ids, parents, pidx, direct) -> np.ndarray:
    """Ops whose subtree launched a kernel: a walk from the largest id down adds an op that launched or
    was added, and its parent; the parent passes it on only if walked later (a smaller id)."""
    passes = direct.copy()
    frontier = passes.copy()
    while frontier.any():
        up = pidx[frontier]
        up = up[(up >= 0) & ~passes[np.maximum(up, 0)]]
        passes[up] = True
        frontier = np.zeros_like(passes)
        frontier[up] = True
    return passes | np.isin(ids, parents[passes])


def _levels(pidx: np.ndarray) -> list[np.ndarray]:
    """Op indices grouped by depth below their walked-first ancestor chain, shallowest first."""
    depth = np.zeros(len(pidx), dtype=np.int64)
    has = pidx >= 0
    while True:
        new = np.where(has, depth[np.maximum(pidx, 0)] + 1, 0)
        if np.array_equal(new, depth):
            break
        depth = new
    order = np.argsort(depth, kind="stable")
    bounds = np.searchsorted(depth[order], np.arange(depth.max() + 2 if len(depth) else 1))
    return [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def _allocations(outside: np.ndarray, tpl: np.ndarray, t0: np.ndarray, et: EtArgs) -> tuple[np.ndarray, np.ndarray]:
    """(op index, storage id) of each tensor an op outside every node returned on a storage none of its
    inputs is on (an `aten::empty` in a scope, an unknown composite's output, a tensor the script made between
    calls), sorted by op index. Such a storage holds a new tensor whose writer is not in the graph: a read of it
    must not bind to a node that wrote the same storage id before. Storage ids are addresses, so whether a new
    tensor reuses a freed one's depends on the process heap (what other threads, the profiler and the script
    allocated, and when), not on the model: bound to the old writer, one call of a deterministic model got an
    edge across layers or calls that another call did not. Checked per argument template, for all its ops at
    once."""
    at_parts, sid_parts = [np.empty(0, np.int64)], [np.empty(0, np.int64)]
    check = np.flatnonzero(outside)
    for t in np.unique(tpl[check]):
        rows = [r for r in et.templates[t] if (r.slot >= 0 or r.storage_id >= 0) and r.shape is not None]
        outs = [r for r in rows if r.io == "o" and r.itemsize > 0]  # (an undefined tensor has no storage)
        if not outs:
            continue
        these = check[tpl[check] == t]

        def sids(r):
            return et.storage_ids[t0[these] + r.slot] if r.slot >= 0 else np.full(len(these), r.storage_id)

        ins = [sids(r) for r in rows if r.io == "i"]
        for o in outs:
            out = sids(o)
            new = out >= 0
            for i in ins:
                new &= i != out
            at_parts.append(these[new])
            sid_parts.append(out[new])
    at, sid = np.concatenate(at_parts), np.concatenate(sid_parts)
    order = np.argsort(at, kind="stable")
    return at[order], sid[order]


def _aliases(cand, verdict, code, infos, tpl, t0, et: EtArgs) -> np.ndarray:
    """Ops that returned one of their inputs (`to`, `contiguous`, eval dropout): every output tensor is an
    input's (storage, offset). Checked per argument template, for all its ops at once."""
    out = np.zeros(len(cand), dtype=bool)
    inplace = np.array([bool(i and i.inplace) for i in infos] + [False], dtype=bool)[code]
    known = np.array([i is not None for i in infos] + [False], dtype=bool)[code]
    check = np.flatnonzero(cand & known & ~inplace & (verdict != UNKNOWN_OP) & (verdict != UNKNOWN_ATEN))
    for t in np.unique(tpl[check]):
        rows = [r for r in et.templates[t] if r.slot >= 0 or r.storage_id >= 0]
        ins = [r for r in rows if r.io == "i"]
        outs = [r for r in rows if r.io == "o"]
        if not ins or not outs:
            continue
        these = check[tpl[check] == t]

        def sids(r):
            return et.storage_ids[t0[these] + r.slot] if r.slot >= 0 else np.full(len(these), r.storage_id)

        alias = np.ones(len(these), dtype=bool)
        for o in outs:
            hit = np.zeros(len(these), dtype=bool)
            for i in ins:
                if i.offset == o.offset:
                    hit |= sids(i) == sids(o)
            alias &= hit
        out[these] = alias
    return out
