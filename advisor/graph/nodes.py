"""The dataflow graph's records: the ops that do work (`Node`), the tensor versions between them
(`Value`), a node's reads (`Use`) and the `Graph` that holds them. Built from the execution trace
(`dataflow.build_graph`) or, without one, from Kineto's recorded shapes (`fallback`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from operator import attrgetter

import pandas as pd

from advisor.ops.registry import OpClass


@dataclass(slots=True)
class Use:
    value: int  # value id
    pos: int  # argument position in the op
    bytes: int  # bytes this access touches (a broadcast view at its true size)
    shape: tuple
    strides: tuple
    dtype: str
    offset: int = 0


@dataclass(slots=True)
class Node:
    idx: int
    et_id: int
    rf_id: int
    op: str
    cls: OpClass
    schema: str
    ts: float
    dur: float
    iteration: int
    module: str = ""
    phase: str = "forward"  # of a training step: forward | backward | optimizer (`index.phases`)
    kernels: list = field(default_factory=list)  # kernel names
    kernel_spans: list = field(default_factory=list)  # (name, ts, dur) per kernel
    kernel_us: float = 0.0
    reads: list = field(default_factory=list)  # [Use]
    writes: list = field(default_factory=list)  # [Use]
    # Positional inputs: ("t", value id) | ("tl", [value ids]) for tensor lists | ("s", scalar)
    args: list = field(default_factory=list)
    inplace: bool = False
    # Nodes of one template ran the same op on arguments of the same shapes, dtypes and scalar values: they
    # differ only in which tensors they touched (value ids). The analysis computes what depends on those
    # alone once per template (`per_template`). -1: no template (each node its own).
    template: int = -1
    _bytes: int = field(default=-1, repr=False, compare=False)  # `bytes`, once reads and writes are final

    @property
    def time_us(self) -> float:
        # GPU traces: kernel time; CPU traces: the op's own duration (it swallowed its subtree).
        return self.kernel_us if self.kernels else self.dur

    @property
    def bytes(self) -> int:
        # Asked for again and again by the cost model; the graph never changes once built.
        if self._bytes < 0:
            self._bytes = sum(u.bytes for u in self.reads) + sum(u.bytes for u in self.writes)
        return self._bytes


@dataclass(slots=True)
class Value:
    vid: int
    storage: int
    producer: int  # node idx, or -1 for a tensor from outside the window (weights, inputs)
    shape: tuple
    strides: tuple
    dtype: str
    bytes: int
    consumers: list = field(default_factory=list)  # node idxs
    offset: int = 0  # storage offset of the write, in elements
    tensor_id: int = -1  # ET tensor id of the first access


@dataclass
class Graph:
    nodes: list[Node]
    values: list[Value]
    iterations: int
    confidence: str  # "high" (ET dataflow) or "low" (shapes and order)
    device_type: str  # "cuda" or "cpu"
    unknown_ops: pd.DataFrame  # name, count, time_us
    warnings: list = field(default_factory=list)  # why the analysis is weaker than it could be (one line each)

    def node_frame(self) -> pd.DataFrame:
        cls_value = {c: c.value for c in OpClass}  # (an Enum's .value is slow to ask a million times)
        nodes = self.nodes

        def column(name: str) -> list:  # one attribute of every node, fetched in C (no tuple per node)
            return list(map(attrgetter(name), nodes))

        return pd.DataFrame({
            "node": column("idx"), "op": pd.Categorical(column("op")),
            "cls": pd.Categorical(list(map(cls_value.__getitem__, map(attrgetter("cls"), nodes)))),
            "ts": column("ts"), "time_us": column("time_us"), "n_kernels": list(map(len, map(attrgetter("kernels"), nodes))),
            "bytes": column("bytes"), "module": pd.Categorical(column("module")), "iteration": column("iteration"),
        })


def per_template(fn):
    """fn(node), computed once per node template (see Node.template) and once per node without one."""
    cache: dict = {}

    def get(n: Node):
        if n.template < 0:
            return fn(n)
        try:
            return cache[n.template]
        except KeyError:
            value = cache[n.template] = fn(n)
            return value

    return get


def true_bytes(shape, strides, itemsize) -> int:
    """Bytes a tensor really occupies: dims with stride 0 (broadcast/expand) count once."""
    if not shape:
        return int(itemsize)
    if strides and len(strides) == len(shape):
        n = math.prod(s for s, st in zip(shape, strides) if st != 0)
    else:
        n = math.prod(shape)
    return int(n) * int(itemsize)
