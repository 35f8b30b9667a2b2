"""Attention that ran SDPA's math backend, found in a GPU trace, and why, where the trace shows it.

SDPA runs a fused kernel (cuDNN's, FlashAttention, the memory-efficient one) when its inputs allow it, else its
math backend, which on CUDA writes the scores and probabilities out in fp32: two GEMMs without tensor cores, a
softmax and a dozen more kernels a call. The kernels launched under the op say which ran. Every fused kernel on
CUDA refuses an input whose last dimension is strided: where one is, that is the cause, and `optimize` lays the
input out (`advisor/patching/attention_layout.py`). Other causes (a dtype, a head size, a mask the fused kernels
do not take) do not show in a trace: said as not known.
"""
from __future__ import annotations

from advisor.graph.nodes import Graph
from advisor.ops.args import schema_of
from advisor.ops.registry import OpClass, fused_attention_refuses, is_fused_attention_kernel

MODULES_LISTED = 3  # per entry; the count says how many more


def math_attention(graph: Graph, iters: int) -> list[dict]:
    """analysis.json's `math_attention`: per (op, strided inputs), the calls per iteration that launched no fused
    attention kernel, their GPU time per iteration, kernels per call, modules, and the inputs whose last dimension
    is strided (name, shape, that stride; the cause where there are any: "layout", else "unknown"). Empty for a
    CPU trace (no kernels to read)."""
    found: dict[tuple, dict] = {}
    for n in graph.nodes:
        if n.cls != OpClass.ATTENTION or not n.kernels or any(map(is_fused_attention_kernel, n.kernels)):
            continue
        sch = schema_of(n.op, n.schema)
        names = [a.name for a in sch.arguments] if sch is not None else []
        strided = tuple((names[u.pos] if u.pos < len(names) else f"input {u.pos}", tuple(u.shape), u.strides[-1])
                        for u in n.reads if u.shape and u.strides and fused_attention_refuses(u.shape[-1], u.strides[-1]))
        e = found.setdefault((n.op, strided), {
            "op": n.op, "cause": "layout" if strided else "unknown", "calls": 0, "time_us": 0.0, "kernels": 0,
            "strided_inputs": [{"name": k, "shape": list(shape), "last_stride": st} for k, shape, st in strided],
            "modules": []})
        e["calls"] += 1
        e["time_us"] += n.time_us
        e["kernels"] += len(n.kernels)
        if n.module and n.module not in e["modules"]:
            e["modules"].append(n.module)
    out = []
    for e in sorted(found.values(), key=lambda e: -e["time_us"]):
        kernels, more = e.pop("kernels"), len(e["modules"]) - MODULES_LISTED
        out.append({**e, "kernels_per_call": kernels / e["calls"], "calls": e["calls"] / iters,
                    "time_us": e["time_us"] / iters,
                    "modules": e["modules"][:MODULES_LISTED] + ([f"+{more} more"] if more > 0 else [])})
    return out
