"""Execution Trace nodes -> a node frame plus argument templates and a flat tensor-id table.

A node's arguments (types, shapes, strides, scalar values, offsets, sizes) repeat every layer and
every iteration; only its tensor and storage ids differ. So each node's inputs+outputs, with those ids
blanked, is a *template* parsed once into argument rows, and the ids go into two flat int arrays:
node i's k-th tensor is `tensor_ids[t0[i] + k]`. Millions of nodes cost a few ints each, not a frame
row per argument. `EtArgs.frame()` expands it all to one row per argument for small traces and tests.

Fast path (torch's layout): one regex over each chunk captures a node's id, name, parent, rf_id,
op_schema and its inputs/outputs lines; a second one blanks the ids in those lines and a third lists
them. A chunk it does not recognise is parsed whole (the generic path) and gives the same templates.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from advisor.ops.args import split_top_level
from advisor.trace.columns import Table

_STR = rb'"([^"\\\n]*(?:\\.[^"\\\n]*)*)"'  # a JSON string's body (unrolled, see kineto.py)
NODE = re.compile(
    rb'\{\n        "id": (-?\d+), "name": ' + _STR + rb', "ctrl_deps": (-?\d+),\n'
    rb'        "inputs": (\{[^\n]*\}),\n        "outputs": (\{[^\n]*\}),\n'
    rb'        "attrs": \[\{"name": "rf_id", "type": "uint64", "value": (\d+)\}[^\n]*'
    rb'\{"name": "op_schema", "type": "string", "value": ' + _STR + rb'\}[^\n]*\]\n      \}')
NODE_SEP = b"\n      },\n      {"
# The "[tensor id,storage id," that opens a tensor argument [tid, sid, offset, numel, itemsize, device];
# the walker below (`_is_tensor_value`) must accept exactly what this matches, so text and values agree.
TENSOR = re.compile(rb'\[(\d+),(\d+),(?=\d+,\d+,\d+,"[^"\\\n]*(?:\\.[^"\\\n]*)*"\])')
TENSOR_TYPE = "Tensor"
COLUMNS = ["node", "io", "pos", "sub", "kind", "value", "tensor_id", "storage_id", "offset", "numel", "itemsize",
           "shape", "strides", "dtype"]


@dataclass
class ArgRow:
    io: str  # "i" / "o"
    pos: int
    sub: int  # element index within a tensor list, -1 otherwise
    kind: str  # the ET type string
    value: object  # non-tensor arguments
    slot: int  # index among the node's tensor ids, or -1 (ids below, or not a tensor)
    tensor_id: int
    storage_id: int
    offset: int
    numel: int
    itemsize: int
    shape: tuple | None
    strides: tuple | None
    dtype: str


@dataclass
class EtArgs:
    templates: list[list[ArgRow]] = field(default_factory=list)
    tensor_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    storage_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))

    def rows(self, tpl: int, t0: int) -> list[tuple[ArgRow, int, int]]:
        """(row, tensor id, storage id) of one node's arguments, in order."""
        out = []
        for r in self.templates[tpl]:
            if r.slot >= 0:
                out.append((r, int(self.tensor_ids[t0 + r.slot]), int(self.storage_ids[t0 + r.slot])))
            else:
                out.append((r, r.tensor_id, r.storage_id))
        return out

    def frame(self, nodes: pd.DataFrame) -> pd.DataFrame:
        """One row per argument of every node (the layout before templates): for small traces and tests."""
        recs = []
        for nid, tpl, t0 in zip(nodes["id"].to_numpy(), nodes["tpl"].to_numpy(), nodes["t0"].to_numpy()):
            for r, tid, sid in self.rows(int(tpl), int(t0)):
                recs.append((int(nid), r.io, r.pos, r.sub, r.kind, r.value, tid, sid, r.offset, r.numel, r.itemsize,
                             r.shape, r.strides, r.dtype))
        cols = list(zip(*recs)) if recs else [[] for _ in COLUMNS]
        df = pd.DataFrame({c: pd.Series(list(v), dtype=object) for c, v in zip(COLUMNS, cols)})
        for c in ("node", "pos", "sub", "tensor_id", "storage_id", "offset", "numel", "itemsize"):
            df[c] = df[c].astype("int64")
        for c in ("io", "kind", "dtype"):
            df[c] = pd.Categorical(df[c])
        return df


def node_table() -> Table:
    return Table(id="i8", name="cat", parent="i8", rf_id="i8", schema="cat", tpl="i4", t0="i8")


class Builder:
    """Templates shared by both paths; tensor ids appended chunk by chunk."""

    def __init__(self, loads) -> None:
        self.loads = loads
        self.args = EtArgs()
        self.tpl_code: dict = {}
        self.tpl_ntensors: list[int] = []
        self.tids: list[np.ndarray] = []
        self.sids: list[np.ndarray] = []
        self.n_tensors = 0

    def template(self, key, inputs, outputs) -> int:
        code = self.tpl_code.get(key)
        if code is None:
            rows, n = _template(inputs, outputs)
            code = self.tpl_code[key] = len(self.args.templates)
            self.args.templates.append(rows)
            self.tpl_ntensors.append(n)
        return code

    def add_tensors(self, tids: np.ndarray, sids: np.ndarray) -> int:
        start = self.n_tensors
        self.tids.append(tids)
        self.sids.append(sids)
        self.n_tensors += len(tids)
        return start

    def finish(self) -> EtArgs:
        cat = lambda parts: np.concatenate(parts) if parts else np.empty(0, np.int64)  # noqa: E731
        self.args.tensor_ids, self.args.storage_ids = cat(self.tids), cat(self.sids)
        return self.args

    # ------------------------------------------------------------------------------------ fast path
    def chunk(self, chunk: bytes, t: Table) -> bool:
        """Add a chunk of nodes in torch's layout; False (nothing added) if the chunk is not in that layout."""
        found = NODE.findall(chunk)
        if len(found) != chunk.count(NODE_SEP) + 1:
            return False
        ids, names, parents, ins, outs, rfs, schemas = zip(*found)
        # One pass: split at each tensor's "[tid,sid," -> text between tensors, tids, sids; that text
        # joined back with "[0,0," is the lines with every tensor's ids blanked.
        parts = TENSOR.split(b"\n".join(x for pair in zip(ins, outs) for x in pair))
        blank = b"[0,0,".join(parts[0::3]).split(b"\n")
        tid, sid = parts[1::3], parts[2::3]
        keys = list(map(b"\n".join, zip(blank[0::2], blank[1::2])))
        get = self.tpl_code.get
        codes = list(map(get, keys))
        if None in codes:
            for k in set(keys) - self.tpl_code.keys():
                a, b = k.split(b"\n")
                code = self.template(k, self.loads(a), self.loads(b))
                if self.tpl_ntensors[code] != len(TENSOR.findall(k)):
                    return False  # (never in torch's output) a tensor-like value the walker reads otherwise
            codes = list(map(get, keys))
        codes = np.array(codes, dtype=np.int32)
        n_t = np.array(self.tpl_ntensors, dtype=np.int64)[codes]
        if n_t.sum() != len(tid):
            return False
        start = self.add_tensors(np.fromiter(map(int, tid), np.int64, len(tid)),
                                 np.fromiter(map(int, sid), np.int64, len(sid)))
        n = len(found)
        t.add(id=np.fromiter(map(int, ids), np.int64, n), name=t.interners["name"].raw_codes(names, self.decode),
              parent=np.fromiter(map(int, parents), np.int64, n), rf_id=np.fromiter(map(int, rfs), np.int64, n),
              schema=t.interners["schema"].raw_codes(schemas, self.decode), tpl=codes,
              t0=start + np.cumsum(n_t) - n_t)
        return True

    def decode(self, raw: bytes) -> str:
        return self.loads(b'"' + raw + b'"')

    # --------------------------------------------------------------------------------- generic path
    def add_dicts(self, nodes: list, t: Table) -> None:
        ids, names, parents, rfs, schemas, codes, t0s, tids, sids = [], [], [], [], [], [], [], [], []
        for n in nodes:
            attrs = {a.get("name"): a.get("value") for a in n.get("attrs", ())}
            ids.append(n.get("id"))
            names.append(n.get("name", ""))
            parents.append(n.get("ctrl_deps", -1))
            rfs.append(attrs.get("rf_id", 0) or 0)
            schemas.append(attrs.get("op_schema", "") or "")
            found: list = []
            blanked = [_blank(n.get(io) or {}, found) for io in ("inputs", "outputs")]
            key = ("dict", repr(blanked))
            codes.append(self.template(key, *blanked))
            t0s.append(self.n_tensors + len(tids))
            tids += [v[0] for v in found]
            sids += [v[1] for v in found]
        self.add_tensors(np.array(tids, dtype=np.int64), np.array(sids, dtype=np.int64))
        t.add(id=ids, name=names, parent=parents, rf_id=rfs, schema=schemas, tpl=codes, t0=t0s)


def _is_tensor_value(v) -> bool:
    """Exactly what TENSOR matches in the text: five non-negative ints and a string."""
    return (isinstance(v, list) and len(v) == 6 and isinstance(v[5], str)
            and all(type(x) is int and x >= 0 for x in v[:5]))


def _blank(v, found: list):
    """A copy of v with every tensor's ids set to 0; the originals appended to `found` in text order."""
    if isinstance(v, dict):
        return {k: _blank(x, found) for k, x in v.items()}
    if isinstance(v, list):
        if _is_tensor_value(v):
            found.append(v)
            return [0, 0, *v[2:]]
        return [_blank(x, found) for x in v]
    return v


def _template(inputs: dict, outputs: dict) -> tuple[list[ArgRow], int]:
    """Argument rows of one node (tensor ids blanked), and how many tensor values its text holds."""
    slot_of: dict[int, int] = {}
    for block in (inputs, outputs):
        _number(block, slot_of)
    rows: list[ArgRow] = []
    for io, block in (("i", inputs), ("o", outputs)):
        block = block if isinstance(block, dict) else {}
        vals, types = block.get("values") or [], block.get("types") or []
        shapes, strides = block.get("shapes") or [], block.get("strides") or []
        for pos, v in enumerate(vals):
            t = types[pos] if pos < len(types) else ""
            shp = shapes[pos] if pos < len(shapes) else ()
            std = strides[pos] if pos < len(strides) else ()
            if t.startswith("GenericList[Tensor") and isinstance(v, list):
                # A tensor list (cat, stack): one row per element, all at this position.
                elem_types = _split_list_types(t)
                for j, tv in enumerate(v):
                    if not (isinstance(tv, list) and len(tv) >= 6):
                        continue
                    et_ = elem_types[j] if j < len(elem_types) else ""
                    rows.append(_tensor_row(io, pos, j, t, tv, slot_of, tuple(shp[j]) if j < len(shp) else (),
                                            tuple(std[j]) if j < len(std) else (),
                                            et_[len(TENSOR_TYPE) + 1:-1] if et_.endswith(")") else ""))
                continue
            if t.startswith(TENSOR_TYPE) and isinstance(v, list) and len(v) >= 6:
                rows.append(_tensor_row(io, pos, -1, t, v, slot_of, tuple(shp), tuple(std),
                                        t[len(TENSOR_TYPE) + 1:-1] if t.endswith(")") else ""))
            else:
                rows.append(ArgRow(io, pos, -1, t, v, -1, -1, -1, 0, 0, 0, None, None, ""))
    return rows, len(slot_of)


def _number(v, slot_of: dict) -> None:
    """Number the tensor values in text order (by object identity: the parsed lists are distinct objects)."""
    if isinstance(v, dict):
        for x in v.values():
            _number(x, slot_of)
    elif isinstance(v, list):
        if _is_tensor_value(v):
            slot_of[id(v)] = len(slot_of)
        else:
            for x in v:
                _number(x, slot_of)


def _tensor_row(io, pos, sub, kind, v, slot_of, shape, strides, dtype) -> ArgRow:
    slot = slot_of.get(id(v), -1)
    return ArgRow(io, pos, sub, kind, None, slot, -1 if slot >= 0 else v[0], -1 if slot >= 0 else v[1], v[2], v[3],
                  v[4], shape, strides, dtype)


def _split_list_types(t: str) -> list[str]:
    """'GenericList[Tensor(float),Tensor(float)]' -> ['Tensor(float)', 'Tensor(float)']."""
    return split_top_level(t[len("GenericList["):-1])
