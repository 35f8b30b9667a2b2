"""What a kernel computes: its domain, the index variables, and one store per output.

Pointwise programs walk each output shape with a flat index (in the output's memory order, so
stores are contiguous), unravelled into one index per dim. Programs with a row op (reductions,
softmax, norms over the last dim) run row by row: leading indices from the row index (a program
takes several short rows: `printer._persistent`), `cols` along the row; GroupNorm's rows are its (sample,
group) pairs (`plan_group_rows`). All leave the rest to `Builder.value_at`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from advisor.codegen.build import Builder, GroupRows
from advisor.codegen.dag import Dag, Node
from advisor.codegen.ir import Dim, Program, Value, _order
from advisor.ops.args import group_count
from advisor.ops.lowering import Unsupported


@dataclass
class Store:
    out: int  # position in Program.outputs
    value: Node
    offset: Node
    mask: Node | None
    dtype: torch.dtype  # memory dtype


@dataclass
class Group:  # pointwise: outputs sharing one shape and memory order
    numel: str  # kernel argument
    dims: list  # [Dim]
    order: list  # dims outermost first
    outputs: list = field(default_factory=list)  # positions in Program.outputs
    layout_ref: int | None = None  # an allocated output whose dense layout flat inputs follow
    flat_inputs: set = field(default_factory=set)  # inputs read at `offs` (the launcher lays them out so)


@dataclass
class Plan:
    kind: str  # "pointwise" | "rows"
    prog: Program
    dag: Dag
    builder: Builder
    stores: list
    groups: list = field(default_factory=list)
    lead: list = field(default_factory=list)  # rows: [Dim] of the leading dims
    n: Dim | None = None  # rows: the row width
    n_expr: str | None = None  # grouped rows: the row width as the launcher computes it (no one Dim holds it)


def plan(prog: Program) -> Plan:
    return plan_rows(prog) if prog.row_ops else plan_pointwise(prog)


def _dense(shape, order) -> list:
    strides, acc = [0] * len(shape), 1
    for d in reversed(order):
        strides[d] = acc
        acc *= shape[d]
    return strides


def _same_layout(a_shape, a_strides, b_shape, b_strides) -> bool:
    return list(a_shape) == list(b_shape) and all(x == y for n, x, y in zip(a_shape, a_strides, b_strides) if n != 1)


# ------------------------------------------------------------------------------------- pointwise
def plan_pointwise(prog: Program) -> Plan:
    dag = Dag()
    b = Builder(prog, dag)
    groups: dict = {}
    for k, v in enumerate(prog.outputs):
        dims = tuple(prog.dim_key(d) for d in v.shape)
        if v.id in prog.inplace:  # written through the input's own strides: any group of its shape will do
            g = next((x for (d, _), x in groups.items() if d == dims), None)
            if g is None:
                g = groups[(dims, None)] = Group("", list(v.shape), list(range(len(v.shape))))
        else:
            order = tuple(_order(v.rec_strides, v.rec_shape))
            g = groups.get((dims, order))
            if g is None:
                g = groups[(dims, order)] = Group("", list(v.shape), list(order), layout_ref=k)
        g.outputs.append(k)
    glist = list(groups.values())
    offs = dag.var("offs", full=True)
    stores = []
    for gi, g in enumerate(glist):
        suffix = str(gi) if len(glist) > 1 else ""
        g.numel = f"numel{suffix}"
        b.mask = dag.var(f"mask{suffix}", full=True)
        idx = _unravel(b, offs, g.dims, g.order, "i", f"_{suffix}" if suffix else "")
        b.flat = (idx, offs)
        if g.layout_ref is not None:  # an input follows one output's layout only
            taken = set().union(*(h.flat_inputs for h in glist[:gi]))
            g.flat_inputs = _flat_inputs(prog, prog.outputs[g.layout_ref]) - taken
        b.flat_inputs = g.flat_inputs
        for k in g.outputs:
            v = prog.outputs[k]
            val = b.value_at(v.id, idx)
            if v.id in prog.inplace:
                offset = dag.isum([dag.imul(i, b.stride(f"out{k}", d)) for d, i in enumerate(idx)])
                if not offset.full:
                    # Every dim is a pinned 1 (one element, offset 0): a scalar pointer cannot take the block
                    # of values, and the masked flat index is 0 there too (found by tests/test_fuzz.py).
                    offset = offs
            else:
                offset = offs  # allocated dense in the group's order: the flat index is the address
            stores.append(Store(k, val, offset, b.mask, v.dtype))
    return Plan("pointwise", prog, dag, b, stores, groups=glist)


def _unravel(b: Builder, flat: Node, dims: list, order: list, prefix: str, suffix: str) -> tuple:
    """Index per dim of a flat position walking `dims` in `order` (outermost first)."""
    dag = b.dag
    idx: list = [None] * len(dims)
    inner = dag.lit(1)
    live = [d for d in order if not (b.p.sizes.norm(dims[d]).literal and dims[d].value == 1)]
    for pos, d in enumerate(reversed(live)):
        q = flat if inner.kind == "lit" and inner.fmt == "1" else dag.add("op", "{} // {}", (flat, inner))
        if pos < len(live) - 1:
            q = dag.add("op", "{} % {}", (q, b.size(dims[d])))
        if q is not flat:
            q.hint = q.hint or f"{prefix}{d}{suffix}"
        idx[d] = q
        inner = dag.imul(inner, b.size(dims[d]))
    for d in range(len(dims)):
        if idx[d] is None:
            idx[d] = dag.lit(0)
    return tuple(idx)


def _flat_inputs(prog: Program, ref: Value) -> set:
    """Inputs laid out exactly like the (dense) output and only ever read whole: they load at `offs`."""
    ref_strides = _dense(ref.rec_shape, _order(ref.rec_strides, ref.rec_shape))
    sliced = {v.src for o in prog.ops for a in o.args.values()
              for v in (a if isinstance(a, list) else [a]) if hasattr(v, "identity") and not v.identity}
    out = set()
    for i in prog.inputs:
        if i.id in sliced or [prog.dim_key(d) for d in i.shape] != [prog.dim_key(d) for d in ref.shape]:
            continue
        if _same_layout(i.rec_shape, i.rec_strides, ref.rec_shape, ref_strides):
            out.add(i.id)
    return out


# ------------------------------------------------------------------------------------------ rows
def plan_rows(prog: Program) -> Plan:
    first = prog.row_ops[0]
    if first.low.shape == "group":
        return plan_group_rows(prog)
    dag = Dag()
    b = Builder(prog, dag)
    view = next(v for v in first.args.values() if hasattr(v, "identity"))
    full = list(view.shape)
    for o in prog.row_ops[1:]:
        other = next(v for v in o.args.values() if hasattr(v, "identity")).shape
        # Compared as size classes, not recorded sizes: two shapes equal only by value at recording time
        # differ at other sizes (found by tests/test_fuzz.py).
        if [prog.dim_key(d) for d in other] != [prog.dim_key(d) for d in full]:
            raise Unsupported(f"row ops over different shapes ({[d.value for d in full]} and "
                              f"{[d.value for d in other]})")
    if not full:
        raise Unsupported("a row op over a 0-dim tensor")
    lead, n = full[:-1], full[-1]
    row = dag.var("row", full=False)
    b.cols = dag.var("cols", full=True)
    b.n = b.size(n)
    b.mask = dag.var("col_mask", full=True)
    lead_idx = _unravel(b, row, lead, list(range(len(lead))), "r", "")
    stores = []
    for k, v in enumerate(prog.outputs):
        shape = [d.value for d in v.shape]
        # By size class too: an output that is as wide as the row only by coincidence (an unrelated input of
        # the same recorded size) would be written over the row's width at other sizes (tests/test_fuzz.py).
        keys, full_keys = [prog.dim_key(d) for d in v.shape], [prog.dim_key(d) for d in full]
        if keys == full_keys:
            idx = lead_idx + (b.cols,)
        elif keys == full_keys[:-1] or keys == full_keys[:-1] + ["1"]:
            idx = lead_idx + ((dag.lit(0),) if len(shape) == len(lead) + 1 else ())
        elif keys[-1:] == full_keys[-1:] and (perm := _permutation(keys[:-1], full_keys[:-1])) is not None:
            # The rows with their leading dims permuted (Qwen3 normalises q per head on [B, S, H, D], then
            # transposes to [B, H, S, D] for the rotary): each row stored where the permutation puts it.
            idx = tuple(lead_idx[j] for j in perm) + (b.cols,)
        elif keys[-1:] == full_keys[-1:] and _same_rows(prog, v.shape[:-1], lead):
            # The rows under another leading shape (OPT adds the residual on [B * S, H] and normalises it
            # as [B, S, H]): the same row walked through its own leading dims.
            idx = _unravel(b, row, v.shape[:-1], list(range(len(v.shape) - 1)), "r", f"_out{k}") + (b.cols,)
        else:
            raise Unsupported(f"output {v.id} of shape {shape} is neither a row ({[d.value for d in full]}) "
                              f"nor one value per row")
        stores.append(_row_store(b, k, v, idx))
    return Plan("rows", prog, dag, b, stores, lead=lead, n=n)


def _row_store(b: Builder, k: int, v: Value, idx: tuple) -> Store:
    """Output k written at `idx` through its strides, masked where the index walks the row."""
    val = b.value_at(v.id, idx)
    offset = b.dag.isum([b.dag.imul(i, b.stride(f"out{k}", d)) for d, i in enumerate(idx)], hint=f"out{k}_row")
    return Store(k, val, offset, b.mask if offset.full else None, v.dtype)


def plan_group_rows(prog: Program) -> Plan:
    """GroupNorm's rows: one program per (sample, group) of an (N, C, *spatial) input, `cols` walking the
    group's C / G x H x W elements in the input's memory order, unravelled into its own index (n, c, h, w).
    Every value of the program is read at that index (the pointwise ops around the norm: SiLU after it, a
    residual add before it), per-channel vectors at c, and the norm's statistics per row at (n, g). A
    second GroupNorm in the chain must have the same rows."""
    dag = Dag()
    b = Builder(prog, dag)
    first = prog.row_ops[0]
    view = next(v for v in first.args.values() if hasattr(v, "identity"))
    full = list(view.shape)
    groups = group_count(first.args)
    keys = [prog.dim_key(d) for d in full]
    for o in prog.row_ops[1:]:
        shape = next(v for v in o.args.values() if hasattr(v, "identity")).shape
        if o.low.shape != "group" or group_count(o.args) != groups or \
                [prog.dim_key(d) for d in shape] != keys:
            raise Unsupported(f"{o.qualname} beside a GroupNorm over other rows")
    per = full[1].value // groups  # channels per group (the channel count is pinned by the shape rule)
    spatial = full[2:]
    lead = [full[0], Dim((), groups, groups)]
    row = dag.var("row", full=False)
    b.cols = dag.var("cols", full=True)
    b.mask = dag.var("col_mask", full=True)
    n_idx, g_idx = _unravel(b, row, lead, [0, 1], "r", "")
    # The walk along a row follows the input's memory order: channel by channel for NCHW, position by
    # position (its C / G channels side by side) for channels_last, so neighbouring columns are neighbours
    # in memory and the loads coalesce either way.
    src = prog.source(view.src)
    last = view.identity and len(src.rec_strides) > 2 and src.rec_strides[1] < min(src.rec_strides[2:])
    order = list(range(1, len(spatial) + 1)) + [0] if last else list(range(len(spatial) + 1))
    within = _unravel(b, b.cols, [Dim((), per, per)] + spatial, order, "g", "")
    c_idx = dag.iadd(dag.imul(g_idx, dag.lit(per)), within[0])
    b.n = dag.lit(per)
    for d in spatial:
        b.n = dag.imul(b.n, b.size(d))
    b.group = GroupRows((n_idx, c_idx) + tuple(within[1:]), (n_idx, g_idx))
    stores = []
    for k, v in enumerate(prog.outputs):
        out_keys = [prog.dim_key(d) for d in v.shape]
        if out_keys == keys:
            idx = b.group.index
        elif out_keys == [keys[0], str(groups)]:
            idx = b.group.stats
        else:
            raise Unsupported(f"output {v.id} of shape {[d.value for d in v.shape]} is neither GroupNorm's input "
                              f"shape ({[d.value for d in full]}) nor one value per group")
        stores.append(_row_store(b, k, v, idx))
    n_expr = " * ".join([str(per)] + [f"({size_expr(prog, d)})" if "+" in size_expr(prog, d) else size_expr(prog, d)
                                      for d in spatial])
    return Plan("rows", prog, dag, b, stores, lead=lead, n=None, n_expr=n_expr)


def _permutation(keys: list, lead_keys: list) -> list | None:
    """Positions in `lead_keys` of `keys`, when they are a permutation of distinct size classes."""
    if sorted(keys) != sorted(lead_keys) or len(set(lead_keys)) != len(lead_keys):
        return None
    return [lead_keys.index(k) for k in keys]


def _same_rows(prog: Program, a: list, b: list) -> bool:
    """Two leading shapes with the same number of rows at every size: literal (a reshape pins them)."""
    literal = all(prog.sizes.norm(d).literal for d in a + b)
    return literal and math.prod(d.value for d in a) == math.prod(d.value for d in b)


def size_expr(prog: Program, d: Dim) -> str:
    """A size as the launcher computes it from its arguments."""
    d = prog.sizes.norm(d)
    parts = [f"{t.split('.')[0]}.shape[{t.split('.')[1]}]" for t in d.terms]
    if d.const or not parts:
        parts.append(str(d.const))
    return " + ".join(parts)
