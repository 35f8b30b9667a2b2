"""Substitute a match: the matched nodes become one call to a `Site`, which runs the launcher.

The site takes the program's inputs in the program's order, each laid out as the program describes
it (shape, strides, dtype): the tensor is an existing view node of G when one has exactly that
layout, else an `as_strided` of the source tensor at the offset the reads imply. Wrapped scalars are
passed as the literal G holds (a Python number; eager would have wrapped it the same way).

A site runs the generated launcher only when its guard holds (dtype, device type, shape and strides
of every input as validated, the pattern enabled); under autograd (an input requiring grad) it runs
the fused forward + generated backward (`trainable`) where one validated; otherwise, or if the
launcher fails or returns something else than the program's outputs, it runs `fallback`: the
original matched ops, replayed on the same inputs (each read re-created as the same view), so the
result is bit for bit what the unpatched graph computes.
"""
from __future__ import annotations

import contextlib
import math

import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.fx import Graph, Node

from advisor.errors import exception_reason
from advisor.graph.dtypes import torch_dtype
from advisor.ops.registry import OpClass, op_class
from advisor.patching.match import Match, Pattern, compute_users, input_offset, is_transparent, layout, \
    same_strides, strip, val
from advisor.patching.program import is_scalar_slot

# Which patterns run their launcher: None = all; a set of pattern keys = only those (the rest fall
# back). `off` bypasses patched forwards entirely (see forward.PatchedForward).
_RUNTIME = threading.local()


def enabled_keys():
    return getattr(_RUNTIME, "enabled", None)


def set_enabled(keys) -> Any:
    old = enabled_keys()
    _RUNTIME.enabled = None if keys is None else frozenset(keys)
    return old


def set_caller(token) -> Any:
    """Which patched forward is running (sites count their launches per caller: one shared capture
    serves every layer of a model)."""
    old = getattr(_RUNTIME, "caller", None)
    _RUNTIME.caller = token
    return old


@contextlib.contextmanager
def recording_sites():
    """Inside this block (a CUDA graph's recording), the sites whose kernels the recording captured are listed:
    a replay runs no Python, so `credit` counts them for it (what `counted` and `launches()` read)."""
    old = getattr(_RUNTIME, "recorded", None)
    _RUNTIME.recorded = sites = {}
    try:
        yield sites
    finally:
        _RUNTIME.recorded = old


def credit(sites) -> None:
    """A replay ran these sites' kernels: counted as their launches, for the patched forward running now."""
    caller = getattr(_RUNTIME, "caller", None)
    for site in sites:
        site.count("launched", caller)


# Sites' counters: one site serves every thread calling its model (and every layer sharing its capture), and a
# count read while another thread adds a caller would fail (a dict changing size while iterated) or lose one
_COUNTS = threading.Lock()


def outer_override() -> bool | None:
    """Whether outer captures run (True/False) inside a `whole` block; None: each as selection set it."""
    return getattr(_RUNTIME, "outer", None)


def set_outer(on: bool | None) -> bool | None:
    old = outer_override()
    _RUNTIME.outer = on
    return old


def fused_runs() -> int:
    """Site calls in this thread that ran a fused forward with its generated backward (under autograd)."""
    return getattr(_RUNTIME, "fused", 0)


def count_fused_runs(n: int) -> None:
    """`n` more fused runs (sites replayed inside a recorded training graph, `train_graphs`)."""
    _RUNTIME.fused = fused_runs() + n


@contextlib.contextmanager
def thread_flag(local: threading.local, name: str, value):
    """`local.name` is `value` inside the block, as it was (unset: None) after it."""
    old = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, old)


def recording_replayed_graph():
    """Inside: the ops run are being made ready to be replayed from a CUDA graph (a layer's training graph,
    `train_graphs`), so what a site costs there is GPU time alone, not the host's (`autograd.time_both`)."""
    return thread_flag(_RUNTIME, "replayed", True)


def in_replayed_graph() -> bool:
    return bool(getattr(_RUNTIME, "replayed", False))


def patches_are_off() -> bool:
    return getattr(_RUNTIME, "off", False)


def set_off(off: bool) -> bool:
    old = patches_are_off()
    _RUNTIME.off = off
    return old


@dataclass
class InputSpec:
    scalar: bool
    dtype: torch.dtype | None = None
    shape: tuple = ()
    strides: tuple = ()

    @classmethod
    def of(cls, spec: dict) -> "InputSpec":
        if is_scalar_slot(spec):
            return cls(True)
        return cls(False, torch_dtype(spec["dtype"]), tuple(spec["shape"]), tuple(spec["strides"]))

    def accepts(self, x, device_type: str | None) -> bool:
        if self.scalar:
            return isinstance(x, (int, float)) or (isinstance(x, torch.Tensor) and x.dim() == 0)
        return (isinstance(x, torch.Tensor) and x.dtype == self.dtype and tuple(x.shape) == self.shape
                and same_strides(self.shape, self.strides, x.stride())
                and (device_type is None or x.device.type == device_type))


@dataclass(eq=False)  # identity semantics: FX keys call targets by them
class Site:
    """One substituted occurrence. Called from the rewritten graph with the program's inputs."""

    key: str  # pattern key (what `enabled_keys` selects)
    label: str
    launcher: Callable
    fallback: Callable
    inputs: list[InputSpec]
    outputs: list[tuple]  # (shape, strides, dtype) the graph expects of each output
    device_type: str | None  # what the kernel was validated on; None = any
    scalar_device: torch.device | str = "cpu"  # where launchers get wrapped scalars (as 0-dim tensors)
    # Per output: the views the graph takes of it on the way out, or None where an op of the graph reads
    # it (`handed_back`): an output only handed back may keep the launcher's layout (the padded GEMM's
    # strided view, as torch.compile returns it) instead of being copied into the traced one.
    handed_back: tuple = ()
    stats: dict = field(default_factory=lambda: {"launched": 0, "fell_back": 0})
    callers: dict = field(default_factory=dict)  # caller token (see `set_caller`) -> launches
    broken: str | None = None
    # Under autograd: (inputs) -> outputs through the fused Function, or None where no validated
    # backward exists (`advisor.patching.autograd.Trainable`); None here: the original ops always.
    trainable: Callable | None = None
    writes: tuple = ()  # indices of the inputs its kernel writes in place (`written_inputs`)
    _scalars: dict = field(default_factory=dict)

    @property
    def __name__(self) -> str:  # FX names the call node after its target
        return "fused_" + self.key.split(":", 1)[0]

    def __call__(self, *xs):
        keys = enabled_keys()
        if self.broken is None and (keys is None or self.key in keys) and self._guard(xs):
            grad = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)
            if grad and self.trainable is None:
                self.count("fell_back")
                return self.fallback(*xs)  # autograd differentiates the original ops
            try:
                outs = self.trainable(xs) if grad else self._check(self.launcher(*self._launch_args(xs)))
                if outs is None:  # no validated backward for these inputs
                    self.count("fell_back")
                    return self.fallback(*xs)
                if grad:
                    count_fused_runs(1)
                self.count("launched", getattr(_RUNTIME, "caller", None))
                recorded = getattr(_RUNTIME, "recorded", None)
                if recorded is not None:  # (its warm-up and its capture both list it: one site each)
                    recorded[self] = None
                return outs
            except Exception as e:  # a launcher that fails must not take the model down with it
                if _capturing():
                    raise  # fails the CUDA graph's recording (the forward then runs op by op), not the launcher
                self.broken = exception_reason(e)
                warnings.warn(f"fusion-advisor: {self.label}: launcher failed ({self.broken}); "
                              "running the original ops from now on", RuntimeWarning, stacklevel=2)
        self.count("fell_back")
        return self.fallback(*xs)

    def count(self, what: str, caller=None) -> None:
        """One more `what` ("launched": for `caller` too, the patched forward running it; "fell_back")."""
        with _COUNTS:
            self.stats[what] += 1
            if what == "launched":
                self.callers[caller] = self.callers.get(caller, 0) + 1

    def launches(self) -> dict:
        """{caller: launches} as counted now."""
        with _COUNTS:
            return dict(self.callers)

    def _launch_args(self, xs) -> list:
        """Launchers take every program input as a tensor: wrapped scalars become cached 0-dim tensors."""
        out = list(xs)
        for k, (x, spec) in enumerate(zip(xs, self.inputs)):
            if spec.scalar and not isinstance(x, torch.Tensor):
                t = self._scalars.get((k, x))
                if t is None:
                    dtype = torch.int64 if isinstance(x, int) else torch.float64
                    t = self._scalars[(k, x)] = torch.tensor(x, dtype=dtype, device=self.scalar_device)
                out[k] = t
        return out

    def _guard(self, xs) -> bool:
        if len(xs) != len(self.inputs):
            return False
        return all(spec.accepts(x, self.device_type) for x, spec in zip(xs, self.inputs))

    def launch(self, xs) -> tuple:
        return self.launcher(*self._launch_args(xs))

    def forward(self, xs) -> tuple:
        """The launcher as the fused Function's forward (same argument handling and output checks)."""
        return self._check(self.launch(xs))

    def _check(self, outs) -> tuple:
        outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
        if len(outs) != len(self.outputs):
            raise RuntimeError(f"launcher returned {len(outs)} outputs, the program has {len(self.outputs)}")
        fixed = []
        back = self.handed_back or (None,) * len(outs)
        for o, (shape, strides, dtype), paths in zip(outs, self.outputs, back):
            if isinstance(o, torch.Tensor) and tuple(o.shape) != shape and o.dtype == dtype \
                    and o.numel() == math.prod(shape):
                # The graph holds the output flattened (AOTAutograd decomposes a 4-d matmul into a 3-d bmm
                # between views): the same elements in the same row-major order.
                o = o.reshape(shape)
            if not isinstance(o, torch.Tensor) or tuple(o.shape) != shape or o.dtype != dtype:
                got = f"{tuple(o.shape)} {o.dtype}" if isinstance(o, torch.Tensor) else type(o).__name__
                raise RuntimeError(f"launcher output is {got}, expected {shape} {dtype}")
            if not same_strides(shape, strides, o.stride()) and (paths is None or not views_accept(o, paths)):
                # Later views in the graph were recorded for the original layout: restore it.
                o = torch.empty_strided(shape, strides, dtype=dtype, device=o.device).copy_(o)
            fixed.append(o)
        return tuple(fixed)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def make_fallback(match: Match, specs: list[dict]) -> Callable:
    """The matched G ops as a function of the program's inputs (same ops, same literals, same views)."""
    pos = _position(next(iter(match.nodes.values())).graph)
    order = sorted(match.nodes.values(), key=pos.__getitem__)
    idx = {g: i for i, g in enumerate(order)}
    reads: dict[Node, tuple[int, int]] = {}  # G read node -> (input index, offset relative to the input)
    for k, b in enumerate(match.inputs):
        if b.kind == "tensor":
            base = input_offset(specs[k], b)
            for _, ga in b.reads:
                reads[ga] = (k, layout(ga)[2] - base)
    node_inputs = {b.root: k for k, b in enumerate(match.inputs) if b.kind == "node"}
    plan = lambda a: _plan_args(a, reads, node_inputs, idx)  # noqa: E731
    steps = [(g.target, plan(g.args), plan(g.kwargs)) for g in order]
    outputs = [idx[o] for o in match.outputs]

    def fallback(*xs):
        env: list = []
        for target, args, kwargs in steps:
            env.append(target(*_resolve(args, xs, env), **_resolve(kwargs, xs, env)))
        return tuple(env[i] for i in outputs)

    return fallback


def reads_outside_inputs(match: Match, specs: list[dict]) -> bool:
    """Whether the matched ops read some input outside the view the site is handed (a kernel may: it reads
    memory; HF's partial rotary can bind its input to the pass-through half and read the rotated half
    before it). Autograd cannot give those elements their gradient through the site's input, so such a
    match must stay unsubstituted in a graph that trains."""
    for k, b in enumerate(match.inputs):
        if b.kind != "tensor":
            continue
        base = input_offset(specs[k], b)
        shape, strides = tuple(specs[k]["shape"]), tuple(specs[k]["strides"])
        for _, ga in b.reads:
            read = layout(ga)
            if read is None or not view_inside(read[0], read[1], read[2] - base, shape, strides):
                return True
    return False


def view_inside(shape, strides, rel: int, in_shape, in_strides) -> bool:
    """Whether a view (shape, strides) starting `rel` elements after an input view's first element reads only
    elements of that input view. Sufficient, not necessary. The input's dimensions are coalesced where they
    nest (a flattened read of a contiguous block walks one line); `rel` splits into start indices, largest
    stride first; each dimension the view walks must step along one input dimension by a whole multiple of
    its stride (slices, strided slices, flattenings), and the furthest index it reaches along each input
    dimension must stay inside it: then no read carries into another dimension, or past the view."""
    if rel < 0:
        return False
    dims: list = []  # the input's (stride, size), largest stride first, nested dimensions merged
    for st, n in sorted(((st, n) for n, st in zip(in_shape, in_strides) if n > 1), reverse=True):
        if st <= 0 or (dims and dims[-1][0] == st):
            return False  # broadcast or overlapping input: not decomposed
        if dims and dims[-1][0] == st * n:
            dims[-1] = (st, dims[-1][1] * n)
        else:
            dims.append((st, n))
    reach = []  # per input dimension: [start index, furthest index read]
    for st, _ in dims:
        start, rel = divmod(rel, st)
        reach.append([start, start])
    if rel:
        return False
    for n, st in zip(shape, strides):
        if n == 1 or st == 0:
            continue  # a dimension that does not move (or a broadcast: the same elements again)
        d = next((k for k, (ist, _) in enumerate(dims) if ist <= st), None)
        if st < 0 or d is None or st % dims[d][0]:
            return False
        reach[d][1] += (n - 1) * (st // dims[d][0])
    return all(last < size for (_, size), (_, last) in zip(dims, reach))


def _resolve(spec, xs, env):
    kind = spec[0]
    if kind == "lit":
        return spec[1]
    if kind == "in":
        return xs[spec[1]]
    if kind in ("read", "node"):  # a view of input k / of an earlier matched op's output
        _, i, shape, strides, rel = spec
        t = xs[i] if kind == "read" else env[i]
        if shape is None or (tuple(t.shape) == shape and t.stride() == strides and rel == 0):
            return t
        return t.as_strided(shape, strides, t.storage_offset() + rel)
    if kind == "list":
        return [_resolve(s, xs, env) for s in spec[1]]
    if kind == "tuple":
        return tuple(_resolve(s, xs, env) for s in spec[1])
    return {k: _resolve(s, xs, env) for k, s in spec[1].items()}


def _plan_args(a, reads, node_inputs, idx):
    if isinstance(a, Node):
        if a in reads:
            k, rel = reads[a]
            la = layout(a)
            return ("read", k, la[0], la[1], rel)
        if a in node_inputs:
            return ("in", node_inputs[a])
        src = strip(a)
        la, ls = layout(a), layout(src)
        if a is src or la is None or ls is None:
            return ("node", idx[src], None, None, 0)
        return ("node", idx[src], la[0], la[1], la[2] - ls[2])
    if isinstance(a, (list, tuple)):
        return ("list" if isinstance(a, list) else "tuple", [_plan_args(x, reads, node_inputs, idx) for x in a])
    if isinstance(a, dict):
        return ("dict", {k: _plan_args(v, reads, node_inputs, idx) for k, v in a.items()})
    return ("lit", a)


def _position(graph: Graph) -> dict[Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def substitute(graph: Graph, match: Match, pattern: Pattern, make_site: Callable[[Match], Site]) -> Site | str:
    """Replace the match by a site call. Returns the Site, or why the match cannot be substituted."""
    specs = pattern.program["inputs"]
    pos = _position(graph)
    inside = match.g_nodes()
    for k in written_inputs(pattern.program):
        b = match.inputs[k]
        if b is not None and b.kind != "literal" and _external_users(b.root, inside):
            # The kernel writes this input where the program wrote it in place; the graph (functional: the
            # write is an output AOTAutograd copies back after it) still reads it elsewhere, and would read
            # the written values (a module that reads x, then updates it with x.mul_().add_(), computed
            # from the updated x).
            return f"its kernel writes input {k} in place, which other ops of the graph read"
    external = [u for o in match.outputs for u in _external_users(o, inside)]
    first_use = min((pos[u] for u in external), default=len(pos))
    args: list[Any] = []
    new_views = []  # (input index, source node, offset): inputs no node of G holds with the right layout
    last = None  # the latest node an input needs
    for k, b in enumerate(match.inputs):
        if b.kind == "literal":
            args.append(b.value)
            continue
        t = b.root if b.kind == "node" else _existing_view(b, specs[k], input_offset(specs[k], b))
        if t is None:
            new_views.append((k, b.root, input_offset(specs[k], b)))
            t = b.root
        args.append(t)
        if last is None or pos[t] > pos[last]:
            last = t
    if last is None:
        return "the program has no tensor input"
    if pos[last] >= first_use:
        return "cannot place the fused call: an input is computed after a use of an output"
    site = make_site(match)
    for k, root, off in new_views:
        with graph.inserting_after(last):
            s = specs[k]
            v = graph.call_function(torch.ops.aten.as_strided.default,
                                    (root, list(s["shape"]), list(s["strides"]), off))
        v.meta["val"] = _fake_view(root, s, off)
        args[k] = last = v
    with graph.inserting_after(last):
        call = graph.call_function(site, tuple(args))
    call.meta["val"] = tuple(val(o) for o in match.outputs)
    prev = call
    for i, o in enumerate(match.outputs):
        with graph.inserting_after(prev):
            item = graph.call_function(_item, (call, i))
        item.meta["val"] = val(o)
        o.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
        prev = item
    _erase_dead(graph, inside)
    return site


def written_inputs(program: dict) -> set[int]:
    """Indices of the program inputs its in-place ops write (through views and chains of in-place ops): the
    generated kernel writes them too (`codegen.read`: an in-place op's output is a view of its target)."""
    index = {s["id"]: k for k, s in enumerate(program["inputs"])}
    target: dict = {}  # value id -> the input index it is (a view of), where known
    out = set()
    for n in program["nodes"]:
        first = next((a.get("ref") for a in n.get("args", []) if isinstance(a, dict) and "ref" in a), None)
        src = index.get(first, target.get(first))
        if n.get("inplace") and src is not None:
            out.add(src)
        for o in n.get("outputs", []):
            if src is not None and (n.get("inplace") or _is_view(n.get("op"))):
                target[o["id"]] = src
    return out


def _is_view(op) -> bool:
    return bool(op) and op_class(op) == OpClass.VIEW


def _erase_dead(graph: Graph, nodes: set[Node]) -> None:
    """Erase the replaced nodes, and the views between them that nothing reads any more."""
    todo = set(nodes)
    while todo:
        dead = [n for n in todo if not n.users]
        if not dead:
            break
        for n in dead:
            todo.discard(n)
            preds = [a for a in n.all_input_nodes if a in nodes or is_transparent(a)]
            graph.erase_node(n)
            todo.update(p for p in preds if p.op == "call_function")


def _item(t, i):  # a named function: shows as `_item(site, 0)` in printed graphs
    return t[i]


def _external_users(g: Node, inside: set[Node]) -> list[Node]:
    out, stack = [], list(g.users)
    while stack:
        u = stack.pop()
        if u in inside:
            continue
        if is_transparent(u) and all(x in inside or is_transparent(x) for x in compute_users(u)) and not any(
                x.op == "output" for x in u.users):
            stack.extend(u.users)
            continue
        out.append(u)
    return out


def _existing_view(b, spec: dict, off: int) -> Node | None:
    """A node on the reads' view chains already laid out as the program's input."""
    want = (tuple(spec["shape"]), tuple(spec["strides"]))
    for _, ga in b.reads:
        n = ga
        while True:
            lay = layout(n)
            if lay is not None and lay[0] == want[0] and same_strides(lay[0], want[1], lay[1]) and lay[2] == off:
                return n
            if n is b.root or not is_transparent(n):
                break
            n = n.args[0]
    return None


def _fake_view(root: Node, spec: dict, off: int):
    v = val(root)
    if isinstance(v, torch.Tensor):
        try:
            return v.as_strided(spec["shape"], spec["strides"], off)
        except Exception:
            return None
    return None


VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default}


def handed_back(match: Match) -> tuple:
    """Per output of the match: None where an op of the graph reads it, else the shapes of the views the
    graph takes of it on the way to its output (each path one tuple of shapes; `()` for none: AOTAutograd
    flattens a linear's product to 2-d and views it back). Such an output may reach the caller in the
    launcher's layout, when those views accept it (`views_accept`); any other keeps the layout the
    graph's later ops were traced with."""
    inside = match.g_nodes()

    def paths(node, shapes: tuple):
        out = []
        for u in node.users:
            if u in inside:
                continue
            if u.op == "output":
                out.append(shapes)
            elif u.op == "call_function" and u.target in VIEWS and u.args[0] is node and len(u.args) == 2 \
                    and all(type(d) is int for d in u.args[1]):
                sub = paths(u, shapes + (tuple(u.args[1]),))
                if sub is None:
                    return None
                out += sub
            else:
                return None
        return tuple(out)

    return tuple(paths(o, ()) for o in match.outputs)


def views_accept(t: torch.Tensor, paths: tuple) -> bool:
    """Whether every chain of views in `paths` can be taken of t as it is laid out (no copy)."""
    try:
        for shapes in paths:
            v = t
            for shape in shapes:
                v = v.view(shape)
    except RuntimeError:  # a view merging dims t's strides keep apart
        return False
    return True


def output_layouts(match: Match) -> list[tuple]:
    out = []
    for o in match.outputs:
        lay = layout(o)
        out.append((lay[0], lay[1], lay[3]))
    return out


