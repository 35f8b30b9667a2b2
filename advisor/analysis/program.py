"""A candidate's program (`candidate["program"]` in analysis.json, written by `advisor.analysis.api.program_of`;
`advisor.codegen.record` writes one from a function), read: the one reader the generator, the validator and
the patcher go through.

    {"inputs":  [{"id", "shape", "strides", "dtype", "storage_offset"}],
     "nodes":   [{"id", "op", "schema", "args": [arg], "outputs": [{"id", "shape", "strides", "dtype"}],
                  "inplace"}],
     "outputs": [value id]}

An arg is a tensor read `{"ref": value id, "shape", "strides", "storage_offset"}` (the view it was read
through), a list of them `{"list": [read]}`, or a scalar `{"value": raw}` spelled as the trace spells it
(`advisor.ops.args`). A stage turns a read into its own thing (the generator an index map, which
the validator replays; the patcher a view of a tensor), so `arg_values` takes that as a function;
everything else about an argument is decoded here.
"""
from __future__ import annotations

from functools import lru_cache

from advisor.graph.dtypes import scalar_type
from advisor.ops.args import decode, schema_of, split_top_level

# c10::MemoryFormat codes, as a trace writes a memory_format argument
_MEMORY_FORMATS = ("contiguous_format", "preserve_format", "channels_last", "channels_last_3d")


def tensor_reads(arg: dict) -> list[dict]:
    """The tensor reads an argument holds: itself, the reads it lists, or none (a scalar)."""
    return arg["list"] if "list" in arg else [arg] if "ref" in arg else []


def node_schema(node: dict):
    """The node's parsed schema: the recorded one, else the overload its tensor positions fit
    (`advisor.ops.args.schema_of`); None when neither gives one."""
    return schema_of(node["op"], node.get("schema") or "", tuple("value" not in a for a in node["args"]))


def arg_values(node: dict, read) -> list:
    """The node's arguments in order: each tensor read through `read`, a list of them as a list, a
    scalar decoded from its trace spelling (None, inf, nan, ...)."""
    return [read(a) if "ref" in a else [read(r) for r in a["list"]] if "list" in a else decode(a.get("value"))
            for a in node["args"]]


def declared_types(schema) -> tuple[str, ...]:
    """Argument types as the schema's text spells them (`ScalarType?`): a parsed argument's `type` says
    `int` for a ScalarType, a Layout and a MemoryFormat."""
    return _declared_types(str(schema))  # by text: a schema with a list default does not hash


@lru_cache(maxsize=None)
def _declared_types(text: str) -> tuple[str, ...]:
    parts = split_top_level(text[text.index("(") + 1: text.rindex(") ->")])
    return tuple(p.strip().split(" ")[0] for p in parts if p.strip() and p.strip() != "*")


def as_torch(value, declared: str, device=None):
    """A decoded argument as torch takes it, by its declared type: a ScalarType code as a torch.dtype,
    a MemoryFormat or Layout code as torch's object, a Device as `device` (where the program runs now,
    not where the trace ran). Any other value as it is."""
    import torch

    if value is None:
        return None
    base = declared.rstrip("?")
    if base == "Device":
        return device
    if not isinstance(value, int) or isinstance(value, bool):
        return value
    if base == "ScalarType":
        return scalar_type(value)
    if base == "MemoryFormat":
        return getattr(torch, _MEMORY_FORMATS[value])
    if base == "Layout" and value == 0:
        return torch.strided
    return value
