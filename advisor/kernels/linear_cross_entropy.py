"""Linear + cross-entropy for training, without the N x V logits (an LM head: N tokens, vocabulary V).

    loss = LinearCrossEntropyFunction.apply(hidden, weight, bias, labels, ignore_index, divisor)
    model = fused_causal_lm_loss(model)     # an HF causal LM computes its training loss this way

Eager computes logits = hidden @ weight^T (N x V, bf16), upcasts them to fp32 for the loss (HF's
`ForCausalLMLoss`), and keeps both plus the softmax's gradient for the backward: at N = 4096 tokens and
V = 128256 (Llama 3) that is 1 GB + 2 GB + 2 GB. Here (the approach of Liger-Kernel's fused linear
cross-entropy, written afresh) the rows go through in chunks, and each chunk's gradient is computed in
the forward, while its logits exist:

  for each chunk of C rows:                            (C x V logits: the only vocabulary-sized buffer)
      logits  = hidden[c] @ weight^T (+ bias)          cuBLAS, in the inputs' dtype
      `_loss_and_grad_kernel`, one program per row:    two passes over the row, fp32 throughout:
          lse = logsumexp(logits[r]); loss[r] = lse - logits[r, label]
          logits[r] <- (softmax(logits[r]) - onehot(label)) * scale      in place (bytes: the chunk read
                                                                          twice, written once)
      dhidden[c] = logits @ weight                     cuBLAS
      dweight   += logits^T @ hidden[c]                cuBLAS addmm_ in the weight's dtype (fp32 inside each chunk's
                                                       product, one rounding per chunk of the running sum: an fp32
                                                       accumulator would add V x D x 4 bytes, 2 GB at Llama 3's
                                                       vocabulary, plus a pass over it per chunk; Liger does the same)
      dbias     += column sums of logits
  backward: the stored gradients times the loss's incoming gradient (a scalar).

C is chosen so that a chunk's logits hold about as many elements as hidden (N x D), and at least 2048 rows
(`chunk_rows`): each chunk reads and writes the whole weight gradient once, which in chunks of a few hundred
rows cost more than eager's own loss (measured: `MIN_CHUNK_ROWS`).
`scale` is 1 / (number of labels that are not `ignore_index`) for a mean, or 1 / divisor (HF's
`num_items_in_batch`), read by the kernel from a device scalar: no host sync. Rows whose label is
`ignore_index` get loss 0 and gradient 0, as `F.cross_entropy(..., ignore_index=...)`.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import warnings
import weakref
from collections import OrderedDict
from typing import Callable

import torch
import triton
import triton.language as tl

from advisor.interpreter import interpret_on_cpu, runs_interpreted



@triton.jit
def _loss_and_grad_kernel(LOGITS, stride_row, LABELS, LOSS, SCALE, V, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride_row
    label = tl.load(LABELS + row).to(tl.int64)
    valid = label != ignore_index
    safe = tl.where(valid, label, 0)
    # pass 1: the row's logsumexp, online (running max m, sum s of exp(x - m)), in fp32
    m = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
    for v0 in range(0, V, BLOCK_V):
        rv = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(ptr + rv, mask=rv < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    x_label = tl.load(ptr + safe).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - x_label, 0.0))
    # pass 2: the gradient of this row's loss, written over its logits
    scale = tl.where(valid, tl.load(SCALE), 0.0)
    for v0 in range(0, V, BLOCK_V):
        rv = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(ptr + rv, mask=rv < V, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(rv == safe, 1.0, 0.0)) * scale
        tl.store(ptr + rv, g.to(LOGITS.dtype.element_ty), mask=rv < V)


interpret_on_cpu(_loss_and_grad_kernel)  # launched on CPU tensors: in Triton's interpreter


def loss_config(V: int, interpreted: bool = False) -> dict:
    """One row per program, BLOCK_V columns a step: 4096 fp32 per step (16 per thread at 8 warps)."""
    if interpreted:
        return dict(BLOCK_V=min(64, triton.next_power_of_2(V)), num_warps=4)
    return dict(BLOCK_V=min(4096, triton.next_power_of_2(V)), num_warps=8 if V >= 4096 else 4)


# Rows per chunk at least: each chunk adds its share to the weight gradient (V x D, read and written: 4·V·D
# bytes in bf16), so few large chunks keep that traffic small beside the chunk's three matmuls (6·C·D·V
# flops). H100, forward + backward of the head's loss (docs/EXPERIMENTS.md: lce_chunks):
# Llama's 4096 x 2048 x 32000 took 5.04 ms in chunks of 256 rows (eager 4.41), 2.86 ms in chunks of 2048;
# a Llama-3 vocabulary (128256) 18.3 ms in chunks of 256 (eager 17.5), 11.0 in chunks of 2048.
MIN_CHUNK_ROWS = 2048


def chunk_rows(N: int, V: int, D: int) -> int:
    """Rows per chunk, a power of two: the chunk's logits (C x V) about as many elements as hidden (N x D),
    but no fewer than `MIN_CHUNK_ROWS` rows (the weight gradient's accumulation), and no more than N."""
    per_chunk = triton.cdiv(N, triton.cdiv(V, D))
    return max(1, min(N, triton.next_power_of_2(max(per_chunk, MIN_CHUNK_ROWS))))


def padded_stride(V: int, itemsize: int) -> int:
    """V rounded up to 16 bytes of elements (the padded vocabulary the chunks' matmuls run at)."""
    per = max(1, 16 // itemsize)
    return (V + per - 1) // per * per


def linear_cross_entropy_forward(hidden, weight, bias, labels, ignore_index: int = -100, divisor=None,
                                 grads: tuple = (True, True, True)) -> tuple:
    """(loss, dhidden, dweight, dbias) for loss = cross_entropy(hidden @ weight^T + bias, labels), reduced
    as a mean over the labels that are not ignored, or as a sum divided by `divisor`. hidden N x D."""
    N, D = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    if divisor is None:
        count = (labels != ignore_index).sum()
        scale = 1.0 / count.clamp(min=1).to(torch.float32)  # a mean over no labels: eager's NaN would be 0/0
    else:
        scale = 1.0 / torch.as_tensor(divisor, dtype=torch.float32, device=dev)
    scale = scale.reshape(1).to(dev)
    losses = torch.empty(N, dtype=torch.float32, device=dev)
    dhidden = torch.empty_like(hidden) if grads[0] else None
    dweight = torch.zeros(V, D, dtype=weight.dtype, device=dev) if grads[1] else None
    dbias = torch.zeros(V, dtype=torch.float32, device=dev) if grads[2] and bias is not None else None
    C = chunk_rows(N, V, D)
    cfg = loss_config(V, runs_interpreted(dev))
    labels = labels.contiguous()
    # An unaligned vocabulary (GPT-2's 50257) is padded with zero rows of the weight to 16 bytes: cuBLAS's kernels
    # for unaligned sizes are several times slower (H100, GPT-2's head: 22 ms forward + backward in chunks, eager
    # 27). The padded columns' logits are 0 and stay 0 (the kernel reads and writes the first V only), so they
    # add nothing to dhidden; dweight's padded rows are dropped.
    Vp = padded_stride(V, weight.element_size())
    if Vp != V:
        weight = torch.nn.functional.pad(weight, (0, 0, 0, Vp - V))
        bias = None if bias is None else torch.nn.functional.pad(bias, (0, Vp - V))
        if dweight is not None:
            dweight = torch.zeros(Vp, D, dtype=weight.dtype, device=dev)
    buffer = torch.empty(min(C, N), Vp, dtype=hidden.dtype, device=dev)  # every chunk's logits
    for r0 in range(0, N, C):
        rows = hidden[r0:r0 + C]
        logits = buffer[:rows.shape[0]]
        if bias is None:
            torch.mm(rows, weight.t(), out=logits)
        else:
            torch.addmm(bias, rows, weight.t(), out=logits)
        _loss_and_grad_kernel[(rows.shape[0],)](logits, logits.stride(0), labels[r0:r0 + C], losses[r0:r0 + C],
                                                scale, V, ignore_index, **cfg)
        grad = logits  # overwritten in place: d loss / d logits of this chunk
        if dhidden is not None:
            torch.matmul(grad, weight, out=dhidden[r0:r0 + C])
        if dweight is not None:
            dweight.addmm_(grad.t(), rows)
        if dbias is not None:
            dbias += grad[:, :V].float().sum(0)
    loss = losses.sum() * scale[0]
    if dweight is not None and Vp != V:
        dweight = dweight[:V]  # (contiguous: the leading rows)
    return loss, dhidden, dweight, dbias.to(bias.dtype) if dbias is not None else None


class LinearCrossEntropyFunction(torch.autograd.Function):
    """forward(hidden N x D, weight V x D, bias V or None, labels N, ignore_index, divisor or None) -> loss.
    Saved for the backward: the gradients, computed in the forward (dhidden N x D, dweight V x D)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index=-100, divisor=None):
        needs = ctx.needs_input_grad[:3]
        loss, dh, dw, db = linear_cross_entropy_forward(hidden, weight, bias, labels, ignore_index, divisor, needs)
        ctx.save_for_backward(dh, dw, db)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dh, dw, db = ctx.saved_tensors
        scaled = [None if t is None else t * grad_loss.to(t.dtype) for t in (dh, dw, db)]
        return (*scaled, None, None, None)


def linear_cross_entropy_reference(hidden, weight, bias, labels, ignore_index: int = -100, divisor=None):
    """Eager: the logits, upcast to fp32 as HF does, then cross-entropy."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if divisor is None:
        return torch.nn.functional.cross_entropy(logits, labels, ignore_index=ignore_index)
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum") / divisor


# ------------------------------------------------------------------------------------------ HF causal LMs
class NotCausalLM(ValueError):
    """The model is not an HF causal LM with a base model and a linear head."""


def causal_lm_parts(model: torch.nn.Module) -> tuple:
    """(base model, linear head) of an HF causal LM (`...ForCausalLM`, `...LMHeadModel`): its base model
    (`base_model`: Llama's `model`, GPT-2's `transformer`) and its output embeddings (`lm_head`, tied or not).
    Raises NotCausalLM, or ValueError for a head whose logits its config says are changed after it. (A head
    that does more than the projection, BERT's LM transform, is told apart by `workflows.lm_loss`, which
    compares the fused loss with the model's own.)"""
    name = type(model).__name__
    config = getattr(model, "config", None)
    base = getattr(model, "base_model", None)
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if not name.endswith(("CausalLM", "LMHeadModel")) or config is None or not isinstance(head, torch.nn.Linear) \
            or not isinstance(base, torch.nn.Module) or base is model:
        raise NotCausalLM(f"{name}: not a causal LM with a base model and a linear head")
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) is not None:
        raise ValueError(f"{name}: its logits are changed after the projection")
    return base, head


def fused_causal_lm_loss(model: torch.nn.Module, output_type: type | None = None) -> torch.nn.Module:
    """Make an HF causal LM (`causal_lm_parts`: a base model and a linear head) compute its
    training loss through `LinearCrossEntropyFunction` (`CausalLMLossForward`). Refused (ValueError) for
    heads that change the logits after the projection (Gemma-2's final soft-capping, Cohere's logit
    scale): the loss would differ. `output_type`: the model's own output class (its fields kept, `logits`
    made lazy); HF's `CausalLMOutputWithPast` if None. `advisor.unpatch(model)` undoes it."""
    causal_lm_parts(model)
    model.forward = CausalLMLossForward(model, model.__dict__.get("forward"), output_type)
    return model


# A training call's arguments the fused loss handles: handed to the base model as they are, or read by the loss.
PASSED = frozenset({"input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "use_cache",
                    "cache_position", "output_attentions", "output_hidden_states", "token_type_ids", "labels",
                    "shift_labels", "num_items_in_batch", "return_dict", "logits_to_keep"})


def _autocast() -> bool:
    return torch.is_autocast_enabled() or torch.is_autocast_enabled("cpu")


class CausalLMLossForward:
    """The forward of an HF causal LM whose training loss skips the N x V logits: a call with `labels` (or
    `shift_labels`) while grad is enabled runs the base model, then the fused loss over its hidden states
    with HF's shifted labels (`ForCausalLMLoss`: position i predicts label i + 1, the last position ignored;
    `num_items_in_batch` divides a sum as HF does). Its output's `logits` are computed only if read
    (`LazyLogits`): as eager's, from the same hidden states, through the head, with autograd; a loop that
    never reads them never pays for them. Other calls (no labels, no grad, `return_dict=False`,
    `logits_to_keep`, positional arguments past input_ids, arguments outside `PASSED`, autocast: its head
    would run in bf16 where the chunks' matmuls, given out= buffers, would not) run the original forward.
    Holds its model weakly (no reference cycle keeps a deleted model's memory)."""

    def __init__(self, model: torch.nn.Module, saved=None, output_type: type | None = None):
        self._model = weakref.ref(model)
        self.saved = saved  # an instance-level forward it replaced (restored by `unpatch`), else None
        self.enabled = True  # False: every call runs the original forward (`workflows.lm_loss` times both)
        self.output_type = output_type  # the model's own output class (None: HF's CausalLMOutputWithPast)

    def remove(self) -> None:
        """Put the model's forward back as it was."""
        model = self.model
        if model.__dict__.get("forward") is self:
            if self.saved is not None:
                model.forward = self.saved
            else:
                del model.forward

    @property
    def model(self) -> torch.nn.Module:
        return self._model()

    def original(self):
        return self.saved if self.saved is not None else type(self.model).forward.__get__(self.model)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.original())

    def __call__(self, *args, **kwargs):
        labels, shift_labels = kwargs.get("labels"), kwargs.get("shift_labels")
        # (positional arguments past input_ids: the base model's forward may order them differently; arguments
        # outside `PASSED` may change the loss, a mixture of experts' router loss say)
        if labels is None and shift_labels is None or not torch.is_grad_enabled() or kwargs.get("logits_to_keep") \
                or kwargs.get("return_dict") is False or len(args) > 1 or not self.enabled or kwargs.keys() - PASSED \
                or _autocast():
            return self.original()(*args, **kwargs)
        loss, hidden, out = self.loss(*args, **kwargs)
        head = self.model.get_output_embeddings()
        return lazy_logits_type(self.output_type).of(loss, lambda: head(hidden), out, (head.weight,))

    def loss(self, *args, **kwargs) -> tuple:
        """(the fused loss, the base model's hidden states, its output) of a call with labels."""
        base, head = causal_lm_parts(self.model)
        labels, shift_labels = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
        for name in ("logits_to_keep", "return_dict"):
            kwargs.pop(name, None)
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        out = base(*args, **kwargs)
        hidden = out.last_hidden_state
        if shift_labels is None:
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        loss = LinearCrossEntropyFunction.apply(hidden.reshape(-1, hidden.shape[-1]), head.weight, head.bias,
                                                shift_labels.reshape(-1).to(hidden.device), -100, num_items_in_batch)
        return loss, hidden, out

    def __deepcopy__(self, memo):
        new = CausalLMLossForward(copy.deepcopy(self.model, memo), copy.deepcopy(self.saved, memo), self.output_type)
        new.enabled = self.enabled
        return new

    def __reduce__(self):
        return (CausalLMLossForward, (self.model, self.saved, self.output_type), {"enabled": self.enabled})

    def __setstate__(self, state: dict) -> None:
        self.enabled = state.get("enabled", True)


@functools.cache
def lazy_logits_type(output_type: type | None = None) -> type:
    """`LazyLogits` over the model's own output class (`output_type`, HF's `CausalLMOutputWithPast` if None):
    one made per class, at first use (transformers is imported only where an HF causal LM trains)."""
    if output_type is None:
        from transformers.modeling_outputs import CausalLMOutputWithPast as output_type

    @dataclasses.dataclass
    class LazyLogits(output_type):
        """HF's causal-LM output whose `logits` are computed at their first read (attribute, key, index,
        iteration), in the grad mode of the call that made it: what eager's forward would have returned. Until
        then it holds the base model's hidden states (N x D), where eager's output held the N x V logits."""

        @classmethod
        def of(cls, loss, make_logits, base_out, weights: tuple = ()) -> "LazyLogits":
            # the base model's outputs under the names this output has (its cache, hidden states, attentions)
            kept = {f.name: OrderedDict.get(base_out, f.name) for f in dataclasses.fields(cls)
                    if f.name not in ("loss", "logits")}
            out = cls(loss=loss, logits=None, **{k: v for k, v in kept.items() if v is not None})
            grad = torch.is_grad_enabled()
            versions = [w._version for w in weights]

            def make():
                if [w._version for w in weights] != versions:  # an optimizer step since: eager's are gone
                    warnings.warn("fusion-advisor: logits of a causal LM trained with the fused loss were read after "
                                  "its head's weights changed (an optimizer step): computed with the new weights. "
                                  "Read them before the step for eager's values.", RuntimeWarning, stacklevel=4)
                with torch.set_grad_enabled(grad):
                    return make_logits()
            object.__setattr__(out, "_make_logits", make)
            return out

        def _materialize(self) -> None:
            make = self.__dict__.pop("_make_logits", None)
            if make is None:
                return
            logits = make()
            OrderedDict.__setitem__(self, "logits", logits)
            object.__setattr__(self, "logits", logits)
            for f in dataclasses.fields(self):  # in field order, as eager's output has them (loss, logits, ...)
                if OrderedDict.__contains__(self, f.name):
                    self.move_to_end(f.name)

        def __getattribute__(self, name):
            if name == "logits":
                OrderedDict.__getattribute__(self, "_materialize")()
            return super().__getattribute__(name)

        def __getitem__(self, k):
            if k == "loss" or k == 0:
                return OrderedDict.__getitem__(self, "loss")
            self._materialize()
            return super().__getitem__(k)

    # Every way of reading the output whole (its keys, values, length, tuple) computes the logits first.
    for name in ("keys", "values", "items", "__iter__", "__len__", "to_tuple"):
        setattr(LazyLogits, name, _materializing(getattr(output_type, name)))
    return LazyLogits


def _materializing(method: Callable) -> Callable:
    @functools.wraps(method)
    def read(self, *args, **kwargs):
        self._materialize()
        return method(self, *args, **kwargs)
    return read
