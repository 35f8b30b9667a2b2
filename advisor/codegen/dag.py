"""The expression DAG a kernel body is printed from: loads, index arithmetic, ops, row reductions.

Nodes are hash-consed, so the same load or the same subexpression is computed once per kernel
(or once per pass of a looped row kernel). `full` marks nodes that vary along the block (the flat
offsets of a pointwise kernel, the columns of a row kernel); the others are per program scalars.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from advisor.ops.lowering import lit, tl_type

INDEX = None  # dtype of index arithmetic: whatever the offsets are (int32, or int64 for big tensors)


def opmath(dtype: torch.dtype) -> torch.dtype:
    """The dtype ATen computes a dtype's ops in: fp32 for bf16/fp16, the dtype itself otherwise."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


@dataclass(eq=False)
class Node:
    kind: str  # var | arg | lit | op | cast | load | reduce
    fmt: str  # op: a format over the inputs' expressions; var/arg/lit: the text itself
    inputs: tuple
    dtype: torch.dtype | None  # what the register holds (None: index arithmetic)
    full: bool
    logical: torch.dtype | None = None  # the torch dtype the value stands for (bf16 held in fp32)
    hint: str = ""
    comment: str = ""
    meta: dict = field(default_factory=dict)

    @property
    def is_zero(self) -> bool:
        return self.kind == "lit" and self.fmt == "0"


class Dag:
    def __init__(self):
        self.nodes: list[Node] = []
        self._memo: dict = {}

    def add(self, kind, fmt, inputs=(), dtype=None, full=None, logical=None, hint="", comment="", **meta) -> Node:
        inputs = tuple(inputs)
        key = (kind, fmt, tuple(id(i) for i in inputs), dtype, tuple(sorted(meta.items(), key=str)))
        hit = self._memo.get(key)
        if hit is not None:
            if hint and not hit.hint:
                hit.hint = hint
            return hit
        if full is None:
            full = any(i.full for i in inputs)
        n = Node(kind, fmt, inputs, dtype, full, logical or dtype, hint, comment, dict(meta))
        self._memo[key] = n
        self.nodes.append(n)
        return n

    # ---- leaves
    def var(self, name: str, full: bool, dtype=INDEX) -> Node:
        return self.add("var", name, dtype=dtype, full=full)

    def arg(self, name: str) -> Node:
        return self.add("arg", name, full=False)

    def lit(self, value, dtype=INDEX) -> Node:
        return self.add("lit", lit(value, dtype) if dtype is not None else str(int(value)), dtype=dtype, full=False)

    # ---- values
    def op(self, fmt: str, *xs, dtype, logical=None, hint="", comment="") -> Node:
        return self.add("op", fmt, xs, dtype=dtype, logical=logical, hint=hint, comment=comment)

    def cast(self, x: Node, dtype: torch.dtype, logical=None) -> Node:
        """x converted to `dtype` registers (bool: x != 0, as torch converts)."""
        if x.dtype == dtype:
            return x
        if x.kind == "lit":
            return self.add("lit", lit(_py(x.fmt), dtype), dtype=dtype, full=False)
        if dtype == torch.bool:
            return self.add("op", "{} != 0", (x,), dtype=dtype, logical=logical or dtype)
        return self.add("cast", f"{{}}.to({tl_type(dtype)})", (x,), dtype=dtype, logical=logical or dtype)

    def round_to(self, x: Node, dtype: torch.dtype) -> Node:
        """Round an fp32 register to bf16/fp16 precision (an explicit conversion in the program)."""
        if x.logical == dtype and x.kind in ("load", "cast") and (x.kind == "load" or x.inputs[0].kind == "load"):
            return x  # already exactly representable
        # Two conversions, rounding to nearest even as torch does (in Triton's interpreter too: see
        # `advisor.interpreter.round_like_the_gpu`): cheaper than rounding in bits where every op rounds.
        return self.add("cast", f"{{}}.to({tl_type(dtype)}).to({tl_type(x.dtype)})", (x,), dtype=x.dtype,
                        logical=dtype, hint="", comment=f"round to {str(dtype)[6:]}")

    def load(self, ptr: str, offset: Node, mask: Node | None, mem: torch.dtype, hint: str) -> Node:
        reg = opmath(mem)
        n = self.add("load", ptr, (offset,) + ((mask,) if mask is not None else ()), dtype=reg,
                     full=offset.full, logical=mem, hint=hint, mem=str(mem))
        return n

    def reduce(self, kind: str, x: Node) -> Node:
        return self.add("reduce", kind, (x,), dtype=x.dtype, full=False, logical=x.logical, kind_=kind)

    # ---- index arithmetic (folds zeros and ones, so addresses stay short)
    def iadd(self, a: Node, b: Node) -> Node:
        if a.is_zero:
            return b
        if b.is_zero:
            return a
        if a.kind == b.kind == "lit":
            return self.lit(int(a.fmt) + int(b.fmt))
        if a.fmt == "{} * {}" and a.inputs[0].fmt == "{} // {}" and b.fmt == "{} % {}" and \
                a.inputs[0].inputs == b.inputs and a.inputs[1] is b.inputs[1]:
            return b.inputs[0]  # (x // n) * n + x % n: an index unravelled, then linearised again (a reshape)
        return self.add("op", "{} + {}", (a, b))

    def isub(self, a: Node, b: Node) -> Node:
        if b.is_zero:
            return a
        if a.kind == b.kind == "lit":
            return self.lit(int(a.fmt) - int(b.fmt))
        return self.add("op", "{} - {}", (a, b))

    def imul(self, a: Node, b: Node) -> Node:
        if a.is_zero or b.is_zero:
            return self.lit(0)
        if a.kind == "lit" and a.fmt == "1":
            return b
        if b.kind == "lit" and b.fmt == "1":
            return a
        return self.add("op", "{} * {}", (a, b))

    def isum(self, terms: list, hint: str = "") -> Node:
        """Scalar terms first, as one named node (a row's base offset), then the varying ones."""
        terms = [t for t in terms if not t.is_zero]
        fixed = [t for t in terms if not t.full]
        varying = [t for t in terms if t.full]
        base = self.lit(0)
        for t in fixed:
            base = self.iadd(base, t)
        if hint and len(fixed) > 1:
            base.hint = base.hint or hint
        for t in varying:
            base = self.iadd(base, t)
        return base


def _py(text: str):
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        return float(text) if "float" not in text else float(text.split('"')[1]) * (-1 if text.startswith("-") else 1)
