"""Load a trace (Kineto JSON + optional Execution Trace + optional meta.json) into pandas DataFrames.

Strings that repeat (op names, categories, kernel names) become pandas categoricals, so a million
events cost a million small integers, not a million Python strings.
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from advisor.errors import AdvisorError

LAUNCH_APIS = frozenset({
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
    "cudaLaunchCooperativeKernel", "cudaLaunchCooperativeKernelMultiDevice", "cudaMemcpyAsync", "cudaMemsetAsync",
})
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class TraceFiles:
    kineto: Path
    et: Path | None
    meta: Path | None


@dataclass
class Trace:
    files: TraceFiles
    meta: dict
    ops: pd.DataFrame  # cpu_op + user_annotation events: name, cat, ts, dur, end, tid, ext_id, rf_id
    kernels: pd.DataFrame  # GPU activity: name, cat, ts, dur, ext_id, correlation, stream
    runtime: pd.DataFrame  # cuda_runtime/cuda_driver: name, ts, dur, correlation, ext_id
    modules: pd.DataFrame  # python_function nn.Module events: name, ts, end, tid, py_id, py_parent
    et_nodes: pd.DataFrame  # id, name, parent, rf_id, schema
    et_args: pd.DataFrame  # one row per argument: node, io, pos, kind, value, tensor fields
    device_properties: list = field(default_factory=list)

    @property
    def has_gpu(self) -> bool:
        return len(self.kernels) > 0


def resolve_files(path: Path, et: Path | None = None) -> TraceFiles:
    path = Path(path)
    if not path.exists():
        raise AdvisorError(f"trace not found: {path}")
    if path.is_dir():
        base = path / "trace" if (path / "trace").is_dir() else path
        kineto = _first(base, ["kineto.json.gz", "kineto.json"])
        if kineto is None:
            raise AdvisorError(f"no kineto.json(.gz) in {base}: is this a directory written by `fusion-advisor profile`?")
        et = et or _first(base, ["et.json.gz", "et.json"])
        meta = _first(base, ["meta.json"])
        return TraceFiles(kineto, et, meta)
    meta = path.parent / "meta.json"
    return TraceFiles(path, Path(et) if et else None, meta if meta.exists() else None)


def _first(base: Path, names: list[str]) -> Path | None:
    for n in names:
        if (base / n).exists():
            return base / n
    return None


def read_json(path: Path, what: str):
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise AdvisorError(f"cannot read {what} {path}: {e.strerror}")
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError):
            raise AdvisorError(f"{what} {path} is a truncated or corrupt gzip file")
    if not raw.strip():
        raise AdvisorError(f"{what} {path} is empty")
    try:
        return _loads(raw)
    except ValueError as e:
        raise AdvisorError(f"{what} {path} is not valid JSON (truncated?): {str(e).splitlines()[0][:120]}")


def _loads(raw: bytes):
    try:
        import orjson  # optional: 3-5x faster on large traces

        return orjson.loads(raw)
    except ImportError:
        return json.loads(raw)


def load_trace(path: Path, et: Path | None = None) -> Trace:
    files = resolve_files(path, et)
    doc = read_json(files.kineto, "Kineto trace")
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise AdvisorError(f"{files.kineto} is JSON but not a Kineto/Chrome trace (no 'traceEvents' list)")
    meta = read_json(files.meta, "meta file") if files.meta else {}
    ops, kernels, runtime, modules = _kineto_frames(doc["traceEvents"])
    if len(ops) == 0 and len(kernels) == 0:
        raise AdvisorError(f"{files.kineto} has no cpu_op or kernel events: nothing to analyse")
    et_nodes, et_args = _et_frames(files.et) if files.et else (_empty_nodes(), _empty_args())
    return Trace(files, meta if isinstance(meta, dict) else {}, ops, kernels, runtime, modules, et_nodes, et_args,
                 doc.get("deviceProperties") or [])


# ----------------------------------------------------------------------------------------- Kineto
def _kineto_frames(events: list) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    ops, gpu, rt, mods = [], [], [], []
    for e in events:
        cat = e.get("cat")
        if cat is None or e.get("ph") != "X":
            continue
        if cat in ("cpu_op", "user_annotation"):
            ops.append(e)
        elif cat in GPU_CATS:
            gpu.append(e)
        elif cat in ("cuda_runtime", "cuda_driver"):
            rt.append(e)
        elif cat == "python_function" and e.get("name", "").startswith("nn.Module: "):
            mods.append(e)

    def col(rows, key, default=None):
        return [r.get(key, default) for r in rows]

    def arg(rows, key, default=-1):
        return [(r.get("args") or {}).get(key, default) for r in rows]

    def frame(rows, **extra) -> pd.DataFrame:
        df = pd.DataFrame({
            "name": pd.Categorical(col(rows, "name", "")),
            "cat": pd.Categorical(col(rows, "cat", "")),
            "ts": pd.array(col(rows, "ts", 0.0), dtype="float64"),
            "dur": pd.array(col(rows, "dur", 0.0), dtype="float64"),
            "tid": col(rows, "tid", 0),
            **extra,
        })
        df["dur"] = df["dur"].fillna(0.0)
        df["end"] = df["ts"] + df["dur"]
        return df

    ops_df = frame(ops, ext_id=_ints(arg(ops, "External id")), rf_id=_ints(arg(ops, "Record function id", 0)),
                   seq=_ints(arg(ops, "Sequence number")), dims=arg(ops, "Input Dims", None),
                   types=arg(ops, "Input type", None), concrete=arg(ops, "Concrete Inputs", None))
    ker_df = frame(gpu, ext_id=_ints(arg(gpu, "External id")), correlation=_ints(arg(gpu, "correlation")),
                   stream=_ints(arg(gpu, "stream")))
    rt_df = frame(rt, ext_id=_ints(arg(rt, "External id")), correlation=_ints(arg(rt, "correlation")))
    mod_df = frame(mods, py_id=_ints(arg(mods, "Python id")), py_parent=_ints(arg(mods, "Python parent id")))
    return ops_df, ker_df, rt_df, mod_df


def _ints(values: list) -> pd.Series:
    return pd.to_numeric(pd.Series(values, dtype="object").fillna(-1), errors="coerce").fillna(-1).astype("int64")


# --------------------------------------------------------------------------------------------- ET
_TENSOR_TYPE = "Tensor"


def _et_frames(path: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    doc = read_json(path, "execution trace")
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list):
        raise AdvisorError(f"{path} is JSON but not a PyTorch execution trace (no 'nodes' list)")
    ids, names, parents, rf_ids, schemas = [], [], [], [], []
    a_node, a_io, a_pos, a_sub, a_kind, a_value = [], [], [], [], [], []
    a_tid, a_sid, a_off, a_numel, a_isz, a_shape, a_stride, a_dtype = [], [], [], [], [], [], [], []
    for n in doc["nodes"]:
        nid = n.get("id")
        ids.append(nid)
        names.append(n.get("name", ""))
        parents.append(n.get("ctrl_deps", -1))
        attrs = {a.get("name"): a.get("value") for a in n.get("attrs", ())}
        rf_ids.append(attrs.get("rf_id", 0) or 0)
        schemas.append(attrs.get("op_schema", "") or "")
        for io in ("inputs", "outputs"):
            block = n.get(io) or {}
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
                        et_ = elem_types[j] if j < len(elem_types) else ""
                        if not (isinstance(tv, list) and len(tv) >= 6):
                            continue
                        a_node.append(nid); a_io.append(io[0]); a_pos.append(pos); a_sub.append(j); a_kind.append(t)
                        a_value.append(None)
                        a_tid.append(tv[0]); a_sid.append(tv[1]); a_off.append(tv[2]); a_numel.append(tv[3])
                        a_isz.append(tv[4])
                        a_shape.append(tuple(shp[j]) if j < len(shp) else ())
                        a_stride.append(tuple(std[j]) if j < len(std) else ())
                        a_dtype.append(et_[len(_TENSOR_TYPE) + 1:-1] if et_.endswith(")") else "")
                    continue
                is_tensor = t.startswith(_TENSOR_TYPE) and isinstance(v, list) and len(v) >= 6
                a_node.append(nid)
                a_io.append(io[0])  # "i" / "o"
                a_pos.append(pos)
                a_sub.append(-1)
                a_kind.append(t)
                if is_tensor:
                    a_value.append(None)
                    a_tid.append(v[0]); a_sid.append(v[1]); a_off.append(v[2]); a_numel.append(v[3]); a_isz.append(v[4])
                    a_shape.append(tuple(shp))
                    a_stride.append(tuple(std))
                    a_dtype.append(t[len(_TENSOR_TYPE) + 1:-1] if t.endswith(")") else "")
                else:
                    a_value.append(v)
                    a_tid.append(-1); a_sid.append(-1); a_off.append(0); a_numel.append(0); a_isz.append(0)
                    a_shape.append(None); a_stride.append(None); a_dtype.append("")
    nodes = pd.DataFrame({"id": pd.array(ids, dtype="int64"), "name": pd.Categorical(names),
                          "parent": pd.array(parents, dtype="int64"), "rf_id": pd.array(rf_ids, dtype="int64"),
                          "schema": pd.Categorical(schemas)})
    args = pd.DataFrame({
        "node": pd.array(a_node, dtype="int64"), "io": pd.Categorical(a_io), "pos": pd.array(a_pos, dtype="int32"),
        "sub": pd.array(a_sub, dtype="int32"),
        "kind": pd.Categorical(a_kind), "value": a_value,
        "tensor_id": pd.array(a_tid, dtype="int64"), "storage_id": pd.array(a_sid, dtype="int64"),
        "offset": pd.array(a_off, dtype="int64"), "numel": pd.array(a_numel, dtype="int64"),
        "itemsize": pd.array(a_isz, dtype="int64"), "shape": a_shape, "strides": a_stride,
        "dtype": pd.Categorical(a_dtype),
    })
    return nodes, args


def _split_list_types(t: str) -> list[str]:
    """'GenericList[Tensor(float),Tensor(float)]' -> ['Tensor(float)', 'Tensor(float)']."""
    inner = t[len("GenericList["):-1]
    out, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        depth += ch in "([" 
        depth -= ch in ")]"
        cur += ch
    if cur:
        out.append(cur)
    return out


def _empty_nodes() -> pd.DataFrame:
    return pd.DataFrame({"id": pd.array([], dtype="int64"), "name": pd.Categorical([]),
                         "parent": pd.array([], dtype="int64"), "rf_id": pd.array([], dtype="int64"),
                         "schema": pd.Categorical([])})


def _empty_args() -> pd.DataFrame:
    return pd.DataFrame({c: [] for c in ["node", "io", "pos", "sub", "kind", "value", "tensor_id", "storage_id", "offset",
                                         "numel", "itemsize", "shape", "strides", "dtype"]})
