"""Attention whose mask a captured graph builds from positions alone, and which is exactly causal, runs as
causal attention with no mask (`is_causal=True`); one that allows every key runs with no mask at all.

Why: HF decides outside a capture that a call with no padding needs no mask (`is_causal=True`, cuDNN's and
FlashAttention's fast causal kernels), but while dynamo traces it cannot look at values, so it builds the
mask from `arange`s (HF's `masking_utils`: `is_torchdynamo_compiling()`), and the attention runs with a
B x 1 x L x S mask tensor. On the H100 the suite's Llama with its whole decoder stack captured ran its
attention in 3.4 ms a training step with that mask against 1.4 ms causal (torch.compile's 3.4 ms too:
reports/train).

A mask is folded only when nothing it is computed from comes from outside the graph (no placeholder: no
input, no parameter or buffer, no padding mask from the caller's `attention_mask`) and nothing draws random
numbers: it is then the same tensor on every call the graph serves (dynamo's guards hold the shapes). It is
computed once, here, and compared with the causal mask of SDPA's `is_causal` (query i sees keys 0..i, top-left
aligned) over its whole broadcast shape: a boolean mask must be True exactly there, a float mask 0 there and
at most `BLOCKED` elsewhere. A mask True (0) everywhere, as an encoder's without padding (HF builds it while
tracing too), is dropped. Anything else (a sliding window, packed sequences, a bias) is left as it was.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import GraphModule, Node

from advisor.ops.registry import ATTENTION_CAUSAL, ATTENTION_MASKS, OpClass, draws_random, op_class
from advisor.patching.match import node_arg, op_name, set_node_arg

# A float mask's entry at most this blocks its key: softmax weighs it exp(-1e4) = 0 in every float type, as the
# kernel's own causal masking does (HF writes its dtype's lowest value, or float16's: -65504, -65536 in bfloat16).
BLOCKED = -1e4
# Masks of more elements are not computed to be checked (4 x 8192 x 8192, 0.5 GB in bfloat16): a capture must
# not run out of memory for a check; such a mask stays as it is.
MAX_ELEMENTS = 2**28


def fold_causal_masks(gm: GraphModule) -> int:
    """Run the attentions of `gm` whose mask is a constant causal one as causal attention without the mask,
    and those whose mask is constant and allows every key without it (see the module's docstring); returns
    how many."""
    folded = 0
    verdicts: dict[Node, bool] = {}  # one mask is usually shared by every layer's attention
    for n in list(gm.graph.nodes):
        slots = _slots(n)
        if slots is None:
            continue
        mask_at, causal_at = slots
        mask = node_arg(n, *mask_at)
        if not isinstance(mask, Node) or node_arg(n, *causal_at):
            continue
        if mask not in verdicts:
            try:  # real tensors (a backend may be called inside its trace's fake mode)
                with torch.no_grad(), unset_fake_temporarily():
                    verdicts[mask] = _kind(mask, _query_key_lengths(n))
            except Exception:  # an op that does not run outside its trace: the mask stays as it is
                verdicts[mask] = None
        if verdicts[mask] is not None:
            set_node_arg(n, *mask_at, None)
            if verdicts[mask] == "causal":
                set_node_arg(n, *causal_at, True)
            folded += 1
    if folded:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return folded


def _slots(n: Node) -> tuple | None:
    """((index, name) of the mask argument, (index, name) of `is_causal`) of an attention op that takes both."""
    name = op_name(n)
    if name is None or name == "getitem" or op_class(name.split(".")[0]) != OpClass.ATTENTION:
        return None
    args = n.target._schema.arguments
    where = {a.name: (i, a.name) for i, a in enumerate(args)}
    mask = next((where[m] for m in ATTENTION_MASKS if m in where), None)
    causal = where.get(ATTENTION_CAUSAL)
    return None if mask is None or causal is None else (mask, causal)


def _query_key_lengths(n: Node) -> tuple[int, int] | None:
    """(L, S) from the query's and the key's fake values (their second-to-last dims)."""
    try:
        q, k = (a.meta["val"] for a in n.args[:2])
        return int(q.shape[-2]), int(k.shape[-2])
    except (KeyError, AttributeError, TypeError, IndexError):
        return None


def _kind(mask: Node, lengths: tuple[int, int] | None) -> str | None:
    """"causal" (SDPA's `is_causal`), "none" (every key allowed: no mask at all) or None (keep the mask)."""
    if lengths is None:
        return None
    fake = mask.meta.get("val")
    if not isinstance(fake, torch.Tensor) or fake.numel() > MAX_ELEMENTS:
        return None
    value = _constant(mask)
    if value is None or value.dim() < 2 or tuple(value.shape[-2:]) != lengths:
        return None
    if value.dtype == torch.bool:
        allowed = value
    elif value.is_floating_point():
        allowed = value == 0
        if not bool((allowed | (value <= BLOCKED)).all()):  # a bias, not a mask
            return None
    else:
        return None
    if bool(allowed.all()):
        return "none"
    causal = torch.ones(lengths, dtype=torch.bool, device=value.device).tril()
    return "causal" if bool((allowed == causal).all()) else None


def _constant(mask: Node) -> torch.Tensor | None:
    """The mask's value, where the nodes it is computed from read nothing from outside the graph; else None."""
    order, seen, stack = [], set(), [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op != "call_function":  # a placeholder (an input, a parameter, a buffer) or get_attr
            return None
        name = op_name(n)
        if name is None or (name != "getitem" and draws_random(name)):
            return None
        order.append(n)
        stack.extend(n.all_input_nodes)
    values: dict[Node, object] = {}
    index = {n: i for i, n in enumerate(mask.graph.nodes)}
    for n in sorted(order, key=index.__getitem__):
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), values.__getitem__)
        values[n] = n.target(*args, **kwargs)
    value = values[mask]
    return value if isinstance(value, torch.Tensor) else None
