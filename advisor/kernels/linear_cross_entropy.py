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

C is chosen so that a chunk's logits hold about as many elements as hidden (N x D): the buffer is then
no bigger than the activations already held, and the chunk's matmuls stay large enough for the tensor cores.
`scale` is 1 / (number of labels that are not `ignore_index`) for a mean, or 1 / divisor (HF's
`num_items_in_batch`), read by the kernel from a device scalar: no host sync. Rows whose label is
`ignore_index` get loss 0 and gradient 0, as `F.cross_entropy(..., ignore_index=...)`.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


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


def loss_config(V: int) -> dict:
    """One row per program, BLOCK_V columns a step: 4096 fp32 per step (16 per thread at 8 warps)."""
    if _INTERPRET:
        return dict(BLOCK_V=min(64, triton.next_power_of_2(V)), num_warps=4)
    return dict(BLOCK_V=min(4096, triton.next_power_of_2(V)), num_warps=8 if V >= 4096 else 4)


def chunk_rows(N: int, V: int, D: int) -> int:
    """Rows per chunk: the chunk's logits (C x V) about as many elements as hidden (N x D), a power of two."""
    per_chunk = triton.cdiv(N, triton.cdiv(V, D))
    return max(1, min(N, triton.next_power_of_2(per_chunk)))


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
    cfg = loss_config(V)
    labels = labels.contiguous()
    for r0 in range(0, N, C):
        rows = hidden[r0:r0 + C]
        logits = rows @ weight.t() if bias is None else torch.addmm(bias, rows, weight.t())
        _loss_and_grad_kernel[(rows.shape[0],)](logits, logits.stride(0), labels[r0:r0 + C], losses[r0:r0 + C],
                                                scale, V, ignore_index, **cfg)
        grad = logits  # overwritten in place: d loss / d logits of this chunk
        if dhidden is not None:
            torch.matmul(grad, weight, out=dhidden[r0:r0 + C])
        if dweight is not None:
            dweight.addmm_(grad.t(), rows)
        if dbias is not None:
            dbias += grad.float().sum(0)
    loss = losses.sum() * scale[0]
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
def fused_causal_lm_loss(model: torch.nn.Module) -> torch.nn.Module:
    """Make an HF causal LM (`...ForCausalLM`: a base model `model.model`, a linear `lm_head`) compute its
    training loss through `LinearCrossEntropyFunction`: a call with `labels` while grad is enabled runs the
    base model, then the fused loss over its hidden states with HF's shifted labels (`ForCausalLMLoss`:
    position i predicts label i + 1, the last position ignored; `num_items_in_batch` divides a sum as HF
    does) and returns the loss with `logits=None` (never computed). Other calls run the original forward.
    Refused (ValueError) for heads that change the logits after the projection (Gemma-2's final
    soft-capping, Cohere's logit scale): the loss would differ. `del model.forward` undoes it."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    config = getattr(model, "config", None)
    head, base = getattr(model, "lm_head", None), getattr(model, "model", None)
    if not isinstance(head, torch.nn.Linear) or base is None or config is None:
        raise ValueError(f"{type(model).__name__}: not a causal LM with a base `model` and a linear `lm_head`")
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) is not None:
        raise ValueError(f"{type(model).__name__}: its logits are changed after the projection")
    original = model.forward

    def forward(*args, **kwargs):
        labels, shift_labels = kwargs.get("labels"), kwargs.get("shift_labels")
        if labels is None and shift_labels is None or not torch.is_grad_enabled() or kwargs.get("logits_to_keep"):
            return original(*args, **kwargs)
        for name in ("labels", "shift_labels", "logits_to_keep"):
            kwargs.pop(name, None)
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        out = base(*args, **kwargs)
        hidden = out.last_hidden_state
        if shift_labels is None:
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        loss = LinearCrossEntropyFunction.apply(hidden.reshape(-1, hidden.shape[-1]), head.weight, head.bias,
                                                shift_labels.reshape(-1).to(hidden.device), -100, num_items_in_batch)
        return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=getattr(out, "hidden_states", None),
                                      attentions=getattr(out, "attentions", None))

    model.forward = forward
    return model
