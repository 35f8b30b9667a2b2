"""Whether calls needing gradients run fused (`optimize(train=True)`): the state handed back is the state
measured, for training as for inference.

Each site's generated backward is already kept only where it times faster than its original ops
(`autograd.time_both`); what that cannot see is the whole step: CUDA-graph replays and their copies, the
training pool's memory, sites that fall back. So on a GPU a training call (forward, then backward from
fixed random output gradients, gradients set to None after it as `zero_grad` does) is timed through the
fused path and through the original forwards, interleaved, and its peak memory taken in each. Fused
training is kept only when it is faster beyond the noise and no heavier than the original forwards;
otherwise training runs the original forwards (eager's time and memory) and the training recordings go.

A model handed over frozen (no parameter needing a gradient, as an inference-built model is until its
training loop unfreezes it) is compared with its floating-point parameters made trainable for the
comparison: `train=True` says it will train, and leaving the fused path off unmeasured would hand back
eager's training cost where the fused one may be faster.

The model is left as it was found: module modes, parameters' `requires_grad`, gradients, buffers
(BatchNorm statistics) and the random number generators' state.
"""
from __future__ import annotations

import contextlib
import inspect
import math
from typing import Callable

import torch
from torch.utils._pytree import tree_leaves

from advisor.agreement import agreed
from advisor.measure import timing  # read at call time: tests replace its clocks
from advisor.errors import exception_details, exception_reason
from advisor.example_inputs import snapshot
from advisor.patching.forward import TRAINING_CALL
from advisor.patching.modules import at_rest
from advisor.patching.train_graphs import drop_training_recordings
from advisor.workflows.selection import ROUNDS, Option, margin_ms, shown_faster

MEMORY_SLACK = 0.01  # peak allowed over the original forwards': the allocator's rounding, not a real cost


def keep_faster_training(model: torch.nn.Module, handle, args: tuple, kwargs: dict, device: str,
                         iters: int = 20, allowed: float = 0.0, labels: torch.Tensor | None = None,
                         baseline: Callable | None = None) -> dict:
    """Time a training call fused and unfused (GPU); leave `handle` training fused only if that is faster
    and no heavier (`allowed`: a fraction of the original forwards' peak the user lets it add). Returns the
    decision as a dict (apply.json `training`). `labels`: a causal LM's, its training call then computes the
    model's own loss from them (`training_call`). `baseline`: a context (factory) in which the model computes
    its loss as it did before `optimize` (the fused LM loss off, `workflows.lm_loss`): the memory the fused
    state is held to is then the original forwards' there, the user's model's, while its speed is compared
    with the original forwards as they will run."""
    if not timing.timing_meaningful(device):
        return {"decision": "fused training kept as asked (timing not meaningful here: not compared)",
                "kept": True}
    counted = {f: f.fallbacks.get(TRAINING_CALL, 0) for f in getattr(handle, "forwards", {}).values()}
    on = next((t.device for t in [*model.parameters(), *model.buffers()] if t.is_cuda), None)
    with torch.cuda.device(on) if on is not None else contextlib.nullcontext(), \
            left_as_found(model, _grad_leaves((args, kwargs)), device):  # (the memory stats are the model's GPU's)
        frozen = not any(p.requires_grad for p in model.parameters())
        if frozen:  # see the module's note: compared as it will train
            for p in model.parameters():
                if p.is_floating_point():
                    p.requires_grad_(True)
        try:
            handle.train_fused(False)  # the probe call runs the original forwards
            step = training_call(model, args, kwargs, labels)
            out = _compare(step, handle, device, iters, allowed, baseline, _addresses(model)) if step is not None else \
                {"decision": "no output of the example call needs a gradient" + (
                    ", even with every parameter trainable" if frozen else "") + ": training not compared",
                 "kept": False}
            if step is not None and frozen:
                out["decision"] += " (the model's parameters were made trainable for the comparison: none was)"
        except Exception as e:  # the comparison failing must not cost the user their (inference) patch
            out = {"decision": f"training runs the original forwards (its comparison failed: "
                               f"{exception_reason(e, named=(model,))}; apply.json's training.traceback has the "
                               "full error)", "kept": False, **exception_details(e)}
    out = agreed(out, "training decision")  # decided once: a rank whose check failed alone trains as rank 0 does
    handle.train_fused(out["kept"])
    if not out["kept"]:
        drop_training_recordings(_addresses(model))
    for f, n in counted.items():  # the comparison's own calls through the original forwards are not the user's
        f.fallbacks[TRAINING_CALL] = n
        if not n:
            del f.fallbacks[TRAINING_CALL]
    return out


def _addresses(model: torch.nn.Module) -> set:
    return {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}


def _compare(step: Callable[[], None], handle, device: str, iters: int, allowed: float = 0.0,
             baseline: Callable | None = None, addresses: set | None = None) -> dict:
    fused = _fused(handle)
    unfused = _fused(handle, False)
    # Each state is measured as the user's loop will hold it: the original forwards' peak without training
    # recordings resident (an earlier check's, the LM loss's, had been: its 6 GB counted against the original
    # forwards made Llama's fused training look 2.9 GB lighter where the loop peaked 7.4 GB heavier).
    drop_training_recordings(addresses)
    with unfused():
        step()  # the cotangents are made; the first call's workspaces are allocated
        peak_original = peak_bytes(step, device)
    if baseline is not None:  # held to the user's model's memory (its loss as before optimize)
        with unfused(), baseline():
            step()
            peak_original = peak_bytes(step, device)
    with fused():
        for _ in range(3):  # the sites' backward timings, dynamo's capture, the CUDA-graph recordings
            step()
        peak_fused = peak_bytes(step, device)
    t = timing.time_configs(step, {"original": unfused, "fused": fused}, device, iters=iters, rounds=ROUNDS)
    before, after = t["original"], t["fused"]
    option = Option("fused", None, after.median_ms, rounds_ms=tuple(after.rounds_ms))
    faster = shown_faster(before.median_ms, before.rounds_ms, option)
    lighter = peak_original is None or peak_fused <= peak_original * (1 + MEMORY_SLACK + max(allowed, 0.0))
    out = {"original_ms": round(before.median_ms, 4), "fused_ms": round(after.median_ms, 4),
           "margin_ms": round(margin_ms(before.median_ms, before.rounds_ms, option), 4),
           "peak_original_gb": _gb(peak_original), "peak_fused_gb": _gb(peak_fused),
           "kept": faster and lighter}
    held_to = " (the user's model, its loss as before)" if baseline is not None else ""
    numbers = (f"forward + backward {before.median_ms:.3f} -> {after.median_ms:.3f} ms"
               + (f", peak {_gb(peak_original)}{held_to} -> {_gb(peak_fused)} GB" if peak_original is not None else ""))
    if out["kept"]:
        out["decision"] = f"fused training kept: {numbers}"
    else:
        why = "not faster beyond noise" if not faster else "heavier in memory"
        out["decision"] = f"training runs the original forwards, fused training {why}: {numbers}"
        if faster and not lighter:  # the user may trade memory for it: say what it would take
            need = peak_fused / peak_original - 1 - MEMORY_SLACK
            out["decision"] += (f" (optimize(..., train=True, train_memory={math.ceil(round(need * 100, 6)) / 100:g}) "
                                "keeps it)")
    return out


def training_call(model: torch.nn.Module, args: tuple, kwargs: dict,
                  labels: torch.Tensor | None = None) -> Callable[[], None] | None:
    """A training call on the example inputs: forward, a scalar loss computed in float32 from every output
    that needs a gradient (its dot product with fixed random weights: those weights are the outputs'
    gradients), backward, the gradients it made (parameters', inputs') then set to None, as `zero_grad`
    does. None when no output needs one.

    Why a float32 loss and not a backward from the outputs' gradients directly: a real step's loss is
    computed in float32 (HF's causal LMs upcast the logits before cross-entropy), and those float32 copies,
    made while every activation is alive, are where eager's step peaks. Without them the check saw Llama's
    fused training 0.19 GB heavier (its recordings' saved tensors resident to the end of the backward) where
    the training loop measured it 0.59 GB lighter than eager (reports/train/fused-training-lighter-than-eager/).

    Where the model computes its own loss, the step is that loss's backward, as a training loop's is: from the
    labels among the caller's inputs, else from `labels` (a causal LM's input_ids, `workflows.lm_loss`: the
    fused LM loss where it kept it, no logits)."""
    leaves = [p for p in model.parameters() if p.requires_grad] + _grad_leaves((args, kwargs))
    kwargs = with_labels(model, args, kwargs, labels)
    with torch.enable_grad():
        out = _called(model, args, kwargs)
    if _own_loss(out) is not None:
        return labelled_step(model, args, kwargs, None, leaves)
    probe = _differentiable(out)
    del out
    if not probe:
        return None
    gen = torch.Generator(probe[0].device).manual_seed(0)
    cotangents = [torch.randn(t.shape, generator=gen, device=t.device, dtype=t.dtype) for t in probe]
    del probe

    def step() -> None:
        with torch.enable_grad():
            outs = _differentiable(_called(model, args, kwargs))
            loss = sum(_weighted(o, c) for o, c in zip(outs, cotangents))
            loss.backward()
            del loss, outs
        for t in leaves:
            t.grad = None
    return step


def labelled_step(model: torch.nn.Module, args: tuple, kwargs: dict, labels: torch.Tensor | None,
                  leaves: list) -> Callable[[], None]:
    """A training call of a model that computes its own loss: forward with labels (the caller's where its inputs
    carry them, else `labels`: `with_labels`), backward from the model's loss, then the leaves' gradients set to
    None as `zero_grad` does."""
    kwargs = with_labels(model, args, kwargs, labels)

    def step() -> None:
        with torch.enable_grad():
            _called(model, args, kwargs).loss.backward()
        for t in leaves:
            t.grad = None
    return step


def with_labels(model: torch.nn.Module, args: tuple, kwargs: dict, labels: torch.Tensor | None) -> dict:
    """The call's keyword arguments with `labels` added, unless the caller's inputs carry labels already (a
    training loop's inputs: it trains on those) or `labels` is None. Never a second value for the argument:
    Python refuses that call with a TypeError that names the model by its whole repr."""
    if labels is None or kwargs.get("labels") is not None or _labels_positional(model, args):
        return kwargs
    return {**kwargs, "labels": labels}


def _labels_positional(model: torch.nn.Module, args: tuple) -> bool:
    """Whether the positional arguments reach the forward's `labels` parameter."""
    if not args:
        return False
    try:
        return "labels" in inspect.signature(model.forward).bind_partial(*args).arguments
    except (TypeError, ValueError):  # no signature to read, or the arguments do not bind: nothing to tell
        return False


def _own_loss(out) -> torch.Tensor | None:
    """The loss a model's output carries (an HF model called with labels), where a backward can start from it."""
    loss = getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.requires_grad and loss.numel() == 1 else None


def _called(model: torch.nn.Module, args: tuple, kwargs: dict, labels: torch.Tensor | None = None):
    """`model(*args, **kwargs)` (with `labels=labels` where given) on a snapshot of them: the user's example, and
    labels that are its input_ids, stay as they are whatever the forward or its loss edits in place. The gradients
    of inputs that require one land on the snapshot's leaves."""
    args, kwargs = snapshot((args, with_labels(model, args, kwargs, labels)))
    return model(*args, **kwargs)


def _weighted(out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(out * weights) in float32 (a complex output: the real part of its product with the conjugate)."""
    if out.is_complex():
        return (out * weights.conj()).real.sum()
    return (out.float() * weights.float()).sum()


def _grad_leaves(inputs) -> list[torch.Tensor]:
    """The example inputs that collect a gradient (an encoder's output fed to a head, say)."""
    return [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]


def _differentiable(out) -> list[torch.Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


def _fused(handle, on: bool = True):
    @contextlib.contextmanager
    def state():
        handle.train_fused(on)
        yield
    return state


def peak_bytes(step: Callable[[], None], device: str) -> int | None:
    """Peak bytes allocated on the GPU over one `step()` (None off a GPU)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return agreed(torch.cuda.max_memory_allocated(), "peak memory")  # a rank's peak steers as its timings do


def _gb(n: int | None) -> float | None:
    return None if n is None else round(n / 2**30, 3)


@contextlib.contextmanager
def left_as_found(model: torch.nn.Module, input_leaves: list, device: str):
    """The comparison runs in training mode; afterwards modes, gradients (the parameters' and the inputs'),
    buffers and RNG are as before. FSDP2's modules are at rest on either side (`at_rest`): the parameters whose
    gradients are kept are the sharded ones its reduce-scatter writes, not the gathered copies a forward leaves."""
    at_rest(model)
    modes = {m: m.training for m in model.modules()}
    trainable = {p: p.requires_grad for p in model.parameters()}
    grads = {t: t.grad for t in [*model.parameters(), *input_leaves]}
    for t in grads:
        t.grad = None  # else the comparison's backward would accumulate into the user's gradients in place
    buffers = {b: b.detach().clone() for b in model.buffers()}
    devices = [torch.cuda.current_device()] if device == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        model.train()
        try:
            yield
        finally:
            at_rest(model)
            for m, training in modes.items():
                m.training = training
            for p, flag in trainable.items():
                p.requires_grad_(flag)
            for p, g in grads.items():
                p.grad = g
            with torch.no_grad():
                for b, saved in buffers.items():
                    b.copy_(saved)
