"""Whether an HF causal LM trains its loss without the N x V logits (`optimize(train=True)`).

Eager's LM loss makes the head's logits (N tokens x V vocabulary, bf16), upcasts them to float32 for the
cross-entropy and keeps the softmax's gradient as large: on the suite's Llama (4096 tokens, 32000 words)
1.5 GB and 4.4 ms of the step for the head's forward and backward. The fused loss
(`kernels.linear_cross_entropy`) goes through the rows in chunks and never holds them (0.4 GB, 2.9 ms on
the H100: docs/EXPERIMENTS.md: lce_chunks). It is used only where it computes the model's own loss: on the
example (its labels, else its input_ids as labels; dropout off) the fused loss against the model's forward
with labels (which tells apart heads that do more than the projection, BERT's LM transform, or rescale the
logits); then, like a generated kernel, on the example's token count its loss and gradients (hidden states,
weight, bias) against eager's; then, on a GPU, the model's training call with labels timed with its loss both ways
(eager's way is the model's forward as it is: a head another pattern patched runs so), interleaved, with the
peak memory of each; it is used only where it validated and either times faster beyond the noise and is no
heavier, or is lighter and not slower beyond the noise (the suite's Llama on the H100: 1.2 GB lighter and
1.4 ms faster, 27.9 -> 26.5 ms, inside one run's noise margin: the choice must not hang on that noise).
The model's forward then computes the loss so when called with labels under autograd, and its `logits`
only if read.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable

import torch

from advisor.agreement import agreed
from advisor.measure import timing  # read at call time: tests replace its clocks
from advisor.errors import exception_details, exception_reason
from advisor.example_inputs import snapshot
from advisor.kernels.linear_cross_entropy import (CausalLMLossForward, LinearCrossEntropyFunction, NotCausalLM,
                                                  causal_lm_parts, fused_causal_lm_loss,
                                                  linear_cross_entropy_reference)
from advisor.workflows.selection import ROUNDS, Option, shown_faster
from advisor.workflows.training import MEMORY_SLACK, labelled_step, left_as_found, peak_bytes

CPU_ROWS = 64  # tokens validated on the CPU: the kernel runs in Triton's interpreter there
SHARPEN = 64.0  # the head's weight scaled by it while the fused loss is compared with the model's own
# Kept for memory alone only when its median is at most this much slower: under FSDP2 the rounds' noise hid an 8%
# slower loss ("not shown slower"), which its training loop then ran 34% slower than eager.
LIGHTER_SLOWDOWN = 0.02
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6}  # relative L2; 2e-2 for 16-bit heads (as generated kernels)


def keep_faster_lm_loss(model: torch.nn.Module, args: tuple, kwargs: dict, device: str, iters: int = 20) -> dict | None:
    """Validate and time the fused LM loss for `model`; apply it where it is kept. None for models that are
    not HF causal LMs; else the decision (apply.json `training.lm_loss`)."""
    model = _inner(model)
    try:
        _, head = causal_lm_parts(model)
    except NotCausalLM:
        return None
    except ValueError as e:
        return {"decision": f"eager's LM loss: {e}", "kept": False}
    tokens = _tokens(args, kwargs)
    if tokens is None:
        return {"decision": "eager's LM loss: no input_ids in the example to size it by", "kept": False}
    out: dict = {"tokens": tokens, "vocabulary": head.out_features}
    try:
        return _checked_and_timed(model, head, args, kwargs, device, iters, out)
    except Exception as e:  # a check failing must not cost the user their model (a wrapper whose base model is
        # not the transformer, PEFT's, say): it is left as it was
        wrapper = model.__dict__.get("forward")
        if isinstance(wrapper, CausalLMLossForward):
            wrapper.remove()
        return out | {"decision": f"eager's LM loss (its check failed: {exception_reason(e, named=(model,))}; "
                                  "apply.json's training.lm_loss.traceback has the full error)", "kept": False,
                      **exception_details(e)}


def _checked_and_timed(model, head, args: tuple, kwargs: dict, device: str, iters: int, out: dict) -> dict:
    meaningful = timing.timing_meaningful(device)
    tol = TOLERANCE.get(head.weight.dtype, 2e-2)
    own, output_type = _against_the_models_loss(model, args, kwargs)
    own = agreed(own, "LM loss checks")  # each rank's own data; the choice is made once, as selection's are
    out["model_loss_rel_error"] = round(own, 8)
    if not own <= tol:  # the model's loss is not cross-entropy over base model -> head (a head transform, a rescale)
        return out | {"decision": f"eager's LM loss: the fused loss differs from the model's own on the example "
                                  f"(relative error {own:.2e} > {tol:g})", "kept": False}
    operands = _operands(head, out["tokens"] if meaningful else min(out["tokens"], CPU_ROWS))
    error = out["rel_error"] = round(agreed(_error(operands), "LM loss checks"), 8)
    if not error <= tol:
        return out | {"decision": f"eager's LM loss: the fused loss's gradients differ from eager's (relative "
                                  f"error {error:.2e} > {tol:g})", "kept": False}
    fused_causal_lm_loss(model, output_type)
    wrapper = model.__dict__["forward"]
    if not meaningful:
        return out | {"decision": "LM loss without its logits, validated (timing not meaningful here: not timed)",
                      "kept": True}
    out |= _timed(model, args, kwargs, wrapper, device, iters)
    peaks = out["eager_peak_gb"], out["fused_peak_gb"]
    numbers = f"a training call with labels {out['eager_ms']:.3f} -> {out['fused_ms']:.3f} ms" + \
        (f", peak {peaks[0]:.3f} -> {peaks[1]:.3f} GB" if None not in peaks else "")
    lighter = None not in peaks and peaks[1] < (1 - MEMORY_SLACK) * peaks[0]
    near = out["fused_ms"] <= out["eager_ms"] * (1 + LIGHTER_SLOWDOWN)
    out["kept"] = (out["faster"] and (None in peaks or peaks[1] <= peaks[0])) or (lighter and near and not out["slower"])
    if out["kept"]:
        out["decision"] = f"LM loss without its logits{'' if out['faster'] else ' (lighter, not slower)'}: {numbers}"
    else:
        wrapper.remove()
        why = ("slower" if out["slower"] or (lighter and not near) else "heavier" if out["faster"]
               else "not faster beyond noise nor lighter")
        out["decision"] = f"eager's LM loss ({why}): {numbers}"
    return out


def causal_lm_step(model: torch.nn.Module, args: tuple, kwargs: dict, decision: dict | None) -> tuple:
    """(labels, baseline) for the training check (`training.keep_faster_training`) of a causal LM this module
    decided on (`decision` not None): its labels (`_labels`), and a context in which its loss is eager's (the
    fused loss off, where kept); (None, None) for other models."""
    if decision is None:
        return None, None
    wrapper = _inner(model).__dict__.get("forward")
    if not isinstance(wrapper, CausalLMLossForward):
        return _labels(args, kwargs), None
    return _labels(args, kwargs), _fused_loss(wrapper, False)


def _fused_loss(wrapper: CausalLMLossForward, on: bool) -> Callable:
    """A context (factory) in which the model's loss is the fused one (`on`) or eager's; it is on again after."""
    @contextlib.contextmanager
    def state():
        wrapper.enabled = on
        try:
            yield
        finally:
            wrapper.enabled = True
    return state


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside a PEFT wrapper (LoRA and the like: `get_base_model()`), whose forward the wrapper
    calls: the fused loss goes on it. Other models as they are."""
    get = getattr(model, "get_base_model", None)
    inner = get() if callable(get) else None
    return inner if isinstance(inner, torch.nn.Module) and inner is not model else model


def _input_ids(args: tuple, kwargs: dict) -> torch.Tensor | None:
    ids = kwargs.get("input_ids", args[0] if args else None)
    return ids if isinstance(ids, torch.Tensor) and not ids.is_floating_point() else None


def _labels(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The labels a training call on the example trains on: the caller's where the example carries them (a
    training loop's inputs), else its input_ids (HF's causal LMs shift them inside their loss)."""
    labels = kwargs.get("labels")
    return labels if isinstance(labels, torch.Tensor) else _input_ids(args, kwargs)


def _tokens(args: tuple, kwargs: dict) -> int | None:
    ids = _input_ids(args, kwargs)
    return None if ids is None else ids.numel()


def _against_the_models_loss(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[float, type | None]:
    """How far the fused loss is from the model's own (its forward with labels) on the example, its labels
    (`_labels`), dropout off: the one check that the model's loss is what the fused one computes (cross-entropy of
    the base model's hidden states through the head, labels shifted by one), whatever the model's code does
    between them. The head's weight is scaled up for it (`SHARPEN`, restored exactly after): with random
    weights the logits are near 0 and every position's loss near log V, whichever label it is scored against
    and however the logits were rescaled (Granite's logits_scaling of 4 moved it by 0.2%); sharpened, a wrong
    shift or scale moves it by far more than the tolerance. The logits are compared too (head of the base
    model's states against the model's own). Returns the larger relative error (inf where the model's output
    is not a dataclass with `loss` first and `logits`) and the model's output class (the fused loss's output
    keeps it)."""
    labelled = dict(kwargs, labels=_labels(args, kwargs))
    modes = {m: m.training for m in model.modules()}
    head = model.get_output_embeddings()
    saved = head.weight.detach().clone()
    model.eval()
    try:
        with torch.no_grad():
            head.weight.mul_(SHARPEN)
            a, k = snapshot((args, labelled))
            theirs = model(*a, **k)  # no grad: the original forward, even if wrapped
            a, k = snapshot((args, labelled))
            loss, hidden, _ = CausalLMLossForward(model).loss(*a, **k)
            logits = head(hidden)
    finally:
        with torch.no_grad():
            head.weight.copy_(saved)
        for m, training in modes.items():
            m.training = training
    fields = [f.name for f in dataclasses.fields(theirs)] if dataclasses.is_dataclass(theirs) else []
    if fields[:1] != ["loss"] or "logits" not in fields or theirs.loss is None or theirs.logits is None \
            or theirs.logits.shape != logits.shape:
        return math.inf, None
    return max(_relative(loss, theirs.loss), _relative(logits, theirs.logits)), type(theirs)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm().clamp(min=1e-12)).item()


def _operands(head: torch.nn.Linear, rows: int) -> tuple:
    """Hidden states (not all zeros), the head's weight and bias as leaves of their own (their gradients are not
    the model's), and labels with every seventh ignored, as padding is."""
    w = head.weight
    gen = torch.Generator(w.device).manual_seed(0)
    hidden = torch.randn(rows, head.in_features, generator=gen, device=w.device).to(w.dtype).requires_grad_()
    labels = torch.randint(0, head.out_features, (rows,), generator=gen, device=w.device)
    labels[::7] = -100
    bias = head.bias.detach().requires_grad_() if head.bias is not None else None
    return hidden, w.detach().requires_grad_(), bias, labels


def _loss_and_grads(fn, operands) -> list[torch.Tensor]:
    hidden, weight, bias, labels = operands
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    loss = fn(hidden, weight, bias, labels)
    return [loss.detach().float(), *(g.float() for g in torch.autograd.grad(loss, leaves))]


def _error(operands) -> float:
    """The largest relative L2 error of the fused loss and gradients against eager's."""
    with torch.enable_grad():
        got = _loss_and_grads(LinearCrossEntropyFunction.apply, operands)
        want = _loss_and_grads(linear_cross_entropy_reference, operands)
    return max(((a - b).norm() / b.norm().clamp(min=1e-12)).item() for a, b in zip(got, want))


def _timed(model: torch.nn.Module, args: tuple, kwargs: dict, wrapper, device: str, iters: int) -> dict:
    """The model's training call with labels (forward, its loss, backward; gradients then set to None as
    `zero_grad` does), timed interleaved with the loss eager's way (the model's forward as it was: its patched
    head, say) and fused, with each one's peak memory. The model is left as it was found."""
    params = [p for p in model.parameters() if p.is_floating_point()]
    step = labelled_step(model, args, kwargs, _labels(args, kwargs), params)
    eager, fused = _fused_loss(wrapper, False), _fused_loss(wrapper, True)
    peaks = {}
    with left_as_found(model, [], device):
        if not any(p.requires_grad for p in params):  # handed over frozen: timed as it will train (adapters
            for p in params:  # such as LoRA's, some trainable, are timed as they are)
                p.requires_grad_(True)
        states = (("eager", eager), ("fused", fused))
        for _, state in states:  # workspaces, captures, the layers' training recordings: resident in both
            with state():        # measurements, as in the loop (warmed one at a time, the recordings its
                step()           # first training call made counted in one state only: 2 GB on Llama)
        for name, state in states:
            with state():
                peak = peak_bytes(step, device)
                peaks[name] = None if peak is None else round(peak / 2**30, 3)
        t = timing.time_configs(step, {"eager": eager, "fused": fused}, device, iters=iters, rounds=ROUNDS)
    before, after = t["eager"], t["fused"]
    option = Option("fused", None, after.median_ms, rounds_ms=tuple(after.rounds_ms))
    as_was = Option("eager", None, before.median_ms, rounds_ms=tuple(before.rounds_ms))
    return {"eager_ms": round(before.median_ms, 4), "fused_ms": round(after.median_ms, 4),
            "faster": shown_faster(before.median_ms, before.rounds_ms, option),
            "slower": shown_faster(after.median_ms, after.rounds_ms, as_was),
            "eager_peak_gb": peaks["eager"], "fused_peak_gb": peaks["fused"]}
