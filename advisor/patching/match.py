"""Find an op program in a captured aten FX graph.

One mechanism for every pattern. The program is traced to an FX graph P (`program.program_graph`),
so both sides are aten graphs decomposed the same way. A match maps every compute node of P to a
node of the captured graph G such that:

- ops agree (overload packet; in-place ops read as their functional twin, from the op registry;
  the registry's `SPELLINGS` holds the few ops the two sides may still spell differently),
- every non-tensor argument agrees (floats to 1e-6 relative; wrapped-scalar sentinels bind to
  whatever literal or 0-dim tensor G holds there), and output dtypes and shapes agree,
- dataflow agrees *through views*: an edge reads the same producer after stripping view ops on both
  sides (`view`, `t`, `slice`, `expand`, `as_strided`, ... whatever the registry calls a view), and
  the view itself agrees: same shape, same strides (dims of size 1 aside) and same storage offset
  relative to the producer (program inputs: relative to the input's own view),
- intermediates do not escape: a G node whose value is used outside the match must be a program
  output. A match refused for that alone is handed back as an `Escape` (which value, read by what):
  the trace saw no reader of that value, the capture has one (a KV cache the module returns holds
  a `cat` the trace took for an intermediate), so the kernel, which does not write it, cannot
  replace these ops there.

The search starts from one P node (an output), tries every G node with that op, and grows the
mapping along P's edges (an argument of a mapped node is determined; a consumer of a mapped node is
searched among the G users of its image), backtracking on conflicts. Programs are small, so this
is cheap; a long one over many identical ops is not (RWKV's recurrence unrolled over the sequence: a
chain of ~400 pointwise ops, the search backtracking across its repeats for minutes), so one `find`
may do `SEARCH_BUDGET` units of work (a node tried, weighted by the mapping it extends) and then
raises `SearchTooLong`: that pattern stays unpatched in that graph, said in the capture's log.

Not matched yet (reported as "not found"): programs whose nodes are not connected through dataflow;
a capture that computes the same thing with different ops (e.g. a hand-written pow/mean/rsqrt chain
vs `aten::rms_norm`). Other shapes than profiled: `find(loose=True)` finds where the pattern stands, and the
program rewritten at that place's layouts (`resize`) is matched exactly.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Graph, Node

from advisor.ops.registry import SPELLINGS, OpClass, lookup, tagged
from advisor.patching.program import is_scalar_slot, is_sentinel


# ------------------------------------------------------------------------------------ node helpers
def op_name(n: Node) -> str | None:
    if n.op != "call_function":
        return None
    if n.target is operator.getitem:
        return "getitem"
    if isinstance(n.target, torch._ops.OpOverload):
        return n.target.name()
    return None


def node_arg(n: Node, index: int, name: str, schema=None):
    """Argument `name` (at `index` in `schema`, the node's own target's by default) as the node passes it, or its
    default."""
    if name in n.kwargs:
        return n.kwargs[name]
    if index < len(n.args):
        return n.args[index]
    return (schema or n.target._schema).arguments[index].default_value


def traced_value(x) -> torch.Tensor | None:
    """A node's traced value (dynamo's `example_value`, AOTAutograd's `val`), or None."""
    if not isinstance(x, Node):
        return None
    v = x.meta.get("example_value", x.meta.get("val"))
    return v if isinstance(v, torch.Tensor) else None


def size_hint(size) -> int | None:
    """A size or stride as an int: a symbolic one (a dynamic-shape graph) by the value it was traced at."""
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if hint is not None else None


def set_node_arg(n: Node, index: int, name: str, value) -> None:
    if index < len(n.args) and name not in n.kwargs:
        args = list(n.args)
        args[index] = value
        n.args = tuple(args)
    else:
        n.kwargs = {**n.kwargs, name: value}


def is_view(n: Node) -> bool:
    name = op_name(n)
    if name == "getitem":  # an element of split/chunk/unbind is a view too
        return isinstance(n.args[0], Node) and is_view(n.args[0])
    info = lookup(name) if name else None
    return info is not None and info.cls == OpClass.VIEW


def is_identity_copy(n: Node) -> bool:
    # a copy that changes nothing when it keeps the layout (the registry's "identity_copy"): seen through
    name = canonical(n)
    if name is None or not tagged(name, "identity_copy") or not isinstance(n.args[0], Node):
        return False
    a, b = layout(n), layout(n.args[0])
    return a is not None and a == b


def is_transparent(n: Node) -> bool:
    return is_view(n) or is_identity_copy(n)


def strip(n: Node) -> Node:
    """The tensor a chain of views (and layout-keeping copies) reads."""
    while is_transparent(n):
        n = n.args[0]
    return n


def canonical(n: Node) -> str | None:
    name = op_name(n)
    if name is None or name == "getitem":
        return name
    base = name.split(".", 1)[0] if "." in name.split("::", 1)[1] else name
    info = lookup(base)
    if info is not None and info.inplace and base.endswith("_"):
        base = base[:-1]
    return SPELLINGS.get(base, base)


def full_args(n: Node) -> list:
    """Arguments by schema position, defaults filled in: `add(x, y)` and `add(x, y, alpha=1)` agree."""
    if n.target is operator.getitem:
        return list(n.args)
    out = []
    for i, a in enumerate(n.target._schema.arguments):
        if i < len(n.args) and not a.kwarg_only:
            out.append(n.args[i])
        elif a.name in n.kwargs:
            out.append(n.kwargs[a.name])
        else:
            out.append(a.default_value if a.has_default_value() else None)
    return out


def val(n: Node):
    return n.meta.get("val")


def layout(n: Node) -> tuple | None:
    v = val(n)
    if not isinstance(v, torch.Tensor):
        return None
    return tuple(v.shape), tuple(v.stride()), int(v.storage_offset()), v.dtype


def same_strides(shape, a, b) -> bool:
    return len(a) == len(b) and all(d <= 1 or x == y for d, x, y in zip(shape, a, b))


def compute_users(n: Node) -> list[Node]:
    """Non-view nodes reading n, directly or through views."""
    out, stack = [], list(n.users)
    while stack:
        u = stack.pop()
        if is_transparent(u):
            stack.extend(u.users)
        elif u not in out:
            out.append(u)
    return out


def _same_literal(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_literal(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b and type(a) is type(b)
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(b, (int, float)) and isinstance(a, (int, float)) and \
            math.isclose(a, b, rel_tol=1e-6) or (a != a and b != b)  # no absolute tolerance: eps 1e-12 is not 0
    if isinstance(a, torch.device) and isinstance(b, torch.device):
        return a.type == b.type
    return a == b


# ------------------------------------------------------------------------------------ the pattern
@dataclass
class Pattern:
    """P, prepared for matching."""

    program: dict
    graph: Graph
    compute: list[Node]  # P's compute nodes, in search order (connected, an output first)
    outputs: list[Node]  # P's output nodes, in program output order
    input_of: dict[Node, int]  # P placeholder (a flat storage) -> program input index
    # `program_graph(views=...)`: each input's own view of its storage (input index -> node), and the views the
    # program's reads add (node -> the read's place in the program: node index, argument, list index or None)
    input_views: dict = field(default_factory=dict)
    read_views: dict = field(default_factory=dict)

    @classmethod
    def build(cls, program: dict, gm: torch.fx.GraphModule, views: list | None = None) -> "Pattern":
        g = gm.graph
        placeholders = [n for n in g.nodes if n.op == "placeholder"]
        tensor_idx = [k for k, s in enumerate(program["inputs"]) if not is_scalar_slot(s)]
        input_of = dict(zip(placeholders, tensor_idx))
        compute = [n for n in g.nodes if n.op == "call_function" and not is_transparent(n)]
        out_node = next(n for n in g.nodes if n.op == "output")
        outputs = [strip(o) for o in out_node.args[0]]
        order = _search_order(compute, outputs)
        if len(order) != len(compute):
            raise ValueError("program is not connected through dataflow")
        pattern = cls(program, g, order, outputs, input_of)
        if views is not None:
            pattern.input_views, pattern.read_views = _view_places(program, g, input_of, views)
        return pattern


def _view_places(program: dict, g: Graph, input_of: dict, views: list) -> tuple[dict, dict]:
    """(input index -> its view node, read view node -> its read's place), or two empty dicts where the graph's
    `as_strided` nodes do not line up with the reads recorded while tracing it."""
    strided = [n for n in g.nodes if n.op == "call_function" and n.target is torch.ops.aten.as_strided.default]
    inputs = {input_of[n.args[0]]: n for n in strided if n.args[0] in input_of}
    reads = [n for n in strided if n.args[0] not in input_of]
    places = {id(r): place for place, r in _reads_of(program)}
    if len(reads) != len(views) or any(id(v) not in places for v in views):
        return {}, {}
    return inputs, {n: places[id(v)] for n, v in zip(reads, views)}


def _reads_of(program: dict):
    """(place, read) of every tensor read of the program's nodes: place = (node index, argument, list index)."""
    for i, node in enumerate(program["nodes"]):
        for j, a in enumerate(node["args"]):
            if "ref" in a:
                yield (i, j, None), a
            for k, r in enumerate(a.get("list") or []):
                if isinstance(r, dict) and "ref" in r:
                    yield (i, j, k), r


def _search_order(compute: list[Node], outputs: list[Node]) -> list[Node]:
    members = set(compute)
    adj = {n: [] for n in compute}
    for n in compute:
        for a in _arg_nodes(n):
            p = strip(a)
            if p in members:
                adj[n].append(p)
                adj[p].append(n)
    start = outputs[-1] if outputs and outputs[-1] in members else compute[-1]
    order, seen = [start], {start}
    i = 0
    while i < len(order):
        for m in adj[order[i]]:
            if m not in seen:
                seen.add(m)
                order.append(m)
        i += 1
    return order


def _arg_nodes(n: Node) -> list[Node]:
    out = []
    for a in list(n.args) + list(n.kwargs.values()):
        if isinstance(a, Node):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, Node))
    return out


# ------------------------------------------------------------------------------------ the match
@dataclass
class InputBinding:
    kind: str  # "tensor" | "literal" | "node" (a 0-dim tensor where eager had a wrapped scalar)
    root: Node | None = None  # tensor: the G tensor the reads come from (views stripped)
    value: Any = None  # literal: the number
    reads: list = field(default_factory=list)  # tensor: [(P read node, G read node)]


@dataclass
class Match:
    nodes: dict[Node, Node]  # P compute node -> G node
    inputs: list[InputBinding | None]  # per program input
    outputs: list[Node]  # G nodes holding the program outputs, in order
    views: dict = field(default_factory=dict)  # `find(loose=True)`: P read view -> the G read it stands for

    def g_nodes(self) -> set[Node]:
        return set(self.nodes.values())


class _State:
    def __init__(self, pattern: Pattern, loose: bool = False):
        self.p2g: dict[Node, Node] = {}
        self.g2p: dict[Node, Node] = {}
        self.inputs: list[InputBinding | None] = [None] * len(pattern.program["inputs"])
        self.loose = loose  # sizes, strides and offsets not compared (`find(loose=True)`)
        self.views: dict[Node, Node] = {}  # loose: each P read view -> the G read it stands for

    def copy(self) -> "_State":
        s = _State.__new__(_State)
        s.p2g, s.g2p, s.loose, s.views = dict(self.p2g), dict(self.g2p), self.loose, dict(self.views)
        s.inputs = [None if b is None else InputBinding(b.kind, b.root, b.value, list(b.reads)) for b in self.inputs]
        return s


@dataclass(frozen=True)
class Escape:
    """A complete match refused because one of its intermediates is used outside it."""

    op: str  # the intermediate's op (`aten::cat`)
    position: int  # its place among the pattern's ops, 1-based
    ops: int  # how many ops the pattern has
    returned: bool  # the captured graph returns it (state the module keeps or hands back, a cache)
    reader: str | None  # else an op outside the pattern that reads it

    def describe(self) -> str:
        where = "an output of the captured graph (state the module keeps or returns, such as a cache)" \
            if self.returned else f"read by {self.reader} outside the pattern"
        return f"the result of its {self.op} (op {self.position} of {self.ops}) is also {where}"


SEARCH_BUDGET = 200_000  # work units for one `find` (under a second of Python); the tiny HF models' patterns use 10-123


class SearchTooLong(RuntimeError):
    """The search for one pattern ran past `SEARCH_BUDGET`: the pattern is left unpatched in that graph."""


class _Budget:
    def __init__(self, pattern: Pattern):
        self.left, self.ops = SEARCH_BUDGET, len(pattern.compute)

    def spend(self, st: _State) -> None:
        self.left -= 1 + len(st.p2g)  # a node tried costs a copy of the mapping and a scan of it
        if self.left < 0:
            raise SearchTooLong(f"gave up matching a pattern of {self.ops} ops after {SEARCH_BUDGET:,} steps of "
                                "search (many identical ops to try)")


def find(pattern: Pattern, graph: Graph, exclude: set[Node] = frozenset(),
         escapes: list[Escape] | None = None, loose: bool = False) -> Match | None:
    """The first match of the pattern in graph order, avoiding `exclude`; None if there is none.
    `escapes` gets an `Escape` for each complete match refused because an intermediate escapes it.
    `loose`: sizes, strides and offsets are not compared (ops, arguments, dataflow, ranks and dtypes are): the
    match says where the pattern stands at other sizes, and which G read each P read view stands for
    (`Match.views`), for `resize.rebind`; only the rebound program's exact match may be substituted.
    Raises `SearchTooLong` past `SEARCH_BUDGET`."""
    anchor = pattern.compute[0]
    key = canonical(anchor)
    budget = _Budget(pattern)
    for g in list(graph.nodes):
        if g in exclude or g.op != "call_function" or canonical(g) != key:
            continue
        st = _State(pattern, loose)
        budget.spend(st)
        if not _bind(pattern, anchor, g, st):
            continue
        done = _grow(pattern, 1, st, exclude, budget)
        if done is not None:
            m = _finish(pattern, done, escapes)
            if m is not None:
                return m
    return None


def _grow(pattern: Pattern, i: int, st: _State, exclude, budget: _Budget) -> _State | None:
    if i == len(pattern.compute):
        return st
    p = pattern.compute[i]
    for g in _candidates(pattern, p, st):
        if g in st.g2p or g in exclude or g.op != "call_function" or canonical(g) != canonical(p):
            continue
        budget.spend(st)
        trial = st.copy()
        if _bind(pattern, p, g, trial):
            done = _grow(pattern, i + 1, trial, exclude, budget)
            if done is not None:
                return done
    return None


def _candidates(pattern: Pattern, p: Node, st: _State) -> list[Node]:
    # p feeds an already-mapped node: the G node at the same argument position is the only candidate.
    for q, gq in st.p2g.items():
        for pa, ga in _paired_edges(full_args(q), full_args(gq)):
            if strip(pa) is p:
                return [strip(ga)] if isinstance(ga, Node) else []
    # p reads an already-mapped node: search the users of its image.
    for a in _arg_nodes(p):
        u = strip(a)
        if u in st.p2g:
            return compute_users(st.p2g[u])
    return []


def _paired_edges(pargs: list, gargs: list):
    """(P arg node, G arg) pairs at the same positions, list arguments (cat) element by element."""
    for pa, ga in zip(pargs, gargs):
        if isinstance(pa, Node):
            yield pa, ga
        elif isinstance(pa, (list, tuple)) and isinstance(ga, (list, tuple)) and len(pa) == len(ga):
            for x, y in zip(pa, ga):
                if isinstance(x, Node):
                    yield x, y


def _bind(pattern: Pattern, p: Node, g: Node, st: _State) -> bool:
    """Map p -> g if they agree on op, literals, outputs and every edge whose other end is known."""
    if not _same_outputs(p, g, st):
        return False
    pargs, gargs = full_args(p), full_args(g)
    if len(pargs) != len(gargs):
        return False
    st.p2g[p], st.g2p[g] = g, p
    if any(b is not None and b.kind == "tensor" and b.root is g for b in st.inputs):
        return False  # g is already the source of a program input: it cannot also be inside
    for pa, ga in zip(pargs, gargs):
        if not _bind_arg(pattern, pa, ga, st):
            return False
    # Edges from p to consumers mapped before it.
    for q, gq in list(st.p2g.items()):
        for pa, ga in _paired_edges(full_args(q), full_args(gq)):
            if strip(pa) is p and (not isinstance(ga, Node) or strip(ga) is not g or not _same_view(pa, p, ga, g, st)):
                return False
    return True


def _bind_arg(pattern: Pattern, pa: Any, ga: Any, st: _State) -> bool:
    if isinstance(pa, Node):
        if not isinstance(ga, Node):
            return False
        pu, gu = strip(pa), strip(ga)
        if pu in pattern.input_of:
            k = pattern.input_of[pu]
            b = st.inputs[k]
            if b is None:
                if gu in st.g2p:
                    return False
                b = st.inputs[k] = InputBinding("tensor", root=gu)
            if b.root is not gu:
                return False
            b.reads.append((pa, ga))
            return True
        if pu in st.p2g:
            return st.p2g[pu] is gu and _same_view(pa, pu, ga, gu, st)
        return True  # checked when pu is mapped
    if isinstance(pa, (list, tuple)):
        return isinstance(ga, (list, tuple)) and len(pa) == len(ga) and \
            all(_bind_arg(pattern, x, y, st) for x, y in zip(pa, ga))
    k = is_sentinel(pa, pattern.program)
    if k is not None:
        if isinstance(ga, Node):
            v = val(ga)
            if not isinstance(v, torch.Tensor) or v.dim() != 0:
                return False
            new = InputBinding("node", root=ga)
        elif isinstance(ga, (int, float)) and not isinstance(ga, bool):
            new = InputBinding("literal", value=ga)
        else:
            return False
        old = st.inputs[k]
        if old is None:
            st.inputs[k] = new
            return True
        return old.kind == new.kind and (old.root is new.root if new.kind == "node" else old.value == new.value)
    return not isinstance(ga, Node) and _same_literal(pa, ga)


def _same_outputs(p: Node, g: Node, st: _State) -> bool:
    pv, gv = val(p), val(g)
    pv = pv if isinstance(pv, (tuple, list)) else (pv,)
    gv = gv if isinstance(gv, (tuple, list)) else (gv,)
    if len(pv) != len(gv):
        return False
    for a, b in zip(pv, gv):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return False
        if isinstance(a, torch.Tensor) and (a.dtype != b.dtype or (a.dim() != b.dim() if st.loose else
                                                                     tuple(a.shape) != tuple(b.shape))):
            return False
    return True


def _same_view(pa: Node, pu: Node, ga: Node, gu: Node, st: _State) -> bool:
    """The read pa of pu and the read ga of gu see the same elements (layout and relative offset)."""
    if pa is pu and ga is gu:
        return True
    lp, lpu, lg, lgu = layout(pa), layout(pu), layout(ga), layout(gu)
    if lp is None or lg is None or lpu is None or lgu is None:
        return pa is pu and ga is gu
    if st.loose:
        st.views[pa] = ga
        return len(lp[0]) == len(lg[0]) and lp[3] == lg[3]
    return (lp[0] == lg[0] and same_strides(lp[0], lp[1], lg[1]) and lp[3] == lg[3]
            and lp[2] - lpu[2] == lg[2] - lgu[2])


def _same_read(pa: Node, ga: Node, st: _State) -> bool:
    """A loose match (`find(loose=True)`): an input read of the same rank and dtype, noted in `st.views`."""
    lp, lg = layout(pa), layout(ga)
    st.views[pa] = ga
    return lp is not None and lg is not None and lp[3] == lg[3] and len(lp[0]) == len(lg[0])


def _finish(pattern: Pattern, st: _State, escapes: list[Escape] | None = None) -> Match | None:
    """Whole-match checks: every input bound, input views consistent, no intermediate escapes (which one
    does is added to `escapes`)."""
    specs = pattern.program["inputs"]
    for k, b in enumerate(st.inputs):
        if b is None:
            return None
        if b.kind == "tensor" and not st.loose and input_offset(specs[k], b) is None:
            return None
        if b.kind == "tensor" and st.loose and not all(_same_read(pa, ga, st) for pa, ga in b.reads):
            return None
    outputs = [st.p2g[o] for o in pattern.outputs]
    inside = set(st.g2p)
    order = {n: i for i, n in enumerate(pattern.graph.nodes)}
    for g in sorted(inside, key=lambda g: order[st.g2p[g]]):  # the first escaping op in P's order
        if g in outputs:
            continue
        if any(u not in inside for u in compute_users(g)) or _feeds_output(g):
            if escapes is not None:
                escapes.append(_escape(pattern, st.g2p[g], g, inside))
            return None
    return Match(dict(st.p2g), st.inputs, outputs, dict(st.views))


def _escape(pattern: Pattern, p: Node, g: Node, inside: set[Node]) -> Escape:
    # Counted as the trace lists them: an element taken from a multi-output op is that op.
    members = set(pattern.compute)
    ops = [n for n in pattern.graph.nodes if n in members and n.target is not operator.getitem]
    if p.target is operator.getitem:
        p = p.args[0]
    readers = [u for u in compute_users(g) if u not in inside and u.op != "output"]
    return Escape(canonical(p) or str(p.target), ops.index(p) + 1 if p in ops else 0, len(ops),
                  returned=_feeds_output(g), reader=(canonical(readers[0]) or str(readers[0].target)) if readers else None)


def _feeds_output(g: Node) -> bool:
    stack = list(g.users)
    while stack:
        u = stack.pop()
        if u.op == "output":
            return True
        if is_transparent(u):
            stack.extend(u.users)
    return False


def input_offset(spec: dict, b: InputBinding) -> int | None:
    """Storage offset in G of program input `spec`, from its reads; None if the reads disagree."""
    off = None
    for pa, ga in b.reads:
        lp, lg = layout(pa), layout(ga)
        if lp is None or lg is None or lp[0] != lg[0] or not same_strides(lp[0], lp[1], lg[1]) or lp[3] != lg[3]:
            return None
        here = lg[2] - (lp[2] - spec.get("storage_offset", 0))
        if off is None:
            off = here
        elif off != here:
            return None
    return off
