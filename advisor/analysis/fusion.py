"""Fusion groups: maximal legal sets of vertically connected ops, from a few rewrite rules.

Every node gets a *domain*: the iteration space its kernel walks. Pointwise ops walk their output
(`numel`); last-dim reductions, norms and softmax walk rows (`R` rows of `N`). The rules:

1. A fusible node joins the group of a producer when their domains agree: same numel; or the group
   has rows (R, N) and the node walks R*N (row-wise), R (one value per row) or N (a per-column
   vector, broadcast over rows).
2. A row op (reduction / norm / softmax) joins a group whose numel is its input's R*N; the group
   takes its rows. Two row ops in one group must agree on (R, N).
3. A node that reads from several groups merges them when all of them agree with it.
4. Never create a cycle: a group may not reach itself through a node outside it.
5. Do not fuse through a tensor shared by sibling modules (rotary cos/sin, attention masks read by
   every layer): it must be written anyway, and fusing it into one layer's chain would make that
   layer's pattern differ from all the others.
6. Never fuse across the parts of a training step (forward, backward, optimizer: `Node.phase`), nor an op
   inside the model's modules with one outside every module (a loss, the script's own arithmetic): a
   forward op and the backward op that reads its output run a whole pass apart, and a patch replaces a
   module's forward, which holds no op outside it.

Matmuls and convolutions are anchors; more rules build on them:
7. Epilogue: a pure pointwise group (or op) that alone reads an anchor's output, elementwise. A conv's only
   where cuDNN's fused conv runs it (conv [-> eval BatchNorm] [-> residual add] -> ReLU: `conv_epilogue_fits`).
8. Attention: matmul -> (scale / mask / other pointwise) -> softmax -> matmul, where each
   intermediate is read only inside the chain: the score matrix need never be written.
9. Matmul + reduction: matmul -> pointwise -> a reduction over leading (non-contracted) dims of
   the matmul output (SPLADE's max over the sequence): the matmul output need never be written.
10. Padded matmul: a GEMM alone whose leading dimension or base is not 16-byte aligned (GPT-2's logits,
   N = 50257), which cuBLAS runs with a slow unaligned kernel: padded to alignment it runs at its FLOP
   roofline (`alignment.py`; the analyzer keeps it only where that measures worth the pad copies).
11. Window: a max-pool whose input a pointwise group (or one fusible op) makes and nothing else reads: the
   group is computed at each tap of each window (again where windows overlap: cheap arithmetic, the
   loads hit the cache) and its output is never written: ResNet's stem, BatchNorm + ReLU + max-pool.
Everything else is a barrier.

Where a rule found a structure it could fuse and refused it (domains that disagree, a cycle, an anchor's
output read elsewhere, ...), it says so: a `Refused` record (the rule, why, the ops) in the list handed to
`find_groups`, which the analyzer counts into analysis.json's `refused`. A node a rule does not apply to
(not a matmul, not a reduction) is not a refusal.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from advisor.analysis.alignment import unaligned_gemm
from advisor.graph.nodes import Graph, Node, per_template
from advisor.ops.args import bind, group_count, reduced_dims
from advisor.ops.lowering import why_not_generated
from advisor.ops.registry import OpClass, OpInfo, conv_epilogue_fits, is_conv, lookup


@dataclass(frozen=True)
class Refused:
    """A group a fusion rule found and refused: the rule, the reason, the nodes (graph indices) involved."""

    rule: str
    why: str
    members: tuple[int, ...]


class _Refusals:
    """Where the rules record what they refuse; a no-op when nobody asked."""

    def __init__(self, into: list | None):
        self.into = into

    def __call__(self, rule: str, why: str, *members: int) -> None:
        if self.into is not None:
            self.into.append(Refused(rule, why, tuple(sorted(set(members)))))


@dataclass(frozen=True)
class Domain:
    numel: int
    rows: tuple[int, int] | None = None  # (R, N) for row ops


@dataclass
class Group:
    members: list[int]  # node idxs, in execution order
    numel: int
    rows: tuple[int, int] | None = None
    anchor: int | None = None  # epilogue candidates: the matmul/conv node
    extends: "Group | None" = None  # epilogue candidates: the pointwise group they absorb
    kind: str = "fusion"  # fusion | epilogue | attention | matmul_reduction | padded_matmul


def fusible(info: OpInfo) -> bool:
    """Whether the rules may put an op of this registry entry in a group (given its arguments and shapes)."""
    return (info.cls in (OpClass.POINTWISE, OpClass.REDUCTION) or bool({"fusible_cat", "window"} & info.tags)
            or (info.cls == OpClass.NORM and bool({"batchnorm", "rowwise", "grouped"} & info.tags)))


def not_generated(graph: Graph, group: Group) -> list[dict]:
    """The group's fused ops the generator refuses whatever their arguments, each with the reason."""
    ops = dict.fromkeys(graph.nodes[m].op for m in group.members)
    return [{"op": op, "reason": why} for op in ops if (info := lookup(op)) is not None and fusible(info)
            and (why := why_not_generated(op)) is not None]


def node_domain(graph: Graph, n: Node) -> Domain | None:
    """The node's iteration space if the registry says it can fuse, else None (a barrier)."""
    info = lookup(n.op)
    if info is None or not n.writes or not fusible(info) or "window" in info.tags:
        return None  # (a window op only ends a group: rule 11, `_windows`)
    out_numel = _numel(n.writes[0].shape)
    if n.cls == OpClass.POINTWISE or (info.tags and "fusible_cat" in info.tags):
        return Domain(max(out_numel, 1))
    if n.cls == OpClass.NORM and "batchnorm" in info.tags:
        return Domain(out_numel) if not _bn_training(n) else None
    if not n.reads:
        return None
    in_shape = n.reads[0].shape
    if not in_shape:
        return None
    total = _numel(in_shape)
    args = _args(n)
    if n.cls == OpClass.NORM and "rowwise" in info.tags:
        norm_shape = args.get("normalized_shape")
        cols = _numel(norm_shape) if isinstance(norm_shape, list) and norm_shape else in_shape[-1]
        return Domain(total, (total // max(cols, 1), cols))
    if n.cls == OpClass.NORM and "grouped" in info.tags:
        # GroupNorm: each (sample, group) a row of its channels' elements, C / G x H x W of them.
        groups = group_count(args)
        rows = in_shape[0] * groups if isinstance(groups, int) and groups > 0 else 0
        return Domain(total, (rows, total // rows)) if rows and total % rows == 0 else None
    if n.cls == OpClass.REDUCTION and args and reduced_dims(args.get("dim"), len(in_shape)) == (len(in_shape) - 1,):
        # The last dim only (a full reduction of a vector is one row): R rows of N.
        return Domain(total, (total // max(in_shape[-1], 1), in_shape[-1]))
    return None


def find_groups(graph: Graph, refused: list | None = None) -> list[Group]:
    """The fusion groups of `graph`; what the rules refused is appended to `refused` (`Refused` records)."""
    refuse = _Refusals(refused)
    domain_of = per_template(lambda n: node_domain(graph, n))
    nodes, values = graph.nodes, graph.values
    domains = list(map(domain_of, nodes))
    group_of: dict[int, Group] = {}
    producers = [_producers(graph, n) for n in nodes]
    shared = _SharedValues(graph)
    for n, d in zip(nodes, domains):
        if d is None:
            continue
        cands = []
        for p in producers[n.idx]:
            g = group_of.get(p)
            if g is None or g in cands or nodes[p].iteration != n.iteration or _apart(nodes[p], n):
                continue
            if any(values[u.value].producer == p and shared[u.value] for u in n.reads):
                refuse("shared tensor", "reads a tensor sibling modules share (rule 5): it is written anyway", p, n.idx)
                continue
            cands.append(g)
        merged = Group([n.idx], d.numel, d.rows)
        for g in cands:
            trial = _join(g, merged)
            if trial is None:
                refuse("domains", "their iteration spaces disagree (rules 1-3)", *g.members, *merged.members)
            elif _has_cycle(graph, producers, trial.members):
                refuse("cycle", "the group would reach itself through an op outside it (rule 4)", *trial.members)
            else:
                merged = trial
        for m in merged.members:
            group_of[m] = merged
    unique = {id(g): g for g in group_of.values()}
    fused = [g for g in unique.values() if len(g.members) >= 2]
    for g in fused:
        g.members.sort()
    groups = (fused + _epilogues(graph, domains, group_of, refuse) + _attention(graph, fused, group_of, refuse)
              + _matmul_reductions(graph, domains, group_of, refuse) + _padded_matmuls(graph)
              + _windows(graph, domains, group_of, refuse))
    kept = []
    for g in groups:
        if any(_apart(nodes[g.members[0]], nodes[m]) for m in g.members):
            refuse("apart", "its ops run in different parts of a training step, or inside and outside the "
                   "model's modules (rule 6)", *g.members)
        else:
            kept.append(g)
    return kept


class _SharedValues:
    """shared[value id]: `shared_by_sibling_modules` of the value's readers, asked only of the values a
    fusible node reads from a grouped producer, once per value and once per distinct set of reader modules."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.by_value: dict[int, bool] = {}
        self.by_modules: dict[frozenset, bool] = {}

    def __getitem__(self, vid: int) -> bool:
        shared = self.by_value.get(vid)
        if shared is None:
            nodes = self.graph.nodes
            paths = frozenset([nodes[c].module for c in self.graph.values[vid].consumers])
            shared = self.by_modules.get(paths)
            if shared is None:
                shared = self.by_modules[paths] = _sibling_subtrees(paths)
            self.by_value[vid] = shared
        return shared


def _join(g: Group, h: Group) -> Group | None:
    """Merge two groups, or None if their domains disagree (rules 1-3)."""
    if g.rows and h.rows and g.rows != h.rows:
        return None
    rows = g.rows or h.rows
    members = sorted(set(g.members) | set(h.members))
    if rows:
        R, N = rows
        allowed = {R * N, R, N}
        if g.numel not in allowed or h.numel not in allowed:
            return None
        return Group(members, R * N, rows)
    numel = max(g.numel, h.numel)
    if numel % g.numel or numel % h.numel:
        return None
    return Group(members, numel, None)


def _has_cycle(graph: Graph, producers: list[list[int]], members: list[int]) -> bool:
    """True if some member depends on a node outside the set that itself depends on the set."""
    inside = set(members)
    lo = min(members)
    seen: set[int] = set()
    stack = [p for m in members for p in producers[m] if p not in inside and p > lo]
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        for p in producers[x]:
            if p in inside:
                return True
            if p > lo:
                stack.append(p)
    return False


def _epilogues(graph: Graph, domains: list, group_of: dict[int, Group], refuse=_Refusals(None)) -> list[Group]:
    """An anchor whose output is read only by one pure pointwise group (or one fusible op), elementwise."""
    out = []
    for n in graph.nodes:
        if n.cls != OpClass.MATMUL or len(n.writes) != 1:
            continue
        v = graph.values[n.writes[0].value]
        consumers = sorted(set(v.consumers))
        if not consumers:
            continue
        groups = {id(group_of.get(c)) for c in consumers}
        base = group_of.get(consumers[0])
        if base is not None and len(base.members) < 2:
            base = None
        if len(consumers) > 1 and (base is None or len(groups) != 1):
            refuse("epilogue", "the anchor's output is read by more than one group (rule 7)", n.idx, *consumers)
            continue
        if base is not None and base.rows is not None:
            # a row reduction cannot sit in a matmul tile's epilogue unless N fits a tile
            refuse("epilogue", "the group after the anchor reduces rows (rule 7)", n.idx, *base.members)
            continue
        c = graph.nodes[consumers[0]]
        d = domains[c.idx]
        if d is None or d.rows is not None or d.numel != _numel(v.shape):
            if d is not None:
                refuse("epilogue", "the op after the anchor is not elementwise on its output (rule 7)", n.idx, c.idx)
            continue
        members = sorted({n.idx, *(base.members if base else [c.idx])})
        if is_conv(n.op) and not conv_epilogue_fits([graph.nodes[m].op for m in members]):
            # no conv kernel runs it: conv + the pointwise group is all there is (rule 7's conv clause)
            refuse("epilogue", "no fused conv kernel runs this chain (rule 7's conv clause)", *members)
            continue
        out.append(Group(members, d.numel, None, anchor=n.idx, extends=base, kind="epilogue"))
    return out


def _attention(graph: Graph, groups: list[Group], group_of: dict[int, Group], refuse=_Refusals(None)) -> list[Group]:
    out = []
    for g in groups:
        if not g.rows or not any(_is_softmax(graph.nodes[m]) for m in g.members):
            continue
        inside = set(g.members)
        first = [graph.values[u.value].producer for m in g.members for u in graph.nodes[m].reads
                 if graph.values[u.value].producer not in inside and graph.values[u.value].producer >= 0]
        scores = [p for p in dict.fromkeys(first) if graph.nodes[p].cls == OpClass.MATMUL
                  and _only_read_by(graph, p, inside)]
        escapes = [u.value for m in g.members for u in graph.nodes[m].writes
                   if any(c not in inside for c in graph.values[u.value].consumers)]
        if len(scores) != 1 or len(escapes) != 1:
            refuse("attention", "the softmax chain is not fed by one score matmul read only by it, or writes more "
                   "than one output (rule 8)", *g.members)
            continue
        readers = set(graph.values[escapes[0]].consumers) - inside
        pv = graph.nodes[next(iter(readers))] if len(readers) == 1 else None
        if pv is None or pv.cls != OpClass.MATMUL:
            refuse("attention", "the probabilities are not read by one matmul alone (rule 8)", *g.members)
            continue
        out.append(Group(sorted({scores[0], *g.members, pv.idx}), g.numel, g.rows, extends=g, kind="attention"))
    return out


def _matmul_reductions(graph: Graph, domains: list, group_of: dict[int, Group],
                       refuse=_Refusals(None)) -> list[Group]:
    out = []
    for r in graph.nodes:
        if r.cls != OpClass.REDUCTION or domains[r.idx] is not None or len(r.reads) < 1:
            continue
        args, ndim = _args(r), len(r.reads[0].shape)
        if not args or not ndim or ndim - 1 in reduced_dims(args.get("dim"), ndim):
            continue  # over the last dim (row and full reductions): the row kernels' business
        src = graph.values[r.reads[0].value].producer
        if src < 0:
            continue
        chain = group_of.get(src)
        members = list(chain.members) if chain is not None and len(chain.members) >= 2 else [src]
        inside = set(members)
        anchors = [graph.values[u.value].producer for m in members for u in graph.nodes[m].reads
                   if graph.values[u.value].producer >= 0 and graph.values[u.value].producer not in inside
                   and graph.nodes[graph.values[u.value].producer].cls == OpClass.MATMUL]
        if graph.nodes[src].cls == OpClass.MATMUL:
            anchors, members, inside = [src], [], set()
        anchors = list(dict.fromkeys(anchors))
        if len(anchors) != 1 or not _only_read_by(graph, anchors[0], inside | {r.idx}):
            if anchors:
                refuse("matmul reduction", "the matmul's output is needed elsewhere, or more than one matmul feeds "
                       "the chain (rule 9)", *anchors, *members, r.idx)
            continue
        if members and not _only_read_by(graph, members[-1], {r.idx}):
            refuse("matmul reduction", "the chain's output is needed elsewhere (rule 9)", *anchors, *members, r.idx)
            continue
        out.append(Group(sorted({anchors[0], *members, r.idx}), _numel(r.reads[0].shape), None,
                         kind="matmul_reduction"))
    return out


def _windows(graph: Graph, domains: list, group_of: dict[int, Group], refuse=_Refusals(None)) -> list[Group]:
    """Rule 11: each max-pool after a pointwise group (or one fusible op) that only it reads, with that group."""
    out = []
    for n in graph.nodes:
        info = lookup(n.op)
        if info is None or "window" not in info.tags or not n.reads or not n.writes:
            continue
        if any(graph.values[w.value].consumers for w in n.writes[1:]):
            # the kernel computes only the maxima
            refuse("window", "the pool's indices are read (max_unpool, a backward) (rule 11)", n.idx)
            continue
        src = graph.values[n.reads[0].value].producer
        if src < 0 or domains[src] is None or domains[src].rows is not None or graph.nodes[src].iteration != n.iteration:
            continue
        chain = group_of.get(src)
        members = list(chain.members) if chain is not None and len(chain.members) >= 2 and chain.rows is None else [src]
        inside = set(members) | {n.idx}
        if not all(_only_read_by(graph, m, inside) for m in members):
            refuse("window", "the chain before the pool is read elsewhere too: it is written anyway (rule 11)",
                   *members, n.idx)
            continue
        out.append(Group(sorted(inside), _numel(n.writes[0].shape), None, extends=chain))
    return out


def _padded_matmuls(graph: Graph) -> list[Group]:
    """Each GEMM that cuBLAS would run unaligned, alone (rule 10): whatever fuses with it elsewhere, padding is
    about the GEMM's own kernel."""
    return [Group([n.idx], _numel(n.writes[0].shape), None, kind="padded_matmul") for n in graph.nodes
            if n.cls == OpClass.MATMUL and n.writes and unaligned_gemm(n) is not None]


def _only_read_by(graph: Graph, producer: int, readers: set[int]) -> bool:
    return all(c in readers for u in graph.nodes[producer].writes for c in graph.values[u.value].consumers)


def _is_softmax(n: Node) -> bool:
    info = lookup(n.op)
    return bool(info and "rowwise" in info.tags and n.cls == OpClass.REDUCTION)


def shared_by_sibling_modules(graph: Graph, consumers: list[int]) -> bool:
    """True when a value's readers sit in two or more sibling module subtrees (e.g. every layer)."""
    return _sibling_subtrees({graph.nodes[c].module for c in consumers})


def _sibling_subtrees(paths) -> bool:
    if len(paths) < 2 or "" in paths:
        return False
    split = [tuple(re.split(r"[/.]", p)) for p in paths]
    common = 0
    while all(len(s) > common for s in split) and len({s[common] for s in split}) == 1:
        common += 1
    return all(len(s) > common for s in split)


def _apart(a: Node, b: Node) -> bool:
    """Rule 6: two ops no group may hold together (other parts of a training step, or one inside the modules
    and one outside them all)."""
    return a.phase != b.phase or (a.module == "") != (b.module == "")


def _producers(graph: Graph, n: Node) -> list[int]:
    seen = []
    for u in n.reads:
        p = graph.values[u.value].producer
        if p >= 0 and p not in seen:
            seen.append(p)
    return seen


def _numel(shape) -> int:
    return int(math.prod(shape)) if shape else 1


def _args(n: Node) -> dict:
    """The node's arguments by schema name, decoded; empty when its schema is unknown (then every rule
    that needs an argument leaves the node alone)."""
    return bind(n.op, n.schema, n.args) or {}


def _bn_training(n: Node) -> bool:
    args = _args(n)
    if not args:
        return True  # unknown: assume training, which is a barrier
    training = args.get("training", False)  # the _no_training variants have no such argument
    return training is None or bool(training)
