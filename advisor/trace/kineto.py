"""Kineto events -> the four frames the analyzer reads: ops, kernels, runtime calls, nn.Module calls.

Fast path (torch's layout, see stream.py): one regex pass over each chunk picks out only the events we
keep -- the with_stack python frames, most of a big trace, are skipped without being parsed -- and
captures their fields as bytes. A cpu op's args line is its ids (which differ every time) followed by
its input shapes, types and concrete values (which repeat every layer and iteration): the ids are cut
off and the rest becomes a categorical "signature", parsed once per distinct value. Kernel and runtime
args get the same treatment: External id and correlation cut out, the rest (stream, grid, ...) parsed
once per distinct value.

Anything the fast path does not recognise in a chunk (a missing field, other spacing) sends that chunk
down the generic path: parse it whole and pick fields from dicts, as a plain json.load would.
"""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from advisor.trace.columns import Table, objects

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
OP_CATS = ("cpu_op", "user_annotation")
MODULE_PREFIX = "nn.Module: "

# A JSON string's body, escapes and all (unrolled: a run of plain characters is one fast class repeat).
_STR = rb'"([^"\\\n]*(?:\\.[^"\\\n]*)*)"'
EVENT = re.compile(
    rb'\{\n    "ph": "X", "cat": "(cpu_op|user_annotation|kernel|gpu_memcpy|gpu_memset|cuda_runtime|cuda_driver'
    rb'|python_function(?=", "name": "nn\.Module: ))"'
    rb'(?:, "name": ' + _STR + rb', "pid": -?\d+, "tid": (-?\d+),\n    "ts": ([-+.\deE]+), "dur": ([-+.\deE]+)'
    rb'(?:,\n    "args": \{\n      ([^\n]*(?:\n      [^\n]*)*)\n    \})?\n  \})?')  # rest optional: a miss shows as no ts
OP_ARGS = re.compile(
    rb'^"External id": (-?\d+),(?:"Sequence number": (-?\d+), "Fwd thread id": -?\d+, )?'
    rb'(?:"Record function id": (-?\d+))?(?:, )?(?:(?:(.*), |)"Ev Idx": -?\d+|(.*))$', re.M)
LAUNCH_ARGS = re.compile(rb'^(?:"External id": (-?\d+),)?(.*?)"correlation": (-?\d+)(.*)$', re.M)
FRAME_OF = {**{c.encode(): "ops" for c in OP_CATS}, **{c.encode(): "kernels" for c in GPU_CATS},
            **{c.encode(): "runtime" for c in RUNTIME_CATS}, b"python_function": "modules"}
ID_KEYS = {"External id", "Record function id", "Sequence number", "Fwd thread id", "Ev Idx"}


class Mismatch(Exception):
    """The fast path does not recognise this chunk."""


def tables() -> dict[str, Table]:
    base = dict(name="cat", cat="cat", ts="f8", dur="f8", tid="i8")
    return {"ops": Table(**base, ext_id="i8", rf_id="i8", seq="i8", dims="obj", types="obj", concrete="obj"),
            "kernels": Table(**base, ext_id="i8", correlation="i8", stream="i8"),
            "runtime": Table(**base, ext_id="i8", correlation="i8"),
            "modules": Table(**base, py_id="i8", py_parent="i8")}


def frames(t: dict[str, Table]) -> tuple[pd.DataFrame, ...]:
    out = []
    for key in ("ops", "kernels", "runtime", "modules"):
        df = t[key].frame()
        df["dur"] = df["dur"].fillna(0.0)
        df["end"] = df["ts"] + df["dur"]
        out.append(df)
    return tuple(out)


class FastParser:
    """Per-file state of the fast path: the signature cache and the string decoders."""

    def __init__(self, loads) -> None:
        self.loads = loads
        self.sig_code: dict[bytes, int] = {}
        self.sigs: list[tuple] = []  # (dims, types, concrete) per signature
        self.launch_code: dict[bytes, object] = {}  # kernel/runtime args less their ids -> stream

    def chunk(self, chunk: bytes, t: dict[str, Table]) -> None:
        """Add a chunk's events to the tables, or raise Mismatch having added nothing."""
        rows: dict[str, list] = {"ops": [], "kernels": [], "runtime": [], "modules": []}
        append = {cat: rows[key].append for cat, key in FRAME_OF.items()}
        for m in EVENT.findall(chunk):
            append[m[0]](m)
        staged = [(key, self._ops(r, t[key]) if key == "ops" else self._with_args(key, r, t[key]))
                  for key, r in rows.items() if r]
        for key, cols in staged:
            t[key].add(**cols)

    def _base(self, rows: list, table: Table) -> tuple[dict, tuple]:
        cats, names, tids, ts, dur, args = zip(*rows)
        if b"" in ts:  # the event's cat matched but the rest of it did not
            raise Mismatch("event not in torch's layout")
        n = len(rows)
        return {"name": table.interners["name"].raw_codes(names, self.decode),
                "cat": table.interners["cat"].raw_codes(cats, bytes.decode),
                "tid": np.fromiter(map(int, tids), np.int64, n), "ts": np.fromiter(map(float, ts), np.float64, n),
                "dur": np.fromiter(map(float, dur), np.float64, n)}, args

    def _ops(self, rows: list, table: Table) -> dict:
        cols, args = self._base(rows, table)
        parsed = OP_ARGS.findall(b"\n".join(args))
        if len(parsed) != len(rows):
            raise Mismatch("cpu op args not in torch's layout")
        ext, seq, rf, sig_a, sig_b = zip(*parsed)
        code = self.sig_code
        keys = list(map(bytes.__add__, sig_a, sig_b))  # one of the two alternatives is empty: a + b is a or b
        sig = list(map(code.get, keys))
        if None in sig:
            for s in set(keys) - code.keys():
                self._new_sig(s)
            sig = list(map(code.__getitem__, keys))
        sig = np.array(sig, dtype=np.int64)
        cols.update(ext_id=np.fromiter(map(int, ext), np.int64, len(rows)), rf_id=_optional_ints(rf, 0),
                    seq=_optional_ints(seq, -1),
                    **{c: objects(s[j] for s in self.sigs)[sig] for j, c in enumerate(("dims", "types", "concrete"))})
        return cols

    def _new_sig(self, s: bytes) -> None:
        d = self.loads(b"{" + s + b"}") if s else {}
        if ID_KEYS & d.keys():
            raise Mismatch("cpu op args in an unexpected order")
        self.sig_code[s] = len(self.sigs)
        self.sigs.append((d.get("Input Dims"), d.get("Input type"), d.get("Concrete Inputs")))

    def _with_args(self, key: str, rows: list, table: Table) -> dict:
        cols, args = self._base(rows, table)
        if key == "modules":  # rare (nn.Module python frames): parse their args whole
            cols.update(arg_columns(key, self.loads(b"[{" + b"},{".join(args) + b"}]")))
            return cols
        # Kernel and runtime args: External id and correlation change every event, the rest (stream,
        # grid, block, ...) repeats per kernel: the rest is parsed once per distinct value.
        parsed = LAUNCH_ARGS.findall(b"\n".join(args))
        if len(parsed) != len(rows):
            raise Mismatch("launch args not in torch's layout")
        ext, mid, corr, tail = zip(*parsed)
        keys = list(map(b"\0".join, zip(mid, tail)))
        code = self.launch_code
        for k in set(keys) - code.keys():
            a, b = k.split(b"\0")
            if b'"External id"' in k or b'"correlation"' in k:
                raise Mismatch("launch args repeat an id")
            code[k] = self.loads(b"{" + a + b'"correlation": 0' + b + b"}").get("stream", -1)
        n = len(rows)
        cols.update(ext_id=_optional_ints(ext, -1), correlation=np.fromiter(map(int, corr), np.int64, n))
        if key == "kernels":
            cols["stream"] = _int_values(list(map(code.__getitem__, keys)), -1)
        return cols

    def decode(self, raw: bytes) -> str:
        return self.loads(b'"' + raw + b'"')


def arg_columns(key: str, args: list[dict]) -> dict:
    """The id columns of one frame from its events' args dicts (missing or null -> the default)."""
    if key == "kernels":
        return {"ext_id": _ints(args, "External id"), "correlation": _ints(args, "correlation"),
                "stream": _ints(args, "stream")}
    if key == "runtime":
        return {"ext_id": _ints(args, "External id"), "correlation": _ints(args, "correlation")}
    if key == "modules":
        return {"py_id": _ints(args, "Python id"), "py_parent": _ints(args, "Python parent id")}
    return {"ext_id": _ints(args, "External id"), "rf_id": _ints(args, "Record function id", 0),
            "seq": _ints(args, "Sequence number"), "dims": [a.get("Input Dims") for a in args],
            "types": [a.get("Input type") for a in args], "concrete": [a.get("Concrete Inputs") for a in args]}


def _optional_ints(raw: tuple, default: int) -> np.ndarray:
    """Captured integers, `default` where the field was absent (captured empty)."""
    if b"" not in raw:
        return np.fromiter(map(int, raw), np.int64, len(raw))
    if not any(raw):
        return np.full(len(raw), default, dtype=np.int64)
    return np.array([int(r) if r else default for r in raw], dtype=np.int64)


def _ints(args: list[dict], key: str, default: int = -1) -> np.ndarray:
    return _int_values([a.get(key, default) for a in args], default)


def _int_values(values: list, default: int = -1) -> np.ndarray:
    """Values as int64 (None -> default; strings, floats, bools coerced as pandas would)."""
    try:
        return np.array([default if v is None else v for v in values], dtype=np.int64)
    except (TypeError, ValueError, OverflowError):  # strings, floats, bools: as pandas would coerce them
        s = pd.to_numeric(pd.Series(values, dtype="object").fillna(-1), errors="coerce")
        return s.fillna(-1).astype("int64").to_numpy()


def add_dicts(events: list, t: dict[str, Table]) -> None:
    """The generic path: events as dicts (a chunk parsed whole, or a whole document)."""
    rows: dict[str, list] = {"ops": [], "kernels": [], "runtime": [], "modules": []}
    for e in events:
        if not isinstance(e, dict):
            continue
        cat = e.get("cat")
        if cat is None or e.get("ph") != "X":
            continue
        if cat in OP_CATS:
            rows["ops"].append(e)
        elif cat in GPU_CATS:
            rows["kernels"].append(e)
        elif cat in RUNTIME_CATS:
            rows["runtime"].append(e)
        elif cat == "python_function" and str(e.get("name", "")).startswith(MODULE_PREFIX):
            rows["modules"].append(e)
    for key, evs in rows.items():
        if not evs:
            continue
        args = [e.get("args") or {} for e in evs]
        t[key].add(name=[str(e.get("name", "")) for e in evs], cat=[str(e["cat"]) for e in evs],
                   ts=pd.to_numeric(pd.Series([e.get("ts", 0.0) for e in evs], dtype="object"),
                                    errors="coerce").astype("float64").to_numpy(),
                   dur=pd.to_numeric(pd.Series([e.get("dur", 0.0) for e in evs], dtype="object"),
                                     errors="coerce").astype("float64").to_numpy(),
                   tid=_ints([e for e in evs], "tid", 0), **arg_columns(key, args))


def counts(t: dict[str, Table]) -> dict[str, int]:
    return {k: sum(len(p) for p in v.parts["ts"]) for k, v in t.items()}
