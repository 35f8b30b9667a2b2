"""Patched vs unpatched on the same inputs; a pattern whose outputs differ is unpatched and says why.
Every call of a check starts from one random-number state (`_same_draws`): a call that draws random numbers
(ViTMAE's random masking, in eval mode too) is compared at the same draws; where the patched call draws
differently its patterns are dropped as any that differ are. The caller's random stream moves on as for one call.

`check(call, handle, exact)`: runs `call()` with patches off (the reference) and on, compares with
validation's dtype tolerances (and, for low-precision models, validation's rule against a float32
copy of the call: see `advisor.validate.outputs`). On a mismatch each pattern is run alone against the reference; the
ones that fail alone are dropped (if none fails alone, the combination is at fault and all are
dropped) and the model is re-patched without them.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd
from torch.utils._pytree import tree_map
from torch.utils._python_dispatch import TorchDispatchMode

from advisor.agreement import agreed
from advisor.validate.outputs import Comparison, compare_outputs
from advisor.example_inputs import snapshot
from advisor.ops import registry
from advisor.patching import Patched, only, patch, patches_off, whole
from advisor.patching.capture import launched_sites
from advisor.stopwatch import Stopwatch


def repeatable(m: torch.nn.Module) -> bool:
    """Can the call run twice (patched and unpatched) with the same result and no lasting effect?
    Not with active dropout (random) or batch norm in training mode (updates its running stats)."""
    return not any(x.training and (isinstance(x, _BatchNorm) or (isinstance(x, _DropoutNd) and x.p > 0))
                   for x in m.modules())


EVAL_FOR_CHECKS = ("optimize ran the model in eval mode (in training mode its dropout or BatchNorm make two "
                   "calls differ, so nothing could be checked or timed); its modes are restored")


class _RandomOps(TorchDispatchMode):
    """Notes the first op of a call that draws random numbers (the op registry says which do)."""

    def __init__(self):
        super().__init__()
        self.seen: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.seen is None:
            schema = func._schema
            named = {**{a.name: v for a, v in zip(schema.arguments, args)}, **kwargs} if any(
                a.name in registry.RANDOM_ARGUMENTS for a in schema.arguments) else None
            if registry.draws_random(schema.name, named):
                self.seen = schema.name
        return func(*args, **kwargs)


def draws_random(call: Callable[[], object]) -> str | None:
    """The first op a call runs that draws random numbers, or None: dropout that no module's type shows
    (`F.dropout(x, p, training=self.training)`, as OPT and many HF models write it), stochastic depth
    (`torch.rand` in a drop-path), noise layers."""
    with _RandomOps() as mode:
        call()
    return mode.seen


@contextlib.contextmanager
def eval_if_unrepeatable(model: torch.nn.Module, call: Callable[[], object] | None = None):
    """Profile, check and time a model handed over in training mode as it runs for inference, where its
    dropout or BatchNorm would otherwise make every comparison fail (a random mask per call) or move its
    statistics: by module type, and (given `call`, a call of the model as optimize makes it) by the ops one
    call runs. Yields the note to report, or None where nothing was switched."""
    training = any(m.training for m in model.modules())
    if not training or (repeatable(model) and (call is None or not draws_random(call))):
        yield None
        return
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield EVAL_FOR_CHECKS
    finally:
        for m, training in modes.items():
            m.training = training


@dataclass
class Check:
    comparison: Comparison
    dropped: dict = field(default_factory=dict)  # pattern key -> reason
    handle: Patched | None = None  # the (re-)patched model
    output: object = None  # the output to hand back (the reference when anything was dropped)
    seconds: dict = field(default_factory=dict)  # wall time of its steps (the first patched call captures)

    def as_dict(self) -> dict:
        return {**self.comparison.as_dict(), "dropped": dict(self.dropped), "seconds": dict(self.seconds)}


@contextlib.contextmanager
def _same_draws():
    """Yields `rerun(fn)`: `fn` made to start from the random state (CPU and current GPU) this block began with,
    every time it is called. After the block the state is the first call's end state: the caller's random
    stream moves on as for the one call it asked for (a training script's next dropout mask is a new one)."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []

    def state():
        return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]

    def restore(st):
        torch.set_rng_state(st[0])
        for d, g in zip(devices, st[1]):
            torch.cuda.set_rng_state(g, d)

    start, after = state(), []

    def rerun(fn):
        def again():
            restore(start)
            out = fn()
            if not after:
                after.append(state())
            return out
        return again
    try:
        yield rerun
    finally:
        if after:
            restore(after[0])


def agreed_comparison(ref, out, exact=None) -> Comparison:
    """`compare_outputs` as rank 0 found it, in a torch.distributed job (`advisor.agreement`): each rank checks its
    own outputs, and what is dropped, and which calls the check makes next, is decided once."""
    return agreed(compare_outputs(ref, out, exact), "output checks")


def check(call: Callable[[], object], handle: Patched, exact: Callable[[], object] | None = None) -> Check:
    """`exact()`, when given, computes the same call in float32 (see `float32_reference`); it is only run
    when the patched output is not within the dtype tolerance of the unpatched one."""
    with _same_draws() as rerun:
        return _check(rerun(call), handle, exact and rerun(exact))


def _check(call: Callable[[], object], handle: Patched, exact: Callable[[], object] | None) -> Check:
    clock = Stopwatch()
    with clock("unpatched call"), patches_off(), _RandomOps() as random_ops:
        ref = call()
    with clock("first patched call"):
        out = call()
    with clock("compare"):
        cmp = agreed_comparison(ref, out)
    exact_out = None
    if not cmp.ok and exact is not None:
        with clock("float32 reference"):
            exact_out = exact()
        if exact_out is not None:
            with clock("compare"):
                cmp = agreed_comparison(ref, out, exact_out)
    if random_ops.seen:  # said beside the verdict: these outputs agree (or not) at one random state
        cmp = dataclasses.replace(cmp, reason=f"{cmp.reason or 'outputs as unpatched'} (at the same random "
                                  f"draws: the call draws random numbers, {random_ops.seen})")
    if cmp.ok:
        return Check(cmp, {}, handle, out, clock.seconds)
    with only(set()):  # the captures with no kernel: what the module computes when captured
        bare = agreed_comparison(ref, call(), exact_out)
    if not bare.ok:
        # No kernel is to blame: the captured code itself computes otherwise than the eager forward (an eager-only
        # path dynamo does not take: nn.TransformerEncoder's nested-tensor fast path leaves its padded positions
        # zero, its capture computes them). The model runs unpatched, as it computes eagerly.
        why = ("outputs differ from the unpatched model with no kernel at all: the captured modules compute otherwise "
               f"than their eager forwards (an eager-only fast path a capture cannot follow), so none is patched: "
               f"{bare.reason}")
        dropped = {s.key: why for s in handle.plan.patterns}
        return Check(cmp, dropped, patch(handle.model, handle.plan.without(dropped)), ref, clock.seconds)
    live = [s.key for s in handle.plan.patterns if handle.sites(s.key)]
    dropped, error = {}, {}
    for key in live:
        with only({key}):
            alone = agreed_comparison(ref, call(), exact_out)
        error[key] = alone.rel_l2
        if not alone.ok:
            dropped[key] = f"outputs differ from the unpatched model with this pattern alone: {alone.reason}"
    if not dropped:
        # Each is right alone, their rounding differences add up (a 50-layer convnet): leave out the ones that
        # move the output most, one at a time, until the rest together pass; all of them if none does.
        rest = sorted(live, key=lambda k: error[k])
        while rest:
            gone = rest.pop()
            dropped[gone] = f"outputs differ with all patterns applied together: {cmp.reason}"
            with only(set(rest)):
                if rest and agreed_comparison(ref, call(), exact_out).ok:
                    break
        else:
            dropped = {k: f"outputs differ with all patterns applied together: {cmp.reason}" for k in live}
    new = patch(handle.model, handle.plan.without(dropped))
    return Check(cmp, dropped, new, ref, clock.seconds)


def float32_reference(module: torch.nn.Module, args: tuple, kwargs: dict) -> Callable[[], object] | None:
    """A function computing `module(*args, **kwargs)` on a float32 copy (floating inputs upcast, patches
    off): the exact answer that low-precision outputs are judged against. None when the module already
    computes in float32 or wider, or when the copy would not fit in the device's free memory."""
    floats = [t for t in [*module.parameters(), *module.buffers()] if t.is_floating_point()]
    if not floats or all(t.dtype in (torch.float32, torch.float64) for t in floats):
        return None
    need = 2 * sum(t.numel() for t in floats) * 4  # the copy, plus room for its activations
    dev = floats[0].device
    if dev.type == "cuda" and torch.cuda.mem_get_info(dev)[0] < need:
        return None

    def up(t):
        return t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def run():
        twin = None
        try:  # a model that cannot be copied (FSDP2's sharded one) or run in float32: judged by the tolerance alone
            twin = copy.deepcopy(module).float()
            a, k = tree_map(up, snapshot((args, kwargs)))  # `up` hands float32 inputs over as they are
            with patches_off(), torch.inference_mode():
                return twin(*a, **k)
        except Exception:
            return None
        finally:
            del twin

    return run


def check_outer(call: Callable[[], object], handle: Patched, exact: Callable[[], object] | None = None) -> dict:
    """Runs the outer captures (the whole stack as one graph, see `capture`) once against the unpatched
    model. Returns {pattern key: sites launched} of that call; on different outputs (or a capture that
    fails) the outer captures are marked rejected (or failed), never to run, and the layer captures stay in charge."""
    live = [f for f in handle.outer if not f.refused]
    if not live:
        return {}
    with patches_off():
        ref = call()
    before = handle.launches()
    with whole(True):
        out = call()
    after = handle.launches()
    cmp = agreed_comparison(ref, out)
    if not cmp.ok and exact is not None and (exact_out := exact()) is not None:
        cmp = agreed_comparison(ref, out, exact_out)
    if not cmp.ok:
        for f in live:
            f.rejected = f"outer capture: outputs differ from the unpatched model ({cmp.reason})"
        return {}
    return launched_sites(before, after)
