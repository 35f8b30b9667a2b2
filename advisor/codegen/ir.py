"""A candidate's program read for code generation: symbolic sizes, views as index maps, dtypes.

Sizes are symbols (`in0.2` is dim 2 of input 0) unified by broadcasting, so one kernel serves every
occurrence of a pattern whatever its sizes. A size that only a view argument fixes (a slice, a
select, an expand) stays a literal, and the input dims it depends on are pinned to their recorded
size: the launcher checks them and refuses other shapes rather than compute the wrong thing.

A ref (a tensor read) becomes a `View`: for each of its dims, which dim of its source it walks (or
none: broadcast or size 1), plus a start index per source dim. Slices, selects, unsqueezes, expands
and permutes are index maps; a view that merges or splits dims (a reshape, Swin's window partition)
reads a block of source dims through a linear index (`Reshape`), with the block's sizes pinned.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch

from advisor.graph import dtypes
from advisor.ops.lowering import Lowering, Unsupported


@dataclass(frozen=True)
class Dim:
    terms: tuple = ()  # size symbols ("in0.2"); several for a concatenated dim
    const: int = 0
    value: int = 0  # the recorded size

    @property
    def literal(self) -> bool:
        return not self.terms


class Sizes:
    """Union-find over size symbols; a class may be pinned to its recorded value."""

    def __init__(self):
        self.parent: dict[str, str] = {}
        self.value: dict[str, int] = {}
        self.pinned: set[str] = set()
        self.defs: dict[str, Dim] = {}  # class -> its size in terms of other classes (a cat's output)

    def symbol(self, name: str, value: int) -> Dim:
        self.parent.setdefault(name, name)
        self.value[name] = value
        return Dim((name,), 0, value)

    def find(self, s: str) -> str:
        while self.parent[s] != s:
            self.parent[s] = self.parent[self.parent[s]]
            s = self.parent[s]
        return s

    def norm(self, d: Dim) -> Dim:
        terms, const = [], d.const
        for t in d.terms:
            r = self.find(t)
            if r in self.pinned:
                const += self.value[r]
            elif r in self.defs:
                e = self.norm(self.defs[r])
                terms += e.terms
                const += e.const
            else:
                terms.append(r)
        return Dim(tuple(sorted(terms)), const, d.value)

    def pin(self, d: Dim) -> None:
        for t in self.norm(d).terms:
            self.pinned.add(t)

    def unify(self, a: Dim, b: Dim) -> Dim:
        if a.value != b.value:
            raise Unsupported(f"sizes {a.value} and {b.value} do not match")
        a, b = self.norm(a), self.norm(b)
        if a == b:
            return a
        if len(a.terms) == 1 and len(b.terms) == 1 and not a.const and not b.const:
            ra, rb = sorted([a.terms[0], b.terms[0]], key=_sym_order)
            self.parent[rb] = ra
            return self.norm(a)
        for x, y in ((a, b), (b, a)):  # a bare size equal to a sum of others (x = in1.1 + 1): define it so
            if len(x.terms) == 1 and not x.const and y.terms and x.terms[0] not in y.terms:
                self.defs[x.terms[0]] = y
                return y
        self.pin(a)  # a literal, or sums that do not match term by term: fix both
        self.pin(b)
        return Dim((), a.value, a.value)


def _sym_order(s: str):
    k, d = s[2:].split(".")
    return int(k), int(d)


@dataclass
class Input:
    id: str
    dtype: torch.dtype
    shape: list  # [Dim]
    rec_shape: list
    rec_strides: list
    offset: int


@dataclass
class Reshape:
    """Ref dims walking a block of source dims that a view merged or split (x.view(B * S, H) of a
    [B, S, H] value, Swin's window partition): the ref index is linearised over the block, in units
    of its innermost source dim's stride, and unravelled into the block's source dims."""
    ref_dims: list  # the ref dims in the block
    steps: list  # per ref dim: its stride in units of the block's innermost source stride
    src_dims: list  # the block's source dims, outermost first
    units: list  # per source dim: its stride in those units
    extents: list  # per source dim: its (pinned) size


@dataclass
class View:
    src: str  # "in0" or "v3"
    shape: list  # [Dim] of the ref
    dims: list  # per ref dim: the source dim it walks, or None (broadcast, size 1, or in a reshape)
    starts: list  # per source dim: first index read
    identity: bool = False
    reshapes: list = field(default_factory=list)  # [Reshape]

    def walks(self) -> list:
        """Per ref dim: (source dim, step), the ref moving `step` strides of that source dim per index,
        or None (a broadcast or size-1 dim). What a strided view of the source needs (`torch.as_strided`)."""
        out = [(e, 1) if e is not None else None for e in self.dims]
        for r in self.reshapes:
            for d, step in zip(r.ref_dims, r.steps):
                out[d] = (r.src_dims[-1], step)
        return out


@dataclass
class Value:
    id: str
    dtype: torch.dtype
    shape: list
    rec_shape: list
    rec_strides: list
    op: "Op"
    slot: int
    offset: int = 0  # storage offset (non-zero only for values written in place into a view)


@dataclass
class Op:
    id: str
    name: str  # "aten::add"
    overload: str  # "Tensor", or "default"
    low: Lowering
    args: dict  # schema name -> View | [View] | Python value
    outputs: list  # [Value]
    inplace: bool

    @property
    def qualname(self) -> str:
        return f"{self.name}.{self.overload}" if self.overload != "default" else self.name


@dataclass
class Program:
    inputs: list
    values: dict
    ops: list
    outputs: list  # [Value] written by the kernel
    sizes: Sizes
    inplace: dict = field(default_factory=dict)  # value id -> View into the input it overwrites
    returned: int = 0  # the first `returned` outputs are the subgraph's; the rest are in-place writes

    def source(self, sid: str):
        return self.values.get(sid) or next(i for i in self.inputs if i.id == sid)

    @property
    def row_ops(self) -> list:
        return [o for o in self.ops if o.low.kind == "row"]

    def dim_key(self, d: Dim) -> str:
        d = self.sizes.norm(d)
        return "+".join(d.terms + ((str(d.const),) if d.const or not d.terms else ()))

    def signature(self) -> str:
        """Everything the generated code depends on, with sizes as symbols: the pattern's cache key."""
        dims = lambda ds: [self.dim_key(d) for d in ds]  # noqa: E731
        view = lambda v: [v.src, dims(v.shape), v.dims, v.starts, v.identity,  # noqa: E731
                          [[r.ref_dims, r.steps, r.src_dims, r.units, r.extents] for r in v.reshapes]]
        doc = {
            "inputs": [[i.id, str(i.dtype), dims(i.shape), _order(i.rec_strides, i.rec_shape),
                        [s == 0 for s in i.rec_strides]] for i in self.inputs],
            "ops": [[o.qualname, {k: (view(v) if isinstance(v, View) else [view(x) for x in v]
                                      if isinstance(v, list) and v and isinstance(v[0], View) else repr(v))
                                  for k, v in o.args.items()},
                     [[v.id, str(v.dtype), dims(v.shape), _order(v.rec_strides, v.rec_shape)] for v in o.outputs]]
                    for o in self.ops],
            "outputs": [v.id for v in self.outputs],
            "inplace": {k: view(v) for k, v in self.inplace.items()},
        }
        return json.dumps(doc, sort_keys=True)

    def key(self, version: str) -> str:
        return hashlib.sha256((version + self.signature()).encode()).hexdigest()[:16]


def _order(strides, shape) -> list:
    """Physical order of the dims, outermost first; size-1 and stride-0 dims (which do not move
    through memory) go last."""
    return sorted(range(len(shape)), key=lambda d: (shape[d] == 1 or strides[d] == 0, -strides[d], d))


def torch_dtype(name: str) -> torch.dtype:
    """The dtype a program names; a name torch has no dtype of makes the program not generated."""
    try:
        return dtypes.torch_dtype(name)
    except ValueError:
        raise Unsupported(f"dtype {name!r}") from None
