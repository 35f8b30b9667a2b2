"""Op arguments as Python values: the one place that knows how a trace spells them.

The execution trace writes a scalar argument as JSON with a few spellings of its own, and
analysis.json's programs copy them as they are (so a program is the trace's record):

    None                          "<None>"
    float inf / -inf / nan        "inf" / "-inf" / "nan" (a Double the JSON writer cannot hold)
    values it does not record     "<ComplexDouble>", "<Generator>", ... (the type in angle brackets)
    int[] / SymInt[]              a JSON list of ints (symbolic sizes are recorded as their value)

A trace without an ET file holds Kineto's "Concrete Inputs" instead: Python literals as text, "" for
none (`parse_concrete`). Every reader goes through `decode` (one value) or `bind` (an op's arguments
by schema name, defaults filled in), never through the spellings; `encode` writes a Python value the
way a program holds it.
"""
from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from functools import lru_cache

NONE = "<None>"  # how the execution trace (and a program) writes None
_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


@dataclass(frozen=True)
class Unrecorded:
    """An argument the trace names only by its type ("<Generator>"): its value is not known."""

    type: str


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument in `bind`'s result: the graph value id(s) it reads."""

    value: int | tuple


def decode(raw):
    """One argument as recorded (ET JSON, a program's "value", or parsed concrete text) -> Python value."""
    if isinstance(raw, str):
        if raw == NONE:
            return None
        if raw in _FLOATS:
            return _FLOATS[raw]
        if len(raw) > 2 and raw[0] == "<" and raw[-1] == ">":
            return Unrecorded(raw[1:-1])
        return raw
    if isinstance(raw, (list, tuple)):
        return [decode(x) for x in raw]
    return raw


def encode(value):
    """A Python value as a program holds it: the inverse of `decode` for what a program can carry."""
    if value is None:
        return NONE
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (list, tuple)):
        return [encode(x) for x in value]
    return value


def split_top_level(text: str) -> list[str]:
    """`text` split at the commas outside any (...) or [...]: a schema's arguments, a GenericList's types."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        depth += (ch in "([") - (ch in ")]")
        cur += ch
    if cur:
        out.append(cur)
    return out


def parse_concrete(text: str):
    """One of Kineto's "Concrete Inputs" (a Python literal as text, "" when not recorded) -> raw value."""
    if text == "":
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


@lru_cache(maxsize=4096)
def schema_of(op: str, schema: str, tensor_slots: tuple | None = None):
    """The parsed schema of an op: the recorded text, else (shape-only traces) the first overload of
    `op` whose arity and tensor positions fit `tensor_slots` (one bool per recorded argument). None if
    neither gives one (a custom op, an unknown namespace)."""
    import torch  # here, not at the top: the registry and the graph builder do not need torch

    if schema:
        try:
            return torch._C.parse_schema(schema)
        except RuntimeError:
            pass
    if tensor_slots is None or "::" not in op:
        return None
    namespace, short = op.split("::", 1)
    packet = getattr(getattr(torch.ops, namespace, None), short.split(".", 1)[0], None)
    for overload in packet.overloads() if packet is not None else ():
        sch = getattr(packet, overload)._schema
        required = sum(1 for a in sch.arguments if not a.has_default_value())
        if required <= len(tensor_slots) <= len(sch.arguments) and all(
                is_tensor == str(a.type).startswith("Tensor") for a, is_tensor in zip(sch.arguments, tensor_slots)):
            return sch
    return None


def bind(op: str, schema: str, args) -> dict | None:
    """A graph node's arguments by schema name: scalars decoded, tensors as `TensorArg`, arguments the
    trace left out at their schema default. `args` is the node's list of ("t", vid) | ("tl", [vids]) |
    ("s", raw). None when the op's schema is unknown (then nothing about its arguments is)."""
    slots = tuple(kind != "s" for kind, _ in args)
    sch = schema_of(op, schema, slots)
    if sch is None:
        return None
    return by_name(sch, [decode(raw) if kind == "s" else TensorArg(tuple(raw) if kind == "tl" else raw)
                         for kind, raw in args])


def by_name(schema, values: list) -> dict:
    """Positional `values` under the schema's argument names; those the record left out at their default."""
    out = dict(zip((a.name for a in schema.arguments), values))
    for a in schema.arguments[len(values):]:
        out[a.name] = a.default_value if a.has_default_value() else None
    return out


def reduced_dims(dim, ndim: int) -> tuple[int, ...]:
    """The dims a reduction's `dim` argument names, non-negative and sorted. None and [] mean every dim
    (what sum/mean/amax/... do with no dim); an int is one dim; a list, each of its dims."""
    if ndim == 0:
        return ()
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return tuple(range(ndim))
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise ValueError(f"not a dim argument: {dim!r}")
    return tuple(sorted({d % ndim for d in dims}))


def group_count(args: dict):
    """A GroupNorm's number of groups, by either schema's name for it (`group_norm(input, num_groups, ...)`,
    `native_group_norm(..., group, eps)`); None where the arguments hold neither."""
    return args.get("group", args.get("num_groups"))
