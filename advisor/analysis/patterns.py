"""Canonical pattern signatures (so one chain in 32 layers is one pattern) and names in words."""
from __future__ import annotations

import hashlib
import re
from enum import Enum
from typing import Iterator

from advisor.analysis.alignment import unaligned_gemm
from advisor.analysis.fusion import Group
from advisor.graph.nodes import Graph, Node, per_template
from advisor.graph.dtypes import short as short_dtype
from advisor.ops.registry import lookup, tagged


def signature(graph: Graph, group: Group) -> str:
    """Op kinds + dataflow shape + dtypes + shape classes; exact sizes left out except the row width class."""
    return next(signatures(graph, [group]))


def signatures(graph: Graph, groups: list[Group]) -> Iterator[str]:
    """`signature` of each group, one at a time. What a node contributes apart from its dataflow (label,
    operand dtypes and shape classes, scalars, output) is worked out once per node template: layers repeat."""
    node_part = per_template(_node_part)
    values = graph.values
    for group in groups:
        local = {m: i for i, m in enumerate(group.members)}
        ext: dict[int, int] = {}
        parts = []
        for m in group.members:
            n = graph.nodes[m]
            label, operands, scalars, out_s = node_part(n)
            srcs = []
            for u, operand in zip(n.reads, operands):
                p = values[u.value].producer
                if p in local:
                    srcs.append(f"%{local[p]}")
                else:
                    k = ext.setdefault(u.value, len(ext))
                    srcs.append(f"in{k}:{operand}")
            parts.append(f"{label}({','.join(srcs + scalars)})->{out_s}")
        rows = f"|rows:N{_bucket(group.rows[1])}" if group.rows else ""
        kind = f"|{group.kind}" if group.kind != "fusion" else ""
        if group.kind == "padded_matmul":  # its sizes decide the padding: two unaligned GEMMs are two patterns
            pad = unaligned_gemm(graph.nodes[group.members[0]])
            kind += f"|M{pad.m}N{pad.n}K{pad.k}B{pad.batch}"
        yield "; ".join(parts) + rows + kind


def _node_part(n: Node) -> tuple[str, list[str], list[str], str]:
    """(label, dtype + shape class of each tensor read, scalar arguments, output dtype + shape class)."""
    operands = [f"{short_dtype(u.dtype)}{_shape_class(u.shape, u.strides)}" for u in n.reads]
    scalars = [repr(v) for kind, v in n.args if kind == "s" and isinstance(v, (int, float, str, bool))]
    out = n.writes[0] if n.writes else None
    out_s = f"{short_dtype(out.dtype)}{_shape_class(out.shape, out.strides)}" if out else "-"
    return op_label(n), operands, scalars, out_s


_FLOAT = re.compile(r"(?<=[,(])-?(?:\d+\.\d*(?:e[-+]?\d+)?|\d+e[-+]?\d+|inf|nan)(?=[,)])")
_CLASS = re.compile(r"\[([^\]]*)\]")


def family(sig: str) -> str:
    """What makes two pure pointwise chains one candidate: their signature less float constants and, when every
    operand is the same shape (no broadcast), less the rank. An optimizer's update runs once per parameter shape
    with a step size that changes every step; that is one chain, not one candidate per shape and step. (The
    generated kernel is the first occurrence's; the patcher's guards keep it off the others' shapes and
    constants.) Row groups, epilogues and attention keep their exact signature."""
    if "|" in sig:
        return sig
    if all(set(c) <= {"n"} for c in _CLASS.findall(sig)):
        sig = _CLASS.sub(lambda m: "[n]" if m.group(1) else "[]", sig)
    return _FLOAT.sub("f", sig)


def pattern_id(sig: str) -> str:
    return hashlib.sha1(sig.encode()).hexdigest()[:12]


def op_label(n: Node) -> str:
    """Short op name in words: `_to_copy` to fp32 reads as to_fp32, clamp_min(0) as relu."""
    info = lookup(n.op)
    name = info.short if info else n.op.split("::")[-1]
    if name in ("_to_copy", "copy_", "copy", "to") and n.writes:
        src = n.reads[-1].dtype if n.reads else ""
        if src != n.writes[0].dtype:
            return f"to_{short_dtype(n.writes[0].dtype)}"
    if name in ("clamp_min", "clamp_min_") and any(kind == "s" and v in (0, 0.0) for kind, v in n.args):
        return "relu"
    return name


def _labels(graph: Graph, group: Group) -> list[str]:
    # An epilogue reads anchor-first, whatever the execution order of the ops it absorbs.
    return [op_label(graph.nodes[m]) for m in sorted(group.members, key=lambda m: (m != group.anchor, m))]


def group_family(graph: Graph, group: Group) -> Family:
    return family_of(_labels(graph, group), group)


TITLE_OPS = 12  # ops a title spells out: RWKV's recurrence, unrolled over the sequence, is one chain of ~400


def title(graph: Graph, group: Group, occurrences: list[Group] | None = None) -> str:
    """`Name: op → op → op`. An epilogue names the projection(s) whose matmul anchors it, over `occurrences`
    (default: `group` alone): Llama's gate and up SwiGLU epilogues are two patterns that read alike otherwise."""
    labels = _labels(graph, group)
    chain = " → ".join(labels if len(labels) <= TITLE_OPS else
                       [*labels[:TITLE_OPS - 3], f"… {len(labels) - TITLE_OPS + 1} more …", *labels[-2:]])
    name = padded_name(graph, group, occurrences or [group]) if group.kind == "padded_matmul" else _name(labels, group)
    if group.kind == "epilogue" and group.anchor is not None:
        where = projections(graph, occurrences or [group])
        if where:
            name = f"{name[:-1]}, {where})" if name.endswith(")") else f"{name} ({where})"
    return f"{name}: {chain}"


def padded_name(graph: Graph, group: Group, occurrences: list[Group]) -> str:
    """`GEMM with unaligned N=50257 → 50264, padded (lm_head)`: what is padded, and where."""
    pad = unaligned_gemm(graph.nodes[group.members[0]])
    what = f"unaligned {pad.padded_dims}" if pad.padded_dims else f"unaligned {'/'.join(pad.unaligned)} layout"
    where = projections(graph, [Group(g.members, g.numel, anchor=g.members[0]) for g in occurrences])
    return f"GEMM with {what}, padded" + (f" ({where})" if where else "")


def projections(graph: Graph, groups: list[Group], limit: int = 3) -> str:
    """The anchors' module names, without the layer path: `gate_proj`, `conv1/conv2`, `c_fc`; "" when unknown."""
    names = []
    for g in groups:
        path = graph.nodes[g.anchor].module if g.anchor is not None else None
        if path:
            names.append(_leaf(path))
    names = list(dict.fromkeys(names))
    return "/".join(names[:limit]) + (f"/+{len(names) - limit}" if len(names) > limit else "")


def _leaf(path: str) -> str:
    """`Llama.model.layers.0.mlp.gate_proj` -> `gate_proj`; an index keeps its parent: `Sequential.0`."""
    parts = path.split(".")
    tail = parts[-1]
    return ".".join(parts[-2:]) if tail.isdigit() and len(parts) > 1 else tail


class Family(str, Enum):
    """What a group computes, decided once from its ops (`family_of`): the candidate's kind and its title's
    name both read it, never each other's text."""

    ATTENTION = "attention"
    MATMUL_REDUCTION = "matmul_reduction"
    PADDED_MATMUL = "padded_matmul"
    EPILOGUE = "epilogue"
    RMSNORM = "rmsnorm"
    LAYERNORM = "layernorm"
    GROUPNORM = "groupnorm"
    SOFTMAX = "softmax"
    LOG_SOFTMAX = "log_softmax"
    BATCHNORM = "batchnorm"
    ADAM = "adam"
    SWIGLU = "swiglu"
    GELU = "gelu"
    ROTARY = "rotary"
    CAT = "cat"
    ROWS = "rows"
    POINTWISE = "pointwise"


NORMS = frozenset({Family.RMSNORM, Family.LAYERNORM, Family.GROUPNORM, Family.BATCHNORM})


def _any(s: set, tag: str) -> bool:
    """Whether any of the op labels `s` (names without the namespace) carries the registry's `tag`."""
    return any(tagged(f"aten::{label}", tag) for label in s)


def family_of(labels: list[str], group: Group) -> Family:
    """The family of a group whose ops read `labels` (in `title`'s order: an epilogue's anchor first)."""
    if group.kind == "attention":
        return Family.ATTENTION
    if group.kind == "matmul_reduction":
        return Family.MATMUL_REDUCTION
    if group.kind == "padded_matmul":
        return Family.PADDED_MATMUL
    if group.anchor is not None:
        return Family.EPILOGUE
    s = set(label.rstrip("_") for label in labels)
    rules = [({"mean", "rsqrt"} <= s, Family.RMSNORM), (_any(s, "layer_norm"), Family.LAYERNORM),
             (_any(s, "grouped"), Family.GROUPNORM),
             (_any(s, "softmax") or {"amax", "exp", "sum"} <= s, Family.SOFTMAX),
             (_any(s, "log_softmax"), Family.LOG_SOFTMAX), (_any(s, "batchnorm"), Family.BATCHNORM),
             ({"addcdiv", "lerp"} <= s or {"addcdiv", "addcmul"} <= s, Family.ADAM),
             ("silu" in s and "mul" in s, Family.SWIGLU), ("gelu" in s or {"tanh", "pow"} <= s, Family.GELU),
             ("cat" in s and "neg" in s, Family.ROTARY), ("cat" in s, Family.CAT), (bool(group.rows), Family.ROWS)]
    return next((f for hit, f in rules if hit), Family.POINTWISE)


def _name(labels: list[str], group: Group) -> str:
    pools = {label for label in labels if tagged(f"aten::{label}", "window")}
    if pools:  # a window op ends its chain (fusion rule 11): the chain, then the pool
        rest = [label for label in labels if label not in pools]
        return (_name(rest, group) + " + max-pool") if rest else "max-pool"
    fam = family_of(labels, group)
    s = set(label.rstrip("_") for label in labels)
    prefix = "Residual add + " if labels and labels[0].rstrip("_") == "add" and group.rows else ""
    if fam is Family.EPILOGUE:
        # labels[0] is the anchor (see title); name what it absorbs the same way as a plain group.
        rest = labels[1:]
        inner = _name(rest, Group(group.members[1:], group.numel, group.rows)) if len(rest) > 1 else \
            _SINGLE.get(rest[0].rstrip("_"), rest[0]) if rest else "pointwise"
        return f"{labels[0]} epilogue ({inner})"
    if fam is Family.MATMUL_REDUCTION:
        return f"Matmul + reduction ({labels[-1]} over {labels[0]} output)"
    if fam is Family.SOFTMAX:
        return "Softmax" + (" + mask/scale" if s & {"add", "mul", "div", "masked_fill"} else "")
    if fam is Family.BATCHNORM:
        return "BatchNorm" + (" + residual add" if "add" in s else "") + (" + ReLU" if "relu" in s else "")
    if fam is Family.GELU:
        return "GELU" + (" + residual" if "add" in s and "gelu" in s else "")
    if fam is Family.GROUPNORM:  # a diffusion UNet's GroupNorm + SiLU
        return prefix + "GroupNorm" + "".join(f" + {_SINGLE[a]}" for a in ("silu", "gelu", "relu") if a in s)
    return (prefix if fam in (Family.RMSNORM, Family.LAYERNORM) else "") + _FAMILY_NAME[fam]


_FAMILY_NAME = {Family.ATTENTION: "Attention (unfused: scores materialised)", Family.RMSNORM: "RMSNorm",
                Family.LAYERNORM: "LayerNorm", Family.LOG_SOFTMAX: "LogSoftmax", Family.ADAM: "Adam/AdamW update",
                # exp_avg.lerp_, exp_avg_sq.mul_.addcmul_, sqrt, div, param.addcdiv_
                Family.SWIGLU: "SwiGLU", Family.ROTARY: "Rotary embedding", Family.CAT: "Pointwise + cat",
                Family.ROWS: "Row reduction chain", Family.POINTWISE: "Pointwise chain"}


_SINGLE = {"gelu": "GELU", "silu": "SiLU", "relu": "ReLU", "tanh": "tanh", "sigmoid": "sigmoid", "add": "bias/residual add",
           "mul": "scale", "div": "scale", "cudnn_batch_norm": "BatchNorm", "batch_norm": "BatchNorm",
           "_native_batch_norm_legit_no_training": "BatchNorm", "hardswish": "hardswish"}


def _shape_class(shape, strides) -> str:
    if not shape:
        return "[]"
    marks = []
    for d, st in zip(shape, strides or [1] * len(shape)):
        marks.append("1" if d == 1 else ("b" if st == 0 else "n"))
    return "[" + "".join(marks) + "]"


def _bucket(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b
