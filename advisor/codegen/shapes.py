"""Output shapes of ops in sizes' symbols: broadcasting unifies sizes, cat adds them, reductions
drop the last dim; row ops and norms must work over the last dim (the rows the generator knows), except
GroupNorm, whose rows are its groups (`codegen.plan`'s grouped rows)."""
from __future__ import annotations

from advisor.codegen.ir import Dim, Op, Program, Sizes, View
from advisor.ops.args import group_count
from advisor.ops.lowering import Unsupported


def infer_shapes(p: Program, op: Op, recorded: list) -> list:
    rule, a = op.low.shape, op.args
    views = [v for v in a.values() if isinstance(v, View)]
    if rule == "cat":
        return [_cat_shape(p, a["tensors"], a.get("dim") or 0)]
    if rule == "factory":  # a constant tensor: the sizes its arguments name, literal
        return [[Dim((), n, n) for n in a["size"]]]
    first = views[0].shape if views else []
    if rule == "broadcast":
        out = broadcast(p.sizes, [v.shape for v in views])
        return [out, out]  # a second output only for native_dropout's mask
    if rule == "channel":  # batch norm: per-channel vectors walk dim 1; other outputs (saved stats) as recorded
        for name in op.low.channel:
            v = a.get(name)
            if isinstance(v, View) and len(first) > 1:
                p.sizes.unify(first[1], v.shape[0])
        return [list(first)] + [[Dim((), n, n) for n in shape] for shape in recorded[1:]]
    if rule == "window":  # max-pooling: the windows' geometry is the spatial sizes', fixed at the recorded ones
        if len(first) < 3:
            raise Unsupported(f"{op.qualname} of a {len(first)}-d input")
        for d in first[-2:]:
            p.sizes.pin(d)
        out = list(first[:-2]) + [Dim((), n, n) for n in recorded[0][-2:]]
        return [out, out]  # the second output (indices) is refused where read: `Builder.eval_window`
    if rule == "row":
        _check_last_dim(a.get("dim"), len(first))
        return [list(first)]
    if rule == "norm":
        ns = a.get("normalized_shape") or []
        if len(ns) != 1 or ns[0] != first[-1].value:
            raise Unsupported(f"normalized_shape {ns}: only the last dim is a row")
        broadcast(p.sizes, [first] + [v.shape for v in views[1:]])  # weight and bias walk the row
        stats = list(first[:-1]) + [Dim((), 1, 1)]
        return [list(first), stats, stats]
    if rule == "group":  # GroupNorm over (N, C, *spatial): rows are (sample, group), weight and bias walk C
        groups = group_count(a)
        if len(first) < 2 or not isinstance(groups, int) or groups < 1 or first[1].value % groups:
            raise Unsupported(f"{op.qualname} of shape {[d.value for d in first]} in {groups} groups")
        for name in op.low.channel:
            v = a.get(name)
            if isinstance(v, View):
                p.sizes.unify(first[1], v.shape[0])
        p.sizes.pin(first[1])  # a row is C / G channels: the channel count is fixed at the recorded one
        stats = [first[0], Dim((), groups, groups)]
        return [list(first), stats, stats]
    if rule == "reduce":
        dims = a.get("dim")
        keep = bool(a.get("keepdim"))
        if dims in (None, []) or (isinstance(dims, list) and len(dims) == len(first) == 1):
            if len(first) > 1:
                raise Unsupported(f"{op.qualname} over all {len(first)} dims: only last-dim reductions fuse")
            out = [Dim((), 1, 1)] * len(first) if keep else []
        else:
            _check_last_dim(dims, len(first))
            out = list(first[:-1]) + ([Dim((), 1, 1)] if keep else [])
        return [out, out]
    raise Unsupported(f"shape rule {rule!r}")


def _check_last_dim(dims, ndim: int) -> None:
    d = dims[0] if isinstance(dims, (list, tuple)) and len(dims) == 1 else dims
    if not isinstance(d, int) or d not in (-1, ndim - 1):
        raise Unsupported(f"reduces over dim {dims}: only the last dim is a row")


def broadcast(sizes: Sizes, shapes: list) -> list:
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for j in range(rank):
        dims = [s[j - rank + len(s)] for s in shapes if j - rank + len(s) >= 0]
        big = [d for d in dims if d.value != 1]
        if not big:
            out.append(dims[0])
            continue
        d = big[0]
        for other in big[1:]:
            d = sizes.unify(d, other)
        out.append(d)
    return out


def _cat_shape(p: Program, views: list, dim: int) -> list:
    rank = len(views[0].shape)
    dim = dim % rank
    out = []
    for j in range(rank):
        if j == dim:
            terms, const = [], 0
            for v in views:
                d = p.sizes.norm(v.shape[j])
                terms += d.terms
                const += d.const
            out.append(Dim(tuple(terms), const, sum(v.shape[j].value for v in views)))
        else:
            d = views[0].shape[j]
            for v in views[1:]:
                d = p.sizes.unify(d, v.shape[j])
            out.append(d)
    return out
