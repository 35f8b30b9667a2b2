"""A pattern at sizes never profiled: its program with the leading sizes (batch, sequence, rows) rebound.

A generated row or pointwise kernel reads every size from its tensors (validation runs it at the recorded
sizes, at odd ones and at all ones), so the kernel made for 4 x 1024 rows serves 1 x 37 rows, or a decode
step's 4 x 1 rows. What ties a pattern to the profiled shapes is the match: a program records its tensors'
shapes, strides and offsets. So a capture at new shapes looks for the pattern with those sizes free
(`match.find(..., sizes=free_sizes(program))`: every recorded size that is free maps to one size of the
graph, consistently), rewrites the program through that mapping (`rebind`) and matches the rewritten program
exactly, as any other: the exact match, not the loose one, decides what is substituted.

Free: sizes of a tensor's leading dims, strides and offsets (products of sizes); never a last dim (the row a
row kernel walks, a hidden size), never 0 or 1 (broadcasting). Only programs whose every op the generator
lowers with sizes as arguments (`ops.lowering.serves_any_rows`): no GroupNorm (its channels per group are
fixed in the kernel), no max-pool window, no matmul, convolution or attention (their kernels are tuned per shape).
"""
from __future__ import annotations

import copy

from advisor.ops.lowering import serves_any_rows


def resizable(program: dict) -> bool:
    """Whether the program's kernel serves its pattern at other leading sizes."""
    nodes = program.get("nodes") or []
    return bool(nodes) and all(serves_any_rows(n["op"]) for n in nodes)


def free_sizes(program: dict) -> frozenset[int]:
    """The recorded sizes a match may rebind (see the module's doc)."""
    fixed, free = {0, 1}, set()
    for layout in _layouts(program):
        shape = layout.get("shape") or []
        if shape:
            fixed.add(shape[-1])
            free.update(shape[:-1])
        free.update(layout.get("strides") or [])
        free.add(layout.get("storage_offset", 0))
    return frozenset(free - fixed)


def rebind(program: dict, sizes: dict[int, int]) -> dict:
    """The program with every recorded size, stride and offset mapped through `sizes` (unmapped: as recorded)."""
    out = copy.deepcopy(program)
    for layout in _layouts(out):
        shape, strides = layout.get("shape"), layout.get("strides")
        if shape is not None:
            layout["shape"] = [sizes.get(v, v) for v in shape]
        if strides is not None:  # a dense layout stays dense (its strides follow from the sizes, bound or not)
            dense = shape is not None and _same_strides(shape, strides, _dense(shape))
            layout["strides"] = _dense(layout["shape"]) if dense else [sizes.get(v, v) for v in strides]
        if "storage_offset" in layout:
            layout["storage_offset"] = sizes.get(layout["storage_offset"], layout["storage_offset"])
    return out


def _dense(shape: list) -> list:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return out[::-1]


def _same_strides(shape, a, b) -> bool:
    return len(a) == len(b) and all(n <= 1 or x == y for n, x, y in zip(shape, a, b))


def _layouts(program: dict):
    """Every tensor layout the program records: inputs, each read of a node, each node output."""
    yield from program.get("inputs") or []
    for node in program.get("nodes") or []:
        for a in node.get("args") or []:
            if isinstance(a, dict) and "ref" in a:
                yield a
            elif isinstance(a, dict) and isinstance(a.get("list"), list):  # cat's tensors
                yield from (r for r in a["list"] if isinstance(r, dict) and "ref" in r)
        yield from node.get("outputs") or []
