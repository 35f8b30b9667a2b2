"""Capture a module's forward as an aten FX graph and rewrite it; the patched `forward`.

`torch.compile(type(m).forward, backend=Backend(specs), dynamic=False)`: dynamo captures the forward
(with its guards on shapes, dtypes, devices, strides and module attributes: a call outside them
recompiles, and the new graph is matched afresh), AOTAutograd lowers it to functional aten ops, and
`Backend` rewrites the *inference* graph only; the returned code runs the graph's aten ops one by one
(no TorchInductor), on a GPU replayed from CUDA graphs (`graphs.Graphed`: one launch instead of one
Python call per op). Training graphs are never rewritten, and a patched forward runs the original
code whenever autograd needs it (grad enabled and a parameter or input requiring grad).

The compiled function is cached per (forward function, pattern keys), not per module: all 32
decoder layers of a model share one capture (dynamo guards on the module's structure, and parameters
are graph inputs), and nothing unpicklable is ever stored on the module.
"""
from __future__ import annotations

import copy
import importlib.util
import os
import types
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._pytree import tree_leaves

from advisor.patch import rewrite
from advisor.patch.graphs import Graphed
from advisor.patch.match import Pattern, find
from advisor.patch.plan import PatternSpec
from advisor.patch.program import program_graph, run_program

_COMPILED: dict[tuple, Callable] = {}
_PATTERNS: dict[tuple, Pattern] = {}
_LAUNCHERS: dict[tuple, Callable] = {}


@dataclass
class CaptureLog:
    """What the rewriter did, per pattern key, over every graph captured for one set of patterns."""

    sites: dict = field(default_factory=lambda: defaultdict(list))  # key -> [Site]
    rejected: dict = field(default_factory=lambda: defaultdict(list))  # key -> [reason]
    graphs: int = 0
    errors: list = field(default_factory=list)

    def count(self, key: str) -> int:
        return len(self.sites.get(key, []))


_LOGS: dict[tuple, CaptureLog] = defaultdict(CaptureLog)


def log_for(key: tuple) -> CaptureLog:
    """The log of one capture: key = (captured function, pattern keys)."""
    return _LOGS[key]


# ------------------------------------------------------------------------------------ launchers
def load_launcher(kernel_file: str) -> Callable:
    """`run` from a generated kernel module (cached by path and modification time)."""
    path = os.path.abspath(kernel_file)
    key = (path, os.path.getmtime(path))
    fn = _LAUNCHERS.get(key)
    if fn is None:
        name = "advisor_kernel_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
        mod_spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
        fn = _LAUNCHERS[key] = getattr(mod, "run")
    return fn


def _launcher(spec: PatternSpec, fallback: Callable) -> Callable:
    if spec.replacement == "subgraph":
        return fallback  # the matched ops themselves: tests the matcher and the substitution
    if spec.replacement == "program":
        program = spec.program
        return lambda *xs: run_program(program, xs)  # the program replayed: tests input order and views
    return load_launcher(spec.kernel_file)


# ------------------------------------------------------------------------------------ the backend
class Backend:
    def __init__(self, specs: list[PatternSpec], log: CaptureLog):
        self.specs = specs
        self.log = log
        self.device = torch.device("cpu")  # of the graph being rewritten

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

        def plain(g, _):
            return make_boxed_func(g.forward)

        def inference(g, _):
            self.rewrite(g)
            if self.device.type != "cuda":
                return make_boxed_func(g.forward)
            return make_boxed_func(Graphed(g.forward, ops=_ops(g.graph), out_bytes=_output_bytes(g.graph)))

        return aot_module_simplified(gm, example_inputs, fw_compiler=plain, bw_compiler=plain,
                                     inference_compiler=inference)

    def rewrite(self, gm: torch.fx.GraphModule) -> None:
        self.log.graphs += 1
        device = self.device = _graph_device(gm.graph)
        for spec in self.specs:
            before = _copy_graph(gm.graph)
            try:
                self._rewrite_one(gm, spec, device)
                gm.graph.lint()
            except Exception as e:  # never break the capture: this pattern just stays unpatched here
                gm.graph = before
                self.log.sites.pop(spec.key, None)
                self.log.errors.append(f"{spec.candidate} {spec.title}: {type(e).__name__}: {e}")
                self.log.rejected[spec.key].append(f"matcher error: {type(e).__name__}: {e}")
        gm.recompile()

    def _rewrite_one(self, gm, spec: PatternSpec, device) -> None:
        pkey = (spec.pattern_id, str(device))
        pattern = _PATTERNS.get(pkey)
        if pattern is None:
            pattern = _PATTERNS[pkey] = Pattern.build(spec.program, program_graph(spec.program, device))
        exclude: set = set()
        while True:
            m = find(pattern, gm.graph, exclude)
            if m is None:
                return
            result = rewrite.substitute(gm.graph, m, pattern, lambda m: self._site(spec, m))
            if isinstance(result, str):
                exclude |= m.g_nodes()
                self.log.rejected[spec.key].append(result)
            else:
                self.log.sites[spec.key].append(result)

    def _site(self, spec: PatternSpec, m) -> rewrite.Site:
        fallback = rewrite.make_fallback(m, spec.program["inputs"])
        return rewrite.Site(key=spec.key, label=f"{spec.candidate} {spec.title}", launcher=_launcher(spec, fallback),
                            fallback=fallback, inputs=[rewrite.InputSpec.of(s) for s in spec.program["inputs"]],
                            outputs=rewrite.output_layouts(m), device_type=spec.device_type,
                            scalar_device=self.device if spec.replacement == "kernel" else "cpu")


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


def compiled(fn: Callable, specs: list[PatternSpec]) -> Callable:
    key = (fn, tuple(s.key for s in specs))
    c = _COMPILED.get(key)
    if c is None:
        c = _COMPILED[key] = torch.compile(_fresh(fn), backend=Backend(specs, log_for(key)), dynamic=False)
    return c


def _fresh(fn: Callable) -> Callable:
    """The same function with its own code object. Dynamo keeps its compiled-code cache on the code
    object and stops compiling after `recompile_limit` (8) entries; every plan (set of pattern keys)
    is a new backend, hence a new entry, so plans would otherwise share, and exhaust, one cache."""
    if not isinstance(fn, types.FunctionType):
        return fn
    g = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    g.__kwdefaults__ = fn.__kwdefaults__
    g.__dict__.update(fn.__dict__)
    g.__qualname__ = fn.__qualname__
    return g


# ------------------------------------------------------------------------------------ the forward
class PatchedForward:
    """`module.forward` while patched. Holds plain data only (module, specs, the forward it replaced)."""

    def __init__(self, module: torch.nn.Module, specs: list[PatternSpec], saved: Callable | None = None):
        self.module = module
        self.specs = specs
        self.saved = saved  # an instance-level forward that was there before us (None: the class's)
        self.failed: str | None = None

    @property
    def keys(self) -> tuple:
        return tuple(s.key for s in self.specs)

    def _target(self) -> tuple[Callable, tuple]:
        """The function that gets captured and the arguments that go before the caller's."""
        return (self.saved, ()) if self.saved is not None else (type(self.module).forward, (self.module,))

    def log(self) -> CaptureLog:
        """What the rewriter did in the captures this forward runs (shared with same-class modules)."""
        return log_for((self._target()[0], self.keys))

    def original(self) -> Callable:
        return self.saved if self.saved is not None else type(self.module).forward.__get__(self.module)

    def __call__(self, *args, **kwargs):
        m = self.module
        if rewrite.patches_are_off() or self.failed or _needs_autograd(m, args, kwargs):
            return self.original()(*args, **kwargs)
        fn, lead = self._target()
        try:
            return compiled(fn, self.specs)(*lead, *args, **kwargs)
        except Exception as e:
            # A capture that cannot run (dynamo limitation, launcher import error, ...): say so once,
            # then behave exactly like the unpatched module.
            self.failed = f"{type(e).__name__}: {e}"
            warnings.warn(f"fusion-advisor: patched {type(m).__name__}.forward failed ({self.failed}); "
                          "running the original forward", RuntimeWarning, stacklevel=2)
            return self.original()(*args, **kwargs)

    def __deepcopy__(self, memo):
        new = PatchedForward(copy.deepcopy(self.module, memo), self.specs, copy.deepcopy(self.saved, memo))
        new.failed = self.failed
        return new

    def __reduce__(self):
        return (PatchedForward, (self.module, self.specs, self.saved))

    def __repr__(self) -> str:
        return f"<fusion-advisor patched forward of {type(self.module).__name__}: {', '.join(self.keys)}>"


def _needs_autograd(m: torch.nn.Module, args, kwargs) -> bool:
    if not torch.is_grad_enabled():
        return False
    if any(p.requires_grad for p in m.parameters()):
        return True
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in tree_leaves((args, kwargs)))
