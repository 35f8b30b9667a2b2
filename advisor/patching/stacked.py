"""Inductor around our kernels (`optimize(..., inductor=True)`): a rewritten inference graph is handed to
torch.compile's Inductor with each fused site as one call of a custom op, `fusion_advisor::site`, so that
Inductor fuses every op our kernels leave (the pointwise and reduction regions between matmuls no pattern
took) and keeps ours where they are. What Inductor compiles is still our capture: guarded, CUDA-graph
replayed and unpatched as the op-by-op graph is.

Why one op for every site, not one per kernel: a custom op is registered once per process and can never be
removed, and each site differs only in the Python object it calls. The op takes the site's number in a table
and its tensor inputs; the site's literal arguments stay in the table beside it. Its fake implementation
gives the outputs' recorded shapes, strides and dtypes, and its real one makes sure the kernel's outputs
have exactly them (Inductor's code after it indexes them by those strides) and alias no input (a custom
op's outputs may not).

The graph is re-traced with Inductor's own decompositions before it is compiled (our patterns match aten as
AOTAutograd leaves it, undecomposed; Inductor lowers its decomposed form), and `compile_fx_inner` compiles
it as torch.compile's inference graphs are compiled. Anything that fails on the way leaves the graph to run
op by op, with the reason logged on the capture.
"""
from __future__ import annotations

import itertools
import threading
from typing import Callable

import torch
from torch.fx import GraphModule, Node

from advisor.patching.match import same_strides
from advisor.patching.plan import INDUCTOR_MODES
from advisor.patching.rewrite import Site

_TENSOR = object()  # a template slot the op's tensor list fills


def left_to_inductor(spec) -> bool:
    """Whether a pattern is left to Inductor where it compiles the graph: one of pointwise, reduction, norm and
    data-movement ops only, which Inductor fuses too, and with the ops around it, where our kernel, opaque to
    it, would cut its region in two. On the H200 every such pattern kept as ours left the compiled model behind
    torch.compile's (Qwen2 1.66x against 1.71x, ConvNeXt-T 1.44x against 1.51x). Patterns around a matmul or
    an attention stay ours: Inductor calls a library kernel there and fuses nothing into it."""
    return not spec.anchored


class SiteTable:
    """The sites the custom op calls, by number, each with its argument template (literals, and `_TENSOR`
    where the op's tensors go in order). Entries live as long as the process: a compiled graph refers to them
    by number, and dropping one would break a graph still cached by dynamo."""

    def __init__(self):
        self._sites: dict[int, tuple[Site, tuple, tuple | None]] = {}
        self._numbers = itertools.count()
        self._lock = threading.Lock()

    def add(self, site: Site, template: tuple, devices: tuple | None = None) -> int:
        """`devices`: each output's, as the graph holds it (None: the first tensor input's)."""
        with self._lock:
            n = next(self._numbers)
            self._sites[n] = (site, template, devices)
            return n

    def get(self, n: int) -> tuple[Site, tuple, tuple | None]:
        return self._sites[n]


TABLE = SiteTable()


@torch.library.custom_op("fusion_advisor::site", mutates_args=())
def site_op(number: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    site, template, _ = TABLE.get(number)
    given = iter(tensors)
    outs = site(*(next(given) if a is _TENSOR else a for a in template))
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    inputs = {t.untyped_storage().data_ptr() for t in tensors}
    fixed = []
    for o, (shape, strides, dtype) in zip(outs, site.outputs):
        if o.untyped_storage().data_ptr() in inputs or not same_strides(shape, strides, o.stride()):
            o = torch.empty_strided(shape, strides, dtype=dtype, device=o.device).copy_(o)
        fixed.append(o)
    return fixed


@site_op.register_fake
def _site_fake(number: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    site, _, devices = TABLE.get(number)
    # (not the first input's device: that may be a 0-dim host scalar beside GPU tensors)
    devices = devices or (tensors[0].device,) * len(site.outputs)
    return [torch.empty_strided(shape, strides, dtype=dtype, device=device)
            for (shape, strides, dtype), device in zip(site.outputs, devices)]


def with_site_ops(gm: GraphModule) -> str | None:
    """Each site call in `gm` replaced by a call of the custom op; None when done, else why it cannot be (the
    graph is left as it was)."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, Site)]
    if any(n.target.writes for n in calls):
        return "a site writes one of its inputs in place (a custom op here returns new tensors only)"
    for n in calls:
        if any(isinstance(a, Node) and not isinstance(a.meta.get("val"), torch.Tensor) for a in n.args):
            return f"{n.target.label} takes a value computed in the graph that is not a tensor"
    for n in calls:
        tensors = [a for a in n.args if isinstance(a, Node)]
        template = tuple(_TENSOR if isinstance(a, Node) else a for a in n.args)
        number = TABLE.add(n.target, template, tuple(v.device for v in n.meta["val"]))
        with gm.graph.inserting_before(n):
            op = gm.graph.call_function(torch.ops.fusion_advisor.site.default, (number, tensors))
        op.meta["val"] = list(n.meta["val"])
        n.replace_all_uses_with(op)
        gm.graph.erase_node(n)
    gm.recompile()
    return None


def inductor_compiled(gm: GraphModule, example_inputs: list, inductor: bool | str = True) -> Callable:
    """`gm` (sites already custom-op calls) re-traced with Inductor's decompositions in the inputs' fake mode
    and compiled by Inductor with `INDUCTOR_MODES[inductor]`: a function of the graph's inputs, as `gm.forward` is."""
    from torch._guards import detect_fake_mode
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = detect_fake_mode(example_inputs) or FakeTensorMode()
    # The graph's own tensor constants are real (a pinned host constant `host_copies` made recordable: Mistral's
    # whole stack on the H200 failed here without this); tracing and Inductor read them as they are.
    allowed, mode.allow_non_fake_inputs = mode.allow_non_fake_inputs, True
    try:
        with mode:
            fakes = [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x
                     for x in example_inputs]
            traced = make_fx(gm, decomposition_table=select_decomp_table(), tracing_mode="real")(*fakes)
        with inductor_config.patch(INDUCTOR_MODES[inductor]):
            compiled = compile_fx_inner(traced, fakes)  # (which propagates fake tensors through them again)
    finally:
        mode.allow_non_fake_inputs = allowed

    def run(*args):
        return compiled(list(args))  # Inductor's calling convention: one list, which it empties
    run.inductor = compiled
    return run
