"""Column builders: a table grows chunk by chunk as flat arrays; strings are interned as categorical codes."""
from __future__ import annotations

import numpy as np
import pandas as pd


def objects(values) -> np.ndarray:
    """A 1-d object array of these values, lists kept whole (plain assignment could broadcast them)."""
    values = list(values)
    return np.fromiter(values, dtype=object, count=len(values))


class Interner:
    """str -> small int code, in order of first appearance; `categorical` sorts the categories like pandas."""

    def __init__(self) -> None:
        self.code: dict[str, int] = {}
        self.raw: dict[bytes, int] = {}  # JSON string bodies as written (escapes and all) -> code

    def raw_codes(self, raws, decode) -> np.ndarray:
        """Codes of raw JSON string bodies; `decode` turns a new one into its str (once per distinct body)."""
        raw = self.raw
        out = list(map(raw.get, raws))
        if None in out:
            for r in set(raws) - raw.keys():
                raw[r] = self.code.setdefault(decode(r), len(self.code))
            out = list(map(raw.__getitem__, raws))
        return np.array(out, dtype=np.int32)

    def codes(self, strings) -> np.ndarray:
        code = self.code
        out = list(map(code.get, strings))
        if None in out:
            out = [code.setdefault(s, len(code)) for s in strings]
        return np.array(out, dtype=np.int32)

    def categorical(self, codes: np.ndarray) -> pd.Categorical:
        names = list(self.code)
        order = sorted(range(len(names)), key=names.__getitem__)
        remap = np.empty(len(names) + 1, dtype=np.int32)
        remap[order] = np.arange(len(names), dtype=np.int32)
        return pd.Categorical.from_codes(remap[codes] if len(codes) else codes, [names[i] for i in order])


class Table:
    """Columns of kind 'cat' (codes of an Interner), 'f8', 'i8', 'i4' or 'obj', appended a chunk at a time."""

    def __init__(self, **kinds: str) -> None:
        self.kinds = kinds
        self.parts: dict[str, list] = {c: [] for c in kinds}
        self.interners = {c: Interner() for c, k in kinds.items() if k == "cat"}

    def add(self, **cols) -> None:
        for c, v in cols.items():
            kind = self.kinds[c]
            if kind == "cat":
                v = v if isinstance(v, np.ndarray) else self.interners[c].codes(v)
            elif kind == "obj":
                v = v if isinstance(v, np.ndarray) else objects(v)
            else:
                v = np.asarray(v, dtype={"f8": np.float64, "i8": np.int64, "i4": np.int32}[kind])
            self.parts[c].append(v)

    def column(self, c: str):
        parts = self.parts[c]
        kind = self.kinds[c]
        empty = {"cat": np.int32, "obj": object, "f8": np.float64, "i8": np.int64, "i4": np.int32}[kind]
        v = np.concatenate(parts) if parts else np.empty(0, dtype=empty)
        return self.interners[c].categorical(v) if kind == "cat" else v

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame({c: self.column(c) for c in self.kinds})
