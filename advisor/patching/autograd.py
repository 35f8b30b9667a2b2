"""Fused forward + generated backward as one `torch.autograd.Function`, validated before any use.

    t = Trainable(program, forward)     # forward: the site's launcher (inputs -> outputs)
    outs = t(xs)                        # None: no validated backward here; run the original ops

One generic Function serves every pattern: its forward runs the fused forward kernel and saves the
inputs the backward reads (`backward.derive` decides: it recomputes intermediates, never saves them);
its backward runs the backward kernel generated from the derived vjp program (`advisor.codegen`, the
same generator), then the column reductions of broadcast operands (`sum_to_size`).

A backward is derived, generated and validated once per (program, which inputs need grads, wrapped
scalar values, input shapes): the derived program may hold sizes as literals (the `1/N` of a mean's
backward), so a backward is never run at other sizes than it was derived for. Validation compares the
Function's gradients, forward kernel and backward kernel together, with PyTorch's own autograd on the
original program in float64 and in the native dtypes (`validate.compare`: the dtype's tolerance or
twice eager's own error), at the real shape (rows capped), at odd row counts and at one row, with
random output gradients. Anything that fails (an op with no decomposition, a kernel that does not
compile, a gradient off by more than the tolerance) leaves that key without a backward: the site then
runs its original ops and autograd differentiates those, at eager's cost.

A validated backward is used only where it is faster: on a GPU the site's forward + backward is timed
at the call's own shapes both ways (the fused Function, the original ops under autograd; interleaved,
CUDA events), once per key. A generated backward that recomputes and reduces may lose to PyTorch's own
(BERT's LayerNorm: its weight and bias gradients as column sums over every token), and a pattern
whose fused forward wins can still lose the step.
"""
from __future__ import annotations

import hashlib
import json
import statistics
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from advisor.agreement import agreed
from advisor.codegen import Unsupported, generate, load_module
from advisor.codegen.read import read_program
from advisor.errors import exception_reason
from advisor.patching import backward
from advisor.patching.backward import float_outputs
from advisor.patching.program import is_scalar_slot
from advisor.patching.rewrite import in_replayed_graph
from advisor.stopwatch import time_call, timing_meaningful
from advisor.validate import interpreted
from advisor.validate.compare import TOLERANCES, compare
from advisor.validate.inputs import draw
from advisor.validate.reference import run_reference
from advisor.validate.shapes import cases, row_class

_LOCK = threading.Lock()
_BACKWARDS: dict[tuple, "Backward"] = {}  # (program digest, key) -> derived and validated (or why not)


@dataclass
class Backward:
    derived: backward.Derived | None
    module: object  # the generated backward module (None when the kernel has no outputs: grads pass through)
    validated: bool
    reason: str | None = None
    errors: dict = field(default_factory=dict)
    source: str = ""  # the generated backward kernel module's code
    launches: int = 0  # backward passes run through it
    label: str = ""  # the pattern it serves (the first site that asked)
    floats: list = field(default_factory=list)  # the program's float outputs (those taking a gradient)
    grad_strides: list = field(default_factory=list)  # per float output: its gradient's layout in the kernel
    non_floats: list = field(default_factory=list)  # the others (autograd marks them non-differentiable)
    fused_ms: float | None = None  # forward + backward through the Function at the first call's inputs (GPU)
    eager_ms: float | None = None  # the same through the original ops
    faster: bool = True  # not timed (CPU), or timed and faster than the original ops
    timed_by: str | None = None  # how fused_ms and eager_ms were taken (`time_both`)

    @property
    def used(self) -> bool:
        return self.validated and self.faster


def digest(program: dict) -> str:
    return hashlib.sha1(json.dumps(program, sort_keys=True, default=str).encode()).hexdigest()[:16]


class FusedFunction(torch.autograd.Function):
    """forward(forward launcher, Backward, *inputs) -> the program's outputs."""

    @staticmethod
    def forward(ctx, launch, bw: Backward, *xs):
        outs = tuple(launch(xs))
        d = bw.derived
        ctx.bw = bw
        ctx.meta = [(x.shape, x.dtype) if isinstance(x, torch.Tensor) else None for x in xs]
        ctx.save_for_backward(*[xs[k] for k in d.saved], *[outs[j] for j in d.saved_outputs])
        if bw.non_floats:
            ctx.mark_non_differentiable(*[outs[j] for j in bw.non_floats])
        return outs

    @staticmethod
    def backward(ctx, *gouts):
        # Output grads arrive materialised (zeros for an unused output); the kernel was derived for them laid
        # out as their outputs, where they usually arrive: only another layout is copied into that one.
        bw = ctx.bw
        floats = [_laid_out(gouts[j], strides) for j, strides in zip(bw.floats, bw.grad_strides)]
        bw.launches += 1
        return (None, None, *grads_of(bw, ctx.saved_tensors, floats, ctx.meta))


def _laid_out(g: torch.Tensor, strides: tuple) -> torch.Tensor:
    """g in the layout the backward kernel was derived for (strides of size-1 dims do not matter)."""
    if all(n == 1 or a == b for n, a, b in zip(g.shape, g.stride(), strides)):
        return g
    return torch.empty_strided(g.shape, strides, dtype=g.dtype, device=g.device).copy_(g)


def grads_of(bw: Backward, saved, gouts, meta) -> list:
    """Each input's gradient: a kernel output or an output grad, reduced over broadcast dims, in its dtype."""
    d = bw.derived
    n = len(d.saved)  # the kernel's inputs: saved inputs, output grads, saved outputs
    res = bw.module.run(*saved[:n], *gouts, *saved[n:]) if bw.module is not None else ()
    out: list = [None] * len(meta)
    for g in d.grads:
        shape, dtype = meta[g.input]
        if g.source == "zero":
            t = torch.zeros(shape, dtype=dtype, device=gouts[0].device)
        else:
            t = res[g.index] if g.source == "kernel" else gouts[g.index]
            if g.reduce:
                t = t.sum_to_size(shape)
            if t.dtype != dtype:
                t = t.to(dtype)
        out[g.input] = t
    return out


class Trainable:
    """What a site runs when autograd needs it: the fused Function, where a validated backward exists."""

    def __init__(self, program: dict, forward: Callable, launch: Callable | None = None, keep_outputs: bool = True,
                 label: str = "", original: Callable | None = None):
        self.program = program
        self.original = original  # the site's original ops (inputs -> outputs): what the backward must beat
        self.label = label
        self.keep_outputs = keep_outputs  # the backward may read the forward's outputs (see backward.derive)
        self.forward = forward  # inputs (tensors or numbers) -> outputs, checked against the site's layouts
        self.launch = launch or forward  # the same, unchecked: validation runs it at other sizes
        self.digest = digest(program)
        self.scalar_slots = [k for k, s in enumerate(program["inputs"]) if is_scalar_slot(s)]

    def key(self, xs) -> tuple:
        """What a backward is derived for; computed on every call under autograd, so kept to tuples of
        what the call holds (a torch.Size hashes and compares as the tuple of its sizes)."""
        needs = tuple(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)
        scalars = tuple((k, _number(xs[k])) for k in self.scalar_slots)
        shapes = tuple(x.shape if isinstance(x, torch.Tensor) else None for x in xs)
        return needs, scalars, shapes, self.keep_outputs

    def backward_for(self, xs) -> Backward:
        key = (self.digest, self.key(xs))
        bw = _BACKWARDS.get(key)
        if bw is None:
            with _LOCK:
                bw = _BACKWARDS.get(key)
                if bw is None:
                    device = next(x.device for x in xs if isinstance(x, torch.Tensor))
                    bw = build(self.program, key[1], device, self.launch)
                    bw.label = self.label
                    if bw.validated and self.original is not None and timing_meaningful(device.type):
                        try:
                            timed = time_both(self.forward, self.original, bw, xs, key[1][0])
                        except Exception as e:  # timing must never break the site: it keeps its original ops
                            timed = f"not timed: {exception_reason(e)}"
                        # in a torch.distributed job every rank's site runs the backward rank 0 timed faster
                        timed = agreed(timed, "backward timings")
                        if isinstance(timed, str):
                            bw.faster, bw.reason = False, timed
                        else:
                            bw.fused_ms, bw.eager_ms = timed
                            bw.faster = bw.fused_ms < bw.eager_ms
                    _BACKWARDS[key] = bw
        return bw

    def __call__(self, xs) -> tuple | None:
        bw = self.backward_for(xs)
        if not bw.used:
            return None
        return FusedFunction.apply(self.forward, bw, *xs)


def time_both(forward: Callable, original: Callable, bw: Backward, xs, needs, rounds: int = 3) -> tuple[float, float]:
    """(fused ms, original ms): forward + backward at these inputs (random output gradients), timed in
    interleaved rounds after warm-up; the median of each's round medians. A site of a layer whose training
    graphs are replayed from CUDA graphs (`rewrite.in_replayed_graph`) costs its GPU work alone there, so
    each variant is then recorded in a CUDA graph and its replays timed. Timed from the host, a small site's
    Python (the Function, the launchers) can outweigh its kernels: BERT's and GPT-2's generated LayerNorm
    backwards measured 1.1-1.6 ms against PyTorch's 0.35-0.66 ms that way, for tens of microseconds of
    memory traffic (not yet re-measured by replays on the GPU). Where recording fails, or the layer runs
    op by op, the calls are timed as they run (the host's time included)."""
    leaves = [x.detach().requires_grad_(True) if n else x for x, n in zip(xs, needs)]
    wrt = [x for x, n in zip(leaves, needs) if n]

    def step(run):
        def once():
            with torch.enable_grad():
                outs = [o for o in run() if isinstance(o, torch.Tensor) and o.requires_grad]
                torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)
        return once

    fused = step(lambda: FusedFunction.apply(forward, bw, *leaves))
    eager = step(lambda: original(*leaves))
    launches = bw.launches
    calls, per = {"fused": fused, "eager": eager}, 1  # per: calls of the site one timed call runs
    bw.timed_by = "calls"
    if in_replayed_graph():
        try:
            calls, per = {k: _replayed(fn) for k, fn in calls.items()}, REPLAYED_CALLS
            bw.timed_by = "CUDA-graph replays"
        except Exception as e:  # not recordable: timed as the calls run
            bw.timed_by = f"calls (not recordable: {type(e).__name__})"
    got: dict = {"fused": [], "eager": []}
    for _ in range(rounds):
        for k, fn in calls.items():
            got[k].append(time_call(fn, "cuda", warmup=2, iters=10).median_ms / per)
    bw.launches = launches  # timing's passes do not count as the model's
    return statistics.median(got["fused"]), statistics.median(got["eager"])


REPLAYED_CALLS = 8  # calls recorded in one CUDA graph: a replay's own launch cost spread over them


def _replayed(fn: Callable[[], None]) -> Callable[[], None]:
    """REPLAYED_CALLS calls of `fn` recorded in one CUDA graph (on a stream of its own, in a pool of its
    own); returns its replay, whose time is their GPU time alone."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()  # warm: workspaces and autotuning outside the recording
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            for _ in range(REPLAYED_CALLS):
                fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return graph.replay


def summary() -> list[dict]:
    """Every backward derived in this process: for which program and inputs, whether it validated (or
    why not), how often it ran, and the bytes kept between the passes versus eager's estimate."""
    out = []
    for (dig, (needs, scalars, shapes, _)), bw in list(_BACKWARDS.items()):
        d = bw.derived
        out.append({"program": dig, "pattern": bw.label, "needs_grad": list(needs),
                    "shapes": [list(s) if s else None for s in shapes], "validated": bw.validated,
                    "reason": bw.reason, "launches": bw.launches, "saved_bytes": d.saved_bytes if d else None,
                    "fused_ms": bw.fused_ms, "eager_ms": bw.eager_ms, "timed_by": bw.timed_by,
                    "faster": bw.faster, "used": bw.used,
                    "saves_outputs": bool(d and d.saved_outputs),
                    "eager_saved_bytes": d.eager_saved_bytes if d else None,
                    "errors": {k: v for k, v in bw.errors.items() if k != "shapes"}})
    from advisor.patching import splade  # the SPLADE head's hand-written Function, validated the same way

    return out + splade.summary()


def _number(x):
    return x.item() if isinstance(x, torch.Tensor) else x


def build(program: dict, key: tuple, device, forward: Callable) -> Backward:
    """Derive, generate and validate the backward for one key; never raises."""
    needs, scalars, shapes, keep_outputs = key
    try:
        shaped = _at_shapes(program, shapes)
        d = backward.derive(shaped, needs, dict(scalars), device, keep_outputs)
        module, source = None, ""
        if d.program["outputs"]:
            gen = generate(d.program)
            module, source = load_module(gen.path), gen.code
        floats = set(backward.float_outputs(program))
        grads = d.program["inputs"][len(d.saved):len(d.saved) + d.outputs]
        bw = Backward(d, module, False, source=source, floats=sorted(floats),
                      non_floats=[j for j in range(len(program["outputs"])) if j not in floats],
                      grad_strides=[tuple(s["strides"]) for s in grads])
        ok, reason, errors = check(program, bw, key, device, forward)
        bw.validated, bw.reason, bw.errors = ok, reason, errors
        bw.launches = 0  # validation's own backward passes do not count
        return bw
    except Unsupported as e:
        return Backward(None, None, False, f"no backward: {e}")
    except Exception as e:  # a backward that cannot be built must never break the forward
        return Backward(None, None, False, f"no backward: {exception_reason(e, limit=500)}")


def _at_shapes(program: dict, shapes: tuple) -> dict:
    """The program re-laid out at the run's input shapes (contiguous views keep their structure: the
    recorded program already has these shapes wherever the site's guard let the call through)."""
    for s, shape in zip(program["inputs"], shapes):
        if shape is not None and list(shape) != list(s["shape"]):
            raise Unsupported("called at other shapes than the program records")
    return program


# ------------------------------------------------------------------------------------ validation
def check(program: dict, bw: Backward, key: tuple, device, forward: Callable) -> tuple[bool, str | None, dict]:
    """(ok, reason, worst errors): the Function's gradients against autograd on the program (fp64 and native)."""
    needs, scalars = key[0], key[1]
    ir = read_program(program)
    through = max((v.dtype for v in list(ir.values.values()) + list(ir.inputs) if v.dtype in TOLERANCES),
                  key=lambda dt: TOLERANCES[dt].rel_l2, default=None)
    row = _row_symbols(ir)
    _pin_backward_literals(ir, program, bw)
    worst = {"rel_l2": 0.0, "max_abs": 0.0, "eager_rel_l2": 0.0, "eager_max_abs": 0.0}
    g = torch.Generator(device=device).manual_seed(1)
    scalar = dict(scalars)
    shapes_seen = []
    for case in cases(ir, interpreted()):
        if row:  # the backward holds the row width as a literal: vary the rows only
            case.values.update({t: ir.sizes.value[t] for t in row})
        drawn = draw(ir, case, device, g)
        xs = [scalar[k] if k in scalar else drawn[inp.id] for k, inp in enumerate(ir.inputs)]
        shapes_seen.append([list(x.shape) for x in xs if isinstance(x, torch.Tensor)])
        try:
            with torch.no_grad(), np.errstate(all="ignore"):
                outs = [o for o in forward(xs) if o.is_floating_point()]
            gouts = [torch.randn(o.shape, generator=g, device=device).to(o.dtype) for o in outs]
            mine = _fused_grads(forward, bw, xs, needs, gouts)
            ref64 = _reference_grads(ir, case, xs, needs, gouts, "fp64")
            native = _reference_grads(ir, case, xs, needs, gouts, "native")
        except Exception as e:
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else ""
            return False, f"backward failed at the {case.name} shape: {type(e).__name__}: {msg}"[:500], worst
        for k in mine:
            c = compare(mine[k], ref64[k], native[k], f"grad of input {k} ({case.name} shape)", False, through)
            if not c.ok:
                return False, c.reason, {**worst, "failed": c.reason}
            for w in worst:
                worst[w] = max(worst[w], getattr(c, w))
    worst["shapes"] = shapes_seen
    return True, None, worst


def _pin_backward_literals(ir, program: dict, bw: Backward) -> None:
    """Pin in the forward's IR every size the backward kernel holds as a literal (a zero block padding a
    slice's gradient has the sizes it was derived at), so that validation resizes only what the backward
    kernel accepts resized: it is never run at other sizes than it was derived for anyway."""
    d = bw.derived
    if bw.module is None or d is None:
        return
    outs = float_outputs(program)
    forward = [ir.inputs[k].shape for k in d.saved] + [ir.outputs[j].shape for j in outs] \
        + [ir.outputs[j].shape for j in d.saved_outputs]
    kernel = read_program(d.program)
    for inp, dims in zip(kernel.inputs, forward):
        for kd, fd in zip(inp.shape, dims):
            if kernel.sizes.norm(kd).literal:
                ir.sizes.pin(fd)


def _row_symbols(ir) -> list:
    """Every size symbol in the row width's class (row programs), else none."""
    rep = row_class(ir)
    if rep is None:
        return []
    return [t for t in ir.sizes.parent if ir.sizes.find(t) == rep]


def _leaf(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(leaf storage, view laid out as t) in `dtype`: gradients land on the view's elements."""
    whole = torch.as_strided(t, (t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
    base = whole.detach().to(dtype, copy=True).requires_grad_()
    return base, torch.as_strided(base, t.shape, t.stride(), t.storage_offset())


def _fused_grads(forward, bw, xs, needs, gouts) -> dict:
    args, views = list(xs), {}
    for k, x in enumerate(xs):
        if needs[k]:
            _, views[k] = _leaf(x, x.dtype)
            args[k] = views[k]
    with torch.enable_grad(), np.errstate(all="ignore"):
        outs = [o for o in FusedFunction.apply(forward, bw, *args) if o.is_floating_point()]
        got = torch.autograd.grad(outs, [views[k] for k in sorted(views)], gouts, allow_unused=True)
    return {k: (t if t is not None else torch.zeros_like(views[k])) for k, t in zip(sorted(views), got)}


def _reference_grads(ir, case, xs, needs, gouts, mode: str) -> dict:
    inputs, views = {}, {}
    for k, (inp, x) in enumerate(zip(ir.inputs, xs)):
        if not isinstance(x, torch.Tensor):
            x = torch.tensor(x, dtype=inp.dtype)
        if needs[k]:
            _, views[k] = _leaf(x, torch.float64 if mode == "fp64" and x.is_floating_point() else x.dtype)
            inputs[inp.id] = views[k]
        else:
            inputs[inp.id] = x
    with torch.enable_grad():
        env, _ = run_reference(ir, case, inputs, mode)
        outs = [env[v.id] for v in ir.outputs[:ir.returned] if v.dtype.is_floating_point]
        got = torch.autograd.grad(outs, [views[k] for k in sorted(views)],
                                  [gv.to(o.dtype) for gv, o in zip(gouts, outs)], allow_unused=True)
    return {k: (t if t is not None else torch.zeros_like(views[k])) for k, t in zip(sorted(views), got)}


def module_forward(run: Callable, program: dict) -> Callable:
    """A generated module's `run` as a Trainable forward: wrapped scalars become 0-dim tensors as
    launchers take them (float64/int64 on the inputs' device)."""
    specs = program["inputs"]

    def forward(xs):
        dev = next(x.device for x in xs if isinstance(x, torch.Tensor))
        args = [torch.tensor(x, dtype=torch.int64 if isinstance(x, int) else torch.float64, device=dev)
                if is_scalar_slot(s) and not isinstance(x, torch.Tensor) else x for x, s in zip(xs, specs)]
        return run(*args)

    return forward
