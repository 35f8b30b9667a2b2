"""Attention that SDPA would run on its math backend only because of an input's layout gets that input laid out.

Why: PyTorch's fused attention kernels on CUDA (cuDNN's, FlashAttention, the memory-efficient one) take only
tensors whose last dimension has stride 1. Handed any other, SDPA runs its math backend, which on CUDA writes
the B x H x L x S scores and probabilities out in fp32: two fp32 GEMMs and a softmax per layer. T5 in
transformers 5.17 hands SDPA such a mask (the position bias, permuted from the embedding's layout, through a
`torch.where` that keeps that layout): its 12-layer encoder at 32 x 512 spent 13.8 of 19.8 ms a call there, and
torch.compile keeps the math decomposition (reports/users-sizes). A contiguous copy of the input (the same
values) lets SDPA choose a fused kernel: the mask is written once, read once, and the scores never leave it.

The rewrite is made on dynamo's graph, before AOTAutograd decomposes the attention into the backend SDPA chooses
there, so every route gets the fused kernel: our replay, Inductor's around our kernels, and the dynamic-shape
compile of calls past the capture budget (`any_shape`; symbolic sizes are judged at the sizes traced). It is made
only where SDPA's own choice, asked on tensors of the graph's layouts, is the math backend and becomes a fused one
once the inputs are laid out; on the CPU (whose flash kernel takes strided masks) nothing changes.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import GraphModule, Node

from advisor.ops.registry import OpClass, fused_attention_refuses, op_class, torch_function_op
from advisor.patching.match import node_arg, set_node_arg, size_hint, traced_value

# SDPA's arguments that are tensors a kernel reads (`attn_mask` may be None)
TENSORS = ("query", "key", "value", "attn_mask")
# SDPA's scalar arguments its backend choice depends on
SCALARS = ("dropout_p", "is_causal", "scale", "enable_gqa")


def lay_out_attention_inputs(gm: GraphModule, math_only_for_layout: Callable | None = None) -> list[str]:
    """Insert a contiguous copy before each attention input whose layout alone sends SDPA to its math backend
    (`math_only_for_layout(tensors, scalars, strided)`, by default SDPA's own choice asked on the device);
    returns one line per input laid out, saying which and why."""
    decide = math_only_for_layout or sdpa_math_only_for_layout
    notes = []
    for n in list(gm.graph.nodes):
        name = torch_function_op(n.target) if n.op == "call_function" else None
        if name is None or op_class(name) != OpClass.ATTENTION:
            continue
        schema = getattr(torch.ops.aten, name.split("::")[1]).default._schema
        where = {a.name: i for i, a in enumerate(schema.arguments)}
        if any(k not in where for k in (*TENSORS, *SCALARS)):
            continue  # a backend's own op, called directly: its layouts are the caller's choice
        args = {a: node_arg(n, where[a], a, schema) for a in (*TENSORS, *SCALARS)}
        tensors = {k: traced_value(args[k]) for k in TENSORS if args[k] is not None}
        if any(v is None for v in tensors.values()) or any(isinstance(args[k], Node) for k in SCALARS):
            continue  # a value not known while tracing: left as it was
        strided = [k for k, v in tensors.items() if _refused(v)]
        if not strided or not decide(tensors, {k: args[k] for k in SCALARS}, strided):
            continue
        for k in strided:
            with gm.graph.inserting_before(n):
                laid = gm.graph.call_method("contiguous", (args[k],))
            fake = tensors[k]
            mode = getattr(fake, "fake_mode", None)
            if mode is not None:
                with mode:
                    laid.meta["example_value"] = fake.contiguous()
            set_node_arg(n, where[k], k, laid)
            notes.append(f"attention's {k} {tuple(fake.shape)} laid out contiguously (its last dim had stride "
                         f"{fake.stride(-1)}): SDPA's fused kernels refuse it and ran the math backend, scores in fp32")
    if notes:
        gm.recompile()
    return notes


def sdpa_math_only_for_layout(tensors: dict, scalars: dict, strided: list) -> bool:
    """SDPA's backend choice (`torch._fused_sdp_choice`) on empty tensors of the graph's shapes, strides and grad
    flags on its device, in the grad mode of the call being captured: the math backend as they are, a fused kernel
    with `strided` laid out contiguously. Never on the CPU, where the fused kernel takes strided inputs and a copy
    would only cost, nor where the question cannot be asked (no memory for the empty tensors: the graph is left
    as it is)."""
    from torch.nn.attention import SDPBackend

    sizes = {k: ([size_hint(s) for s in v.shape], [size_hint(s) for s in v.stride()]) for k, v in tensors.items()}
    if any(v.device.type != "cuda" for v in tensors.values()) or any(
            s is None for shape, stride in sizes.values() for s in (*shape, *stride)):
        return False
    math = SDPBackend.MATH.value

    def choice(t):
        return torch._fused_sdp_choice(t["query"], t["key"], t["value"], t.get("attn_mask"), scalars["dropout_p"],
                                       scalars["is_causal"], scale=scalars["scale"], enable_gqa=scalars["enable_gqa"])

    try:
        with unset_fake_temporarily():
            real = {k: torch.empty_strided(*sizes[k], dtype=v.dtype, device=v.device).requires_grad_(v.requires_grad)
                    for k, v in tensors.items()}
            if choice(real) != math:
                return False
            return choice({k: (t.contiguous() if k in strided else t) for k, t in real.items()}) != math
    except (RuntimeError, ValueError):  # out of memory for the question, or an argument SDPA itself refuses
        return False


def _refused(v: torch.Tensor) -> bool:
    """Whether `v`'s last dimension alone keeps SDPA's fused kernels off (`registry.fused_attention_refuses`)."""
    if not v.dim():
        return False
    size, stride = size_hint(v.size(-1)), size_hint(v.stride(-1))
    return size is not None and stride is not None and fused_attention_refuses(size, stride)
