"""One codec between frozen dataclass records and their JSON: `to_json(record) -> dict` and
`from_json(cls, doc) -> record`, driven by the dataclass's fields and their annotations.

- Keys are the field names, written in field order (or in the class's `JSON_ORDER`, where the JSON's order
  is not the constructor's).
- A field made with `optional()` is written only when it is not None; every other field always is.
- A field made with `flattened({field: key})` holds a nested record written inline, its fields under the
  keys given (a verdict's `code` and `message` as `status_code` and `status`); both or neither are read.
- Enums are written as their values and read back through the enum (a value outside it is refused, the
  vocabulary named); nested dataclasses, `tuple[X, ...]` and `list[X]` are read recursively; a bare
  `tuple` annotation reads a JSON list as a tuple. Anything else (a `dict`, a number, a string) is the
  JSON's value as it is: shown or handed on, not branched on.
- A key the record does not know is refused, as is a missing field without a default: the files are
  versioned (`advisor.jsonio`), and a key this version cannot place would otherwise travel on unread.

Low in the tree: imports only `advisor.errors`.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from enum import Enum
from functools import cache

from advisor.errors import AdvisorError

OMIT_NONE = "advisor.codec.omit_none"
FLAT = "advisor.codec.flat"


class RecordError(AdvisorError):
    """A JSON record that is not one of ours: an unknown kind, status or key, or a missing key."""


def optional(default=None):
    """A field written only when it is not None (a stage the run did not reach writes nothing)."""
    return dataclasses.field(default=default, metadata={OMIT_NONE: True})


def flattened(keys: dict, default=None):
    """A nested record written inline: {its field: the key it is written under}; omitted when None."""
    return dataclasses.field(default=default, metadata={FLAT: dict(keys)})


def to_json(record) -> dict:
    """The JSON object of a dataclass record, keys in its order (see the module's docstring)."""
    out = {}
    for f in _ordered_fields(type(record)):
        value = getattr(record, f.name)
        flat = f.metadata.get(FLAT)
        if flat:
            if value is not None:
                out.update((key, encode(getattr(value, sub))) for sub, key in flat.items())
        elif value is not None or not f.metadata.get(OMIT_NONE):
            out[f.name] = encode(value)
    return out


def encode(value):
    """A value as JSON holds it: enums by value, records by `to_json`, tuples as lists, containers walked."""
    if isinstance(value, Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_json(value)
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    return value


def from_json(cls, doc, what: str | None = None):
    """The record of class `cls` that JSON object `doc` holds; refuses what it cannot place (RecordError,
    the key or value named). `what` names the record in messages."""
    what = what or cls.__name__
    if not isinstance(doc, dict):
        raise RecordError(f"{what} must be a JSON object, got {type(doc).__name__}")
    hints = _hints(cls)
    values, known, missing = {}, set(), []
    for f in dataclasses.fields(cls):
        flat = f.metadata.get(FLAT)
        if flat:
            known.update(flat.values())
            present = [k for k in flat.values() if k in doc]
            if present and len(present) < len(flat):
                absent = [k for k in flat.values() if k not in doc]
                raise RecordError(f"{what} has {', '.join(present)} without {', '.join(absent)}: "
                                  f"a {f.name} is all of them")
            if present:
                inner = _record_type(hints[f.name])
                inner_hints = _hints(inner)
                values[f.name] = inner(**{sub: decode(inner_hints[sub], doc[key], key) for sub, key in flat.items()})
            continue
        known.add(f.name)
        if f.name in doc:
            values[f.name] = decode(hints[f.name], doc[f.name], f.name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            missing.append(f.name)
    unknown = [k for k in doc if k not in known]
    if unknown:
        raise RecordError(f"{what} has keys this version does not know: {', '.join(map(repr, unknown))}")
    if missing:
        raise RecordError(f"{what} lacks {', '.join(map(repr, missing))}")
    return cls(**values)


def decode(tp, value, key: str):
    """`value` read as annotation `tp` says (see the module's docstring); `key` names it in messages."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        structured = [a for a in args if a is not type(None) and _structured(a)]
        return decode(structured[0], value, key) if len(structured) == 1 else value
    if isinstance(tp, type) and issubclass(tp, Enum):
        return enum_value(tp, value, key)
    if dataclasses.is_dataclass(tp):
        return from_json(tp, value, key)
    if (origin is tuple or tp is tuple) and isinstance(value, (list, tuple)):
        inner = args[0] if args else None
        return tuple(value) if inner is None else tuple(decode(inner, v, key) for v in value)
    if origin is list and args and isinstance(value, list):
        return [decode(args[0], v, key) for v in value]
    return value


def enum_value(cls, value, key: str):
    """`cls(value)`, or a RecordError naming the key and the vocabulary."""
    try:
        return cls(value)
    except ValueError:
        known = ", ".join(m.value for m in cls)
        raise RecordError(f"{key} {value!r} is not a known {cls.__name__} (one of: {known})") from None


def _structured(tp) -> bool:
    origin = typing.get_origin(tp)
    return (isinstance(tp, type) and (issubclass(tp, Enum) or dataclasses.is_dataclass(tp) or tp is tuple)) or \
        origin in (tuple, list)


def _record_type(tp):
    for a in (typing.get_args(tp) or (tp,)):
        if dataclasses.is_dataclass(a):
            return a
    raise TypeError(f"{tp} holds no record type")


@cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


@cache
def _ordered_fields(cls) -> tuple:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    order = getattr(cls, "JSON_ORDER", None)
    if order is None:
        return tuple(fields.values())
    assert set(order) == set(fields), f"{cls.__name__}.JSON_ORDER must name every field once"
    return tuple(fields[name] for name in order)
