"""A pattern at sizes never profiled: its program rewritten at the sizes a captured graph holds.

A generated row or pointwise kernel reads every size from its tensors (validation runs it at the recorded
sizes, at odd ones and at all ones), so the kernel made for 4 x 1024 rows serves 1 x 37 rows, or a decode
step's 4 x 1 rows. What ties a pattern to the profiled shapes is the match: a program records its tensors'
shapes, strides and offsets. So where a capture at new shapes holds no exact match, the pattern is looked for
loosely (`match.find(..., loose=True)`: ops, arguments, dataflow, ranks and dtypes, no sizes), the program is
rewritten with the layouts the graph holds at the places the loose match found (`rebind`), and the rewritten
program is matched exactly, as any other: the exact match, not the loose one, decides what is substituted.
Layouts are taken from the graph place by place, not mapped size by size: a size the program recorded in two
roles (batch 4 beside 4 KV heads, or beside half a head dim of 4) takes each role's new value.

Only programs whose every op the generator lowers with sizes as arguments (`ops.lowering.serves_any_rows`),
and only where each row keeps its length and each broadcast stays one (the last dim of every input and read as
recorded, every dim of size 1 still 1: the kernel's index math holds them): no GroupNorm (its
channels per group are fixed in the kernel), no max-pool window, no matmul, convolution or attention (their
kernels are tuned per shape).
"""
from __future__ import annotations

import copy

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from advisor.graph.dtypes import torch_dtype
from advisor.ops.lowering import serves_any_rows
from advisor.patching.match import Match, Pattern, layout
from advisor.patching.program import is_scalar_slot, run_program, storage_numel, strided_view, tensor_reads


def resizable(program: dict) -> bool:
    """Whether the program's kernel serves its pattern at other leading sizes."""
    nodes = program.get("nodes") or []
    return bool(nodes) and all(serves_any_rows(n["op"]) for n in nodes)


def rebind(program: dict, pattern: Pattern, m: Match) -> dict | None:
    """The program with the layouts of the graph `m` (a loose match of `pattern`) found: each input's and each
    read view's from the graph's read at that place, each read of a tensor's own layout from that tensor at the
    new sizes. None where the graph does not say (an input read only through views of parts of it) or a row
    would change its length."""
    if not pattern.input_views and not pattern.read_views:
        return None
    out = copy.deepcopy(program)
    for k, spec in enumerate(out["inputs"]):
        if is_scalar_slot(spec):
            continue
        found = m.views.get(pattern.input_views.get(k))
        lay = layout(found) if found is not None else None
        if lay is None or not _same_structure(spec["shape"], lay[0]):
            return None
        spec["shape"], spec["strides"], spec["storage_offset"] = list(lay[0]), list(lay[1]), lay[2]
    given: set = set()  # ids of the reads whose layout the graph gave
    for node, (i, j, k) in pattern.read_views.items():
        found = m.views.get(node)
        lay = layout(found) if found is not None else None
        arg = out["nodes"][i]["args"][j]
        if lay is None or not _same_structure((arg if k is None else arg["list"][k])["shape"], lay[0]):
            return None
        ref = arg if k is None else arg["list"][k]
        ref["shape"], ref["strides"], ref["storage_offset"] = list(lay[0]), list(lay[1]), lay[2]
        given.add(id(ref))
    try:
        with unset_fake_temporarily():  # (a capture's backend runs under dynamo's fake mode: meta tensors here)
            _follow_own_layouts(out, given)
    except Exception:  # noqa: BLE001  (the ops refuse these sizes: no program at them)
        return None
    return out if _offsets_kept(program, out) else None


def _offsets_kept(recorded: dict, rebound: dict) -> bool:
    """Whether every read still starts where the kernel looks for it: at its recorded distance from the start of
    the tensor it reads (the kernel, made at the profiled sizes, holds that distance). A loose match may take one
    of two places that compute alike for the other: ModernBERT's rotary over a packed QKV rotates the query and
    the key alike, and a match that bound the program's query input to the graph's key moved every read by the
    64 elements between them, so the kernel's key read landed on the values (outputs 0.6 off at a new shape)."""
    def starts(p: dict) -> dict:
        return {s["id"]: s.get("storage_offset", 0) for s in p["inputs"] if not is_scalar_slot(s)}

    was, now = starts(recorded), starts(rebound)
    for a, b in zip(recorded["nodes"], rebound["nodes"]):
        for x, y in zip(a["args"], b["args"]):
            for ra, rb in zip(tensor_reads(x), tensor_reads(y)):
                if ra.get("storage_offset", 0) - was.get(ra["ref"], 0) != rb.get("storage_offset", 0) - now.get(rb["ref"], 0):
                    return False
    return True


def _same_structure(recorded, found) -> bool:
    """The kernel's view of a tensor is kept: the same rank, each row's length (the last dim), and every dim of
    size 1 still 1 (a broadcast the kernel was generated for: a rotary table shared by the batch)."""
    return len(recorded) == len(found) and (not recorded or recorded[-1] == found[-1]) and \
        all(n != 1 or f == 1 for n, f in zip(recorded, found))


def _follow_own_layouts(program: dict, given: set) -> None:
    """Run the program on meta tensors at its new input layouts: a read the graph gave a layout (`given`, by the
    read's id, already written into it) reads through it; a read of its tensor's own layout takes that tensor's
    layout at the new sizes."""
    inputs = []
    for k, spec in enumerate(program["inputs"]):
        if is_scalar_slot(spec):
            inputs.append(1.0 if spec["dtype"] == "float64" else 1)  # a wrapped number: its value changes no layout
            continue
        # (its storage as large as every read of it needs: a read may lie past the input's own view)
        base = torch.empty(max(storage_numel(program, k), 1), dtype=torch_dtype(spec["dtype"]), device="meta")
        inputs.append(base.as_strided(spec["shape"], spec["strides"], spec.get("storage_offset", 0)))

    def view(t, base_spec, ref):
        if id(ref) not in given:  # the read of its tensor as it is
            ref["shape"], ref["strides"] = list(t.shape), list(t.stride())
            ref["storage_offset"] = base_spec.get("storage_offset", 0)
            return t
        return strided_view(t, base_spec, ref)

    run_program(program, inputs, view)

