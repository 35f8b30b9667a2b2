"""Capture a module's forward as an aten FX graph and rewrite it: dynamo's backend (`Backend`).

`torch.compile(type(m).forward, backend=Backend(specs), dynamic=False)` (made in `forward.py`, the patched
`forward`): dynamo captures the forward (with its guards on shapes, dtypes, devices, strides and module
attributes: a call outside them recompiles, and the new graph is matched afresh), AOTAutograd lowers it to
functional aten ops, and `Backend` rewrites the inference graph; the returned code runs the graph's aten
ops one by one (no TorchInductor), on a GPU replayed from CUDA graphs (`graphs.Graphed`: one launch
instead of one Python call per op). A graph that needs gradients (grad enabled and a parameter or input
requiring grad) is traced to aten ops without AOTAutograd and rewritten with sites that run the fused
forward and its generated backward as one autograd Function (`autograd.py`) where that backward
validated; `Backend.training`; on a GPU its forward and backward replay as two CUDA graphs per layer
(`train_graphs.TrainGraphed`). A match whose ops read an input outside the view its site would be handed
stays unsubstituted in a graph that trains (`rewrite.reads_outside_inputs`).

AOTAutograd's inference graphs are kept across processes (`aot_cache`): a later process capturing the same
dynamo graph rebuilds it instead of lowering it again.

Identical graphs are rewritten and compiled once and shared by every instance that captures them
(`_SHARED`: same plan, same graph code, same input layouts), so a model whose layers each trace pays
AOTAutograd and the rewrite once. What a rewrite did is logged per plan and captured function
(`CaptureLog`, `log_for`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch

from advisor.codegen.cache import load_module
from advisor.errors import exception_reason
from advisor.ops.registry import OpClass, op_class
from advisor.patching import aot_cache, epilogue, resize, rewrite, splade, timing
from advisor.patching.attention_layout import lay_out_attention_inputs
from advisor.patching.gemm_epilogues import fuse_gemm_epilogues
from advisor.patching.causal_masks import fold_causal_masks
from advisor.patching.graphs import Graphed
from advisor.patching.host_copies import constants_on_device, make_host_copies_recordable
from advisor.patching.match import Pattern, SearchTooLong, find, is_transparent
from advisor.patching.noop_copies import drop_identity_copies
from advisor.patching.plan import PatternSpec
from advisor.patching.program import program_graph, run_program
from advisor.patching.train_graphs import TrainGraphed, mutates

READS_OUTSIDE = ("in a graph that trains, not substituted: the ops read an input outside the view the site "
                 "would be handed, whose gradient autograd could not route")
# (plan digest, graph code, input layouts) -> compiled graph, held only while some capture still uses it
# (dynamo's cache, through the globals it installs): a deleted model's graphs, and the CUDA-graph
# recordings inside them, go with it
INDUCTOR_GRAPHS = 2  # inference graphs per capture Inductor compiles (`Backend._inductor_budget_left`)
_SHARED: "weakref.WeakValueDictionary[tuple, Callable]" = weakref.WeakValueDictionary()
_PATTERNS: dict[tuple, Pattern] = {}
_LAUNCHERS: dict[tuple, Callable] = {}


@dataclass
class CaptureLog:
    """What the rewriter did, per pattern key, over every graph captured for one set of patterns."""

    sites: dict = field(default_factory=lambda: defaultdict(list))  # key -> [Site]
    rejected: dict = field(default_factory=lambda: defaultdict(list))  # key -> [reason]
    escapes: dict = field(default_factory=lambda: defaultdict(list))  # key -> [match.Escape]: matches refused
    graphs: int = 0
    errors: list = field(default_factory=list)
    # `optimize(..., inductor=True)`: per inference graph, "compiled" where Inductor compiled it around the sites,
    # else why it runs op by op (`stacked`)
    inductor: list = field(default_factory=list)
    left_to_inductor: set = field(default_factory=set)  # pattern keys Inductor fuses instead (`stacked`)
    layouts: list = field(default_factory=list)  # per graph, attention inputs laid out for SDPA's fused kernels
    epilogues: list = field(default_factory=list)  # per graph, linears run with their activation by cuBLASLt

    def count(self, key: str) -> int:
        return len(self.sites.get(key, []))

    def launches(self) -> dict:
        """{(Site, caller): times its launcher ran for that patched forward}: what `optimize` reads
        before and after its check call (one shared capture serves every layer: each is a caller)."""
        return {(s, c): n for sites in list(self.sites.values()) for s in list(sites) for c, n in s.launches().items()}


_LOGS: dict[tuple, CaptureLog] = defaultdict(CaptureLog)
# Guards `_PATTERNS`, `_LAUNCHERS` and `_LOGS`, which every model's captures share: dynamo compiles one frame at a time,
# but a kernel module is loaded at a site's first launch (`PendingLauncher`) and logs are read by calls, in any
# thread; a pattern built or a module loaded twice at once would leave two objects where one is kept
_TABLES = threading.RLock()


def launched_sites(before: dict, after: dict) -> dict:
    """{pattern key: (site, patched module) pairs whose launcher ran between two `Patched.launches()`
    snapshots}: a pattern substituted once in a capture that ten layers share runs at ten sites."""
    out: dict = {}
    for (site, caller), n in after.items():
        if n > before.get((site, caller), 0):
            out[site.key] = out.get(site.key, 0) + 1
    return out


def log_for(key: tuple) -> CaptureLog:
    """The log of the captures of one function with one set of patterns: key = (function, plan digest)."""
    with _TABLES:
        return _LOGS[key]


def plan_digest(specs: list[PatternSpec]) -> str:
    """The patterns' content, not just their keys: one pattern id covers every width of a model class, and
    two models of one class with different widths must not share a capture matched at the first's sizes."""
    doc = [(s.key, s.shapes(), s.device_type) for s in specs]
    return hashlib.sha1(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def pattern_of(spec: PatternSpec, shape: int, program: dict, device) -> Pattern:
    """`spec`'s pattern at its `shape`-th program (`program`)."""
    return pattern_at(program, device)


def pattern_at(program: dict, device) -> Pattern:
    """A program's pattern, built once per content, device and decomposition state. By content: one pattern id
    covers every size of a model family, and a pattern built from another model's program (its sizes), or
    rebound to other sizes (`resize`), would match other graphs. By state: under the Python dispatcher
    (AOTAutograd's, where the graphs we rewrite come from) BatchNorm traces to
    `_native_batch_norm_legit_no_training`, outside it to `native_batch_norm`; a pattern built in one state
    matches no graph traced in the other."""
    dispatcher = torch._C._dispatch_tls_local_include_set().has(torch._C.DispatchKey.PythonDispatcher)
    digest = hashlib.sha1(json.dumps(program, sort_keys=True, default=str).encode()).hexdigest()
    pkey = (digest, str(device), dispatcher)
    with _TABLES:
        pattern = _PATTERNS.get(pkey)
        if pattern is None:
            with timing.timed("patterns"):
                views: list = []
                pattern = _PATTERNS[pkey] = Pattern.build(program, program_graph(program, device, views), views)
    return pattern


MAX_RESIZED = 8  # sets of new sizes one pattern is tried at in one graph (a layer holds one or two)


# ------------------------------------------------------------------------------------ launchers
def load_launcher(kernel_file: str) -> Callable:
    """`run` from a generated kernel module (cached by path and modification time)."""
    path = os.path.abspath(kernel_file)
    key = (path, os.path.getmtime(path))
    fn = _LAUNCHERS.get(key)
    if fn is None:
        with _TABLES:
            fn = _LAUNCHERS.get(key)
            if fn is None:
                name = "advisor_kernel_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
                with timing.timed("launchers"):
                    fn = _LAUNCHERS[key] = load_module(path, name).run
    return fn


def _launcher(spec: PatternSpec, program: dict, kernel_file: str | None, fallback: Callable) -> Callable:
    if spec.replacement == "subgraph":
        return fallback  # the matched ops themselves: tests the matcher and the substitution
    if spec.replacement == "program":
        return lambda *xs: run_program(program, xs)  # the program replayed: tests input order and views
    if kernels_pending():
        return PendingLauncher(kernel_file)
    return load_launcher(kernel_file)


_PENDING = threading.local()


@contextlib.contextmanager
def pending_kernels():
    """Captures made inside this block (this thread) are made while the kernels are still being generated and
    validated (`workflows/early_capture.py`): their sites load their modules at the first launch
    (`PendingLauncher`), by then final (a kernel's module is rewritten when a validated alternative of it
    measures faster), and nothing else here reads a module."""
    old = kernels_pending()
    _PENDING.on = True
    try:
        yield
    finally:
        _PENDING.on = old


def kernels_pending() -> bool:
    return getattr(_PENDING, "on", False)


class PendingLauncher:
    """A kernel module not final yet: the model is captured while its kernels compile and validate, with
    every site on its original ops (`only(())`) until they have; the module is loaded at the first launch."""

    def __init__(self, kernel_file: str):
        self.kernel_file = kernel_file
        self._run: Callable | None = None

    def __call__(self, *args):
        run = self._run
        if run is None:
            run = self._run = load_launcher(self.kernel_file)  # (two threads at once: `load_launcher` loads it once)
        return run(*args)


# ------------------------------------------------------------------------------------ the backend
class Backend:
    """Dynamo's backend for one patched module instance: AOTAutograd, then `rewrite` on inference graphs."""

    def __init__(self, specs: list[PatternSpec], log: CaptureLog, digest: str, trains: bool = False,
                 inductor: bool | str = False):
        self.specs = specs
        # inference graphs compiled by Inductor around the sites, in this mode (`plan.INDUCTOR_MODES`); False: not
        self.inductor = inductor
        self.inductor_graphs = 0  # of them, compiled or tried (`INDUCTOR_GRAPHS`)
        self.log = log
        self.digest = digest
        self.captures = 0  # graphs dynamo handed us for this instance (first captures and recompiles)
        self.device = torch.device("cpu")  # of the graph being rewritten
        self.trains = trains  # graphs needing grads get sites with a backward (`PatchedForward.trains`)
        self.train_graphs: list[TrainGraphed] = []  # their CUDA-graph replays (GPU)
        # The inference graphs' replays (GPU): a call needing gradients drops their recordings (`PatchedForward`)
        self.inference_graphs: list[Graphed] = []
        self.trains_nothing = False  # a training call through it ran no site fused (its forwards fall back)
        # Inference graphs rewritten: with a site substituted, and without one after some had been (inputs at
        # shapes never profiled: the patterns are made for the profiled ones)
        self.fused_graphs = self.unfused_graphs = 0
        self.graph_keys: set[str] = set()  # `aot_cache` keys of the inference graphs it lowered or rebuilt

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

        self.captures += 1
        timing.count("captures")
        self.log.layouts.extend(lay_out_attention_inputs(gm))  # (before AOTAutograd picks SDPA's backend)
        self.log.epilogues.extend(fuse_gemm_epilogues(gm))  # (inference graphs only: `gemm_epilogues`)
        key = _share_key(self.digest, gm, example_inputs)
        shared = _SHARED.get(key) if key is not None else None
        if shared is not None:
            if isinstance(getattr(shared, "runs", None), TrainGraphed):
                self.train_graphs.append(shared.runs)  # its recordings go when this instance's training falls back
            self.inference_graphs.extend(getattr(shared, "inference_graphs", ()))
            return shared
        made: list[Graphed] = []  # this capture's inference replays, for the instances it is shared with
        stored = aot_cache.key(gm, example_inputs)  # AOTAutograd's output kept across processes: its key

        def plain(g, _):
            return make_boxed_func(g.forward)

        def lowered(g, fakes):  # AOTAutograd's inference graph: kept (before the rewrite changes it), then rewritten
            if aot_cache.store(stored, g, example_inputs):
                self.graph_keys.add(stored)
            return make_boxed_func(inference(g, fakes))

        def inference(g, fakes=None):
            stacked = self.inductor and fakes is not None and self._inductor_budget_left()
            drop_identity_copies(g)  # eval-mode dropout: eager runs no kernel for it, AOTAutograd a copy
            fold_causal_masks(g)  # a causal mask traced from positions: the kernels' own causal masking
            timing.count("rewrites")
            sites = sum(map(len, self.log.sites.values()))
            with timing.timed("rewrite"):
                self.rewrite(g, left_to_inductor=stacked)
            if sum(map(len, self.log.sites.values())) > sites:
                self.fused_graphs += 1
            elif self.fused_graphs:
                self.unfused_graphs += 1
            run = replayed(g, self.device, self._stacked(g, fakes) if stacked else None)
            if isinstance(run, Graphed):
                made.append(run)
                self.inference_graphs.append(run)
            return _counted(run)

        compiled = None
        needs_grad = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                                     for x in example_inputs)
        if self.trains and needs_grad:
            compiled = self.training(gm, example_inputs)
        if compiled is None and not needs_grad and not self.inductor:  # (Inductor compiles from AOTAutograd's inputs)
            cached = aot_cache.lookup(stored)  # lowered in an earlier process: AOTAutograd is not run again
            if cached is not None:
                timing.count("aot cache hits")
                self.graph_keys.add(stored)
                # In the state AOTAutograd calls its compilers in (its fake mode on, the Python dispatcher too): the
                # patterns built for this graph (`program_graph`) decompose as they do there (BatchNorm to
                # `_native_batch_norm_legit_no_training`, not `native_batch_norm`: no conv epilogue matched)
                from torch._dispatch.python import enable_python_dispatcher

                with cached.meta["fake_mode"], enable_python_dispatcher():
                    compiled = inference(cached)
        if compiled is None:
            compiled = aot_module_simplified(gm, example_inputs, fw_compiler=plain, bw_compiler=plain,
                                             inference_compiler=lowered)
        with contextlib.suppress(AttributeError):  # (a callable that takes no attribute: not shared either)
            compiled.inference_graphs = made
        if key is not None:
            with contextlib.suppress(TypeError):  # a callable that takes no weak reference is not shared
                _SHARED[key] = compiled
        return compiled

    def training(self, gm: torch.fx.GraphModule, example_inputs) -> Callable | None:
        """A graph that needs gradients: traced to aten ops (not through AOTAutograd, which would split it
        into forward and backward graphs and differentiate our sites' original ops), rewritten, and run
        op by op under autograd: each site runs the fused Function (generated backward) where one
        validated, its original ops elsewhere, and autograd differentiates every other op as eager does.
        None (AOTAutograd's path, eager's ops) when the graph does not trace."""
        from torch._guards import detect_fake_mode  # tracing internals: loaded when a graph needs grads
        from torch.fx.experimental.proxy_tensor import make_fx

        try:
            # In dynamo's own fake mode: a fresh one (tracing_mode="fake") adds size symbols to a shape
            # environment dynamo then fails to build its guards from.
            mode = detect_fake_mode(example_inputs)
            with mode:
                fakes = [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x
                         for x in example_inputs]
                g = make_fx(gm, tracing_mode="real")(*fakes)
            # Unused outputs (native_layer_norm's mean and rstd) stay as nodes; patterns never hold them.
            g.graph.eliminate_dead_code()
            fold_causal_masks(g)
        except Exception as e:
            self.log.errors.append(f"training graph not traced: {exception_reason(e)}")
            return None
        timing.count("rewrites")
        with timing.timed("rewrite"):
            self.rewrite(g, training=True)
        run = g.forward
        if self.device.type == "cuda" and not mutates(g.graph):  # forward and backward replayed as CUDA graphs
            make_host_copies_recordable(g)
            run = TrainGraphed(g.forward, ops=_ops(g.graph), out_bytes=_output_bytes(g.graph))
            self.train_graphs.append(run)
        return _counted(run)

    def _stacked(self, g: torch.fx.GraphModule, fakes) -> Callable | None:
        """`g` (rewritten) compiled by Inductor around its sites, or None (it runs op by op; the log says why)."""
        from advisor.patching import stacked  # Inductor: loaded only when asked for

        why = stacked.with_site_ops(g) if fakes is not None else "no example inputs (a graph from the AOT cache)"
        if why is None:
            if self.device.type == "cuda":  # before Inductor reads the graph: its code is what gets recorded
                constants_on_device(g)
                make_host_copies_recordable(g)
            try:
                with timing.timed("inductor"):
                    run = stacked.inductor_compiled(g, fakes, self.inductor)
                self.log.inductor.append("compiled")
                return run
            except Exception as e:  # never break the capture: the graph runs op by op, its sites as they are
                why = f"Inductor failed: {exception_reason(e)}"
        self.log.inductor.append(why)
        with timing.timed("rewrite"):
            self.rewrite(g)  # the patterns left to Inductor are ours after all: op by op, they would run unfused
        return None

    def _inductor_budget_left(self) -> bool:
        """Whether Inductor may compile one more inference graph of this capture: the shapes `optimize` met (and
        one more), not every shape the user's loop meets later, each of which would cost seconds of compile
        in that loop (a `generate` meets a new one every step). Later graphs take our route, our kernels in."""
        if self.inductor_graphs < INDUCTOR_GRAPHS:
            self.inductor_graphs += 1
            return True
        self.log.inductor.append(f"our route: Inductor had compiled {INDUCTOR_GRAPHS} graphs of this capture")
        return False

    def rewrite(self, gm: torch.fx.GraphModule, training: bool = False, left_to_inductor: bool = False) -> None:
        """Substitute every pattern's matches in `gm` (a graph that trains: only those autograd can
        differentiate through, `rewrite.reads_outside_inputs`); `left_to_inductor`: not the patterns Inductor,
        compiling this graph, fuses itself (`stacked.left_to_inductor`)."""
        self.log.graphs += 1
        device = self.device = _graph_device(gm.graph)
        for spec in self.specs:
            if left_to_inductor and not training and _left_to_inductor(spec):
                self.log.left_to_inductor.add(spec.key)
                continue
            saved: list = []  # the graph before this pattern's first substitution (finding one changes nothing)

            def keep(saved=saved):
                if not saved:
                    with timing.timed("copy+lint"):
                        saved.append(_copy_graph(gm.graph))

            try:
                self._rewrite_one(gm, spec, device, keep, training)
                if saved:
                    with timing.timed("copy+lint"):
                        gm.graph.lint()
            except Exception as e:  # never break the capture: this pattern just stays unpatched here
                if saved:
                    gm.graph = saved[0]
                self.log.sites.pop(spec.key, None)
                self.log.errors.append(f"{spec.candidate} {spec.title}: {type(e).__name__}: {e}")
                self.log.rejected[spec.key].append(f"matcher error: {type(e).__name__}: {e}")
        with timing.timed("recompile"):
            gm.recompile()

    def _rewrite_one(self, gm, spec: PatternSpec, device, keep: Callable[[], None] = lambda: None,
                     training: bool = False) -> None:
        """Substitute every match of one pattern, at each of its shapes (a kernel per shape), and in an inference
        graph at sizes never profiled where its kernel serves them (`resize`); `keep()` runs before each
        substitution (the caller keeps the graph as it was before the first, to put back should one fail)."""
        before = self.log.count(spec.key)
        escapes: list = []
        for shape, (program, kernel_file) in enumerate(spec.shapes()):
            self._substitute_all(gm, spec, program, kernel_file, pattern_of(spec, shape, program, device), keep,
                                 training, escapes)
        if not training and self.log.count(spec.key) == before and resize.resizable(spec.program):
            self._substitute_resized(gm, spec, device, keep, escapes)
        logged = self.log.escapes[spec.key]
        logged.extend(e for e in dict.fromkeys(escapes) if e not in logged)  # each find meets them again

    def _substitute_all(self, gm, spec: PatternSpec, program: dict, kernel_file: str | None, pattern: Pattern,
                        keep: Callable[[], None], training: bool, escapes: list) -> set:
        """Substitute every exact match of `pattern` (the program at one set of sizes); returns the graph nodes
        of the matches left in place (refused)."""
        exclude: set = set()
        while True:
            try:
                with timing.timed("find"):
                    m = find(pattern, gm.graph, exclude, escapes)
            except SearchTooLong as e:  # the sites found so far stay; the rest of this graph is not searched
                self.log.rejected[spec.key].append(str(e))
                break
            if m is None:
                break
            if training and rewrite.reads_outside_inputs(m, program["inputs"]):
                result = READS_OUTSIDE  # its original ops stay: autograd differentiates them
            else:
                keep()
                with timing.timed("substitute"):
                    result = rewrite.substitute(gm.graph, m, pattern, lambda m: self._site(spec, m, program, kernel_file))
            if isinstance(result, str):
                exclude |= m.g_nodes()
                self.log.rejected[spec.key].append(result)
            else:
                self.log.sites[spec.key].append(result)
        return exclude

    def _substitute_resized(self, gm, spec: PatternSpec, device, keep: Callable[[], None], escapes: list) -> None:
        """The pattern at the graph's own sizes: each place a loose match finds it (`resize`) is matched exactly,
        by the program rewritten at that place's layouts, with the kernel made at the profiled ones."""
        loose = pattern_of(spec, 0, spec.program, device)
        seen: set = set()  # graph nodes of the places tried
        for _ in range(MAX_RESIZED):
            try:
                with timing.timed("find"):
                    m = find(loose, gm.graph, seen, loose=True)
            except SearchTooLong as e:
                self.log.rejected[spec.key].append(str(e))
                return
            if m is None:
                return
            seen |= m.g_nodes()
            program = resize.rebind(spec.program, loose, m)
            if program is not None:
                pattern = pattern_at(program, device)
                seen |= self._substitute_all(gm, spec, program, spec.kernel_file, pattern, keep, False, escapes)


    def _site(self, spec: PatternSpec, m, program: dict, kernel_file: str | None) -> rewrite.Site:
        fallback = rewrite.make_fallback(m, program["inputs"])
        site = rewrite.Site(key=spec.key, label=f"{spec.candidate} {spec.title}",
                            launcher=_launcher(spec, program, kernel_file, fallback),
                            fallback=fallback, inputs=[rewrite.InputSpec.of(s) for s in program["inputs"]],
                            outputs=rewrite.output_layouts(m), handed_back=rewrite.handed_back(m),
                            device_type=spec.device_type, writes=tuple(sorted(rewrite.written_inputs(program))),
                            scalar_device=self.device if spec.replacement == "kernel" else "cpu")
        if differentiable(spec):
            site.trainable = site.forward  # PyTorch's own ops: autograd differentiates the launcher itself
        elif trainable(spec):
            from advisor.patching.autograd import Trainable  # torch.autograd machinery: loaded for training only

            roles = splade.head_roles(program)
            parts = None if roles else epilogue.split(program)
            if roles:
                site.trainable = splade.SpladeTrainable(program, roles, site.label)
            elif parts:
                site.trainable = epilogue.EpilogueTrainable(parts, site.label, _outputs_kept_intact(m))
            else:
                site.trainable = Trainable(program, site.forward, site.launch, _outputs_kept_intact(m), site.label,
                                           fallback)
        return site


def _left_to_inductor(spec: PatternSpec) -> bool:
    from advisor.patching import stacked  # Inductor's custom op: registered only where asked for

    return stacked.left_to_inductor(spec)


def _outputs_kept_intact(m) -> bool:
    """Whether the backward may keep the site's outputs (instead of recomputing them): every use of each,
    through views, stays inside this graph and none writes into it (autograd would refuse the saved
    tensor at backward time, after an in-place write by the caller or by a later op)."""
    inside = m.g_nodes()
    stack = [u for o in m.outputs for u in o.users]
    while stack:
        u = stack.pop()
        if u in inside:
            continue
        if u.op == "output":
            return False
        target = getattr(u.target, "_schema", None)
        if target is not None and any(a.alias_info is not None and a.alias_info.is_write for a in target.arguments):
            return False
        if is_transparent(u):
            stack.extend(u.users)
    return True


def trainable(spec: PatternSpec) -> bool:
    """Whether a pattern may get a generated backward: a generated kernel of pointwise and row ops (the
    stand-in replacements stay bit-identical to eager, gradients included), a matmul with a pointwise
    epilogue (the matmul by PyTorch, the epilogue generated apart: `epilogue.py`), or the SPLADE head's
    matmul + reduction, which trains through its hand-written Function (`splade.py`), or a module autograd
    differentiates itself (`differentiable`). Whether a generated backward is used is decided per site, by
    validation and timing."""
    if spec.replacement == "kernel" and (splade.head_roles(spec.program) is not None
                                         or epilogue.split(spec.program) is not None):
        return True
    return spec.replacement == "kernel" and bool(spec.program.get("nodes")) and not any(
        op_class(n["op"]) in (OpClass.MATMUL, OpClass.ATTENTION) for n in spec.program["nodes"]) or differentiable(spec)


def differentiable(spec: PatternSpec) -> bool:
    """Whether the pattern's module is PyTorch's own ops (it says `DIFFERENTIABLE`: a padded GEMM), which
    autograd differentiates as they stand: no backward to derive or validate, the forward validated."""
    if spec.replacement != "kernel" or not spec.kernel_file or kernels_pending():
        return False  # (pending: asked again once the modules are written, `PatchedForward.kernels_written`)
    try:
        return bool(getattr(load_launcher(spec.kernel_file), "__globals__", {}).get("DIFFERENTIABLE"))
    except Exception:  # a missing or broken module: the forward's own loading says so
        return False


def _share_key(digest: str, gm: torch.fx.GraphModule, example_inputs) -> tuple | None:
    """What makes two dynamo graphs interchangeable: the plan, the code, every input's layout and grad
    flag, the grad mode. Graphs holding constants (`get_attr`) are never shared: their values are not in the code."""
    if any(n.op == "get_attr" for n in gm.graph.nodes):
        return None
    metas = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            metas.append((tuple(x.shape), tuple(x.stride()), x.dtype, x.device.type, x.requires_grad))
        elif isinstance(x, (int, float, bool, str, type(None))):
            metas.append(("v", type(x).__name__, x))
        else:
            return None  # symbolic values and other objects: not worth reasoning about
    # Grad mode too: dynamo recompiles on it, and an inference graph handed to a call that needs grads
    # would return outputs without a grad_fn.
    return (digest, gm.code, tuple(metas), torch.is_grad_enabled())


_RAN = threading.local()  # counts rewritten graphs run in this thread: did a call take the patched path?


def graphs_run() -> int:
    return getattr(_RAN, "n", 0)


def replayed(g: torch.fx.GraphModule, device: torch.device, compiled: Callable | None = None) -> Callable:
    """A rewritten inference graph's forward as it runs (`compiled`: Inductor's code for it, else op by op):
    replayed from CUDA graphs on a GPU (`Graphed`), as it is elsewhere."""
    if device.type != "cuda":
        return compiled or g.forward
    if compiled is None:  # (Inductor's graph was made recordable before it compiled it: `_stacked`)
        make_host_copies_recordable(g)
    return Graphed(compiled or g.forward, ops=None if compiled else _ops(g.graph), out_bytes=_output_bytes(g.graph))


def _counted(fn: Callable) -> Callable:
    def run(*args):
        _RAN.n = getattr(_RAN, "n", 0) + 1
        return fn(*args)
    run.runs = fn  # what it runs (a backend handed this capture shared finds its training graphs here)
    return run


def _copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    new = torch.fx.Graph(owning_module=graph.owning_module)
    out = new.graph_copy(graph, {}, return_output_node=True)
    new.output(out[0] if isinstance(out, tuple) else out)
    return new


def _ops(graph: torch.fx.Graph) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function")


def _output_bytes(graph: torch.fx.Graph) -> int:
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    vals = [a.meta.get("val") for a in out.all_input_nodes]
    return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def _graph_device(graph: torch.fx.Graph) -> torch.device:
    for n in graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.device.type != "meta":
            return v.device
    return torch.device("cpu")
