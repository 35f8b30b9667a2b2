"""Load a trace (Kineto JSON + optional Execution Trace + optional meta.json) into pandas DataFrames.

Both traces are read a chunk at a time (stream.py) and only the fields the analyzer uses are kept, as
flat columns: strings that repeat (op names, categories, kernel names) become pandas categoricals, an
ET node's arguments become a shared template plus its tensor ids (et.py), so a million kernels cost a
few arrays of ints, not millions of Python dicts. A file not laid out the way torch writes it is
parsed whole instead, into the same frames.
"""
from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from advisor import config
from advisor.errors import AdvisorError
from advisor.trace import et as et_mod
from advisor.trace import kineto
from advisor.trace.stream import NotTorchLayout, loads, read_bytes, stream_array

LAUNCH_APIS = frozenset({
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
    "cudaLaunchCooperativeKernel", "cudaLaunchCooperativeKernelMultiDevice", "cudaMemcpyAsync", "cudaMemsetAsync",
})
GPU_CATS = kineto.GPU_CATS


@dataclass
class TraceFiles:
    kineto: Path
    et: Path | None
    meta: Path | None


@dataclass
class Trace:
    files: TraceFiles
    meta: dict
    ops: pd.DataFrame  # cpu_op + user_annotation events: name, cat, ts, dur, end, tid, ext_id, rf_id, seq, dims, ...
    kernels: pd.DataFrame  # GPU activity: name, cat, ts, dur, ext_id, correlation, stream
    runtime: pd.DataFrame  # cuda_runtime/cuda_driver: name, ts, dur, correlation, ext_id
    modules: pd.DataFrame  # python_function nn.Module events: name, ts, end, tid, py_id, py_parent
    et_nodes: pd.DataFrame  # id, name, parent, rf_id, schema, tpl (argument template), t0 (first tensor id)
    et: et_mod.EtArgs = field(default_factory=et_mod.EtArgs)  # argument templates + flat tensor/storage ids
    device_properties: list = field(default_factory=list)

    @property
    def has_gpu(self) -> bool:
        return len(self.kernels) > 0

    @property
    def et_args(self) -> pd.DataFrame:
        """One row per ET argument: node, io, pos, sub, kind, value, tensor fields (built on demand)."""
        return self.et.frame(self.et_nodes)


def resolve_files(path: Path, et: Path | None = None) -> TraceFiles:
    path = Path(path)
    if not path.exists():
        raise AdvisorError(f"trace not found: {path}")
    if path.is_dir():
        base = path / "trace" if (path / "trace").is_dir() else path
        kin = _first(base, ["kineto.json.gz", "kineto.json"])
        if kin is None:
            raise AdvisorError(f"no kineto.json(.gz) in {base}: is this a directory written by `fusion-advisor profile`?")
        et = et or _first(base, ["et.json.gz", "et.json"])
        meta = _first(base, ["meta.json"])
        return TraceFiles(kin, et, meta)
    meta = path.parent / "meta.json"
    return TraceFiles(path, Path(et) if et else None, meta if meta.exists() else None)


def _first(base: Path, names: list[str]) -> Path | None:
    for n in names:
        if (base / n).exists():
            return base / n
    return None


def read_json(path: Path, what: str):
    """A whole (small) JSON file, gunzipped if need be; AdvisorError with one line if it is not JSON."""
    return _parse(read_bytes(path, what), path, what)


def _parse(raw: bytes, path: Path, what: str):
    if not raw.strip():
        raise AdvisorError(f"{what} {path} is empty")
    try:
        return loads(raw)
    except ValueError as e:
        raise AdvisorError(f"{what} {path} is not valid JSON (truncated?): {str(e).splitlines()[0][:120]}")


@contextmanager
def gc_paused():
    """No cyclic GC while millions of objects are made: each collection would walk them all, for nothing
    (nothing here makes cycles). On the way out they go straight to the oldest generation (freeze then
    unfreeze), or the first young-generation collection after re-enabling would walk them all at once."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            if not gc.get_freeze_count():  # leave a caller's own frozen objects alone
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def load_trace(path: Path, et: Path | None = None, stream: bool = True) -> Trace:
    """stream=False parses each file whole (json.load style) instead: the reference the tests hold the
    streaming parser to."""
    files = resolve_files(path, et)
    meta = read_json(files.meta, "meta file") if files.meta else {}
    with gc_paused():
        worker = _start_et_worker(files.et) if stream else None
        try:
            ops, kernels, runtime, modules, props = _kineto(files.kineto, stream)
            if len(ops) == 0 and len(kernels) == 0:
                raise AdvisorError(f"{files.kineto} has no cpu_op or kernel events: nothing to analyse")
        except BaseException:
            if worker is not None:
                worker.kill()
                worker.stdout.close()
                worker.wait()
            raise
        if worker is not None:
            et_nodes, et_args = _finish_et_worker(worker, files.et)
        else:
            et_nodes, et_args = _et(files.et, stream) if files.et else (et_mod.node_table().frame(), et_mod.EtArgs())
    return Trace(files, meta if isinstance(meta, dict) else {}, ops, kernels, runtime, modules, et_nodes, et_args,
                 props or [])


# ----------------------------------------------------------------------------------------- Kineto
def _kineto(path: Path, stream: bool = True):
    what = "Kineto trace"
    tables = kineto.tables()
    try:
        if not stream:
            raise NotTorchLayout(what)
        chunks, rest = stream_array(path, what, "traceEvents", b"  ")
    except NotTorchLayout:
        doc = _parse(read_bytes(path, what), path, what)
        if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
            raise AdvisorError(f"{path} is JSON but not a Kineto/Chrome trace (no 'traceEvents' list)")
        kineto.add_dicts(doc["traceEvents"], tables)
        return (*kineto.frames(tables), doc.get("deviceProperties"))
    fast = kineto.FastParser(loads)
    for i, chunk in enumerate(chunks):
        if fast is not None:
            try:
                if i == 0 and not _fast_agrees(chunk, fast, path, what):
                    fast = None  # a layout the regexes misread: be safe, parse every chunk whole
                else:
                    fast.chunk(chunk, tables)
                    continue
            except kineto.Mismatch:
                pass
        kineto.add_dicts(_parse_chunk(chunk, path, what), tables)
    return (*kineto.frames(tables), rest.get("deviceProperties"))


def _fast_agrees(chunk: bytes, fast: kineto.FastParser, path: Path, what: str) -> bool:
    """On the first chunk, the fast path must keep as many events of each kind as the generic one."""
    a, b = kineto.tables(), kineto.tables()
    try:
        fast.chunk(chunk, a)
    except kineto.Mismatch:
        return True  # this chunk goes the generic way anyway
    try:
        kineto.add_dicts(loads(b"[" + chunk + b"]"), b)
    except ValueError as e:
        raise AdvisorError(f"{what} {path} is not valid JSON: {str(e).splitlines()[0][:120]}")
    return kineto.counts(a) == kineto.counts(b)


def _parse_chunk(chunk: bytes, path: Path, what: str) -> list:
    try:
        return loads(b"[" + chunk + b"]")
    except ValueError as e:
        raise AdvisorError(f"{what} {path} is not valid JSON: {str(e).splitlines()[0][:120]}")


# --------------------------------------------------------------------------------------------- ET
ET_WORKER_BYTES = 8 << 20  # an ET file at least this big (on disk) is parsed in a second process


def _start_et_worker(path: Path | None) -> subprocess.Popen | None:
    """Parse a big ET in another process while this one parses the Kineto trace: two cores, not one."""
    if path is None or config.current().one_process:
        return None
    try:
        if path.stat().st_size < ET_WORKER_BYTES:
            return None
    except OSError:
        return None  # the in-process parse reports it
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:  # stderr is dropped: errors come back pickled, anything else means "parse it here"
        return subprocess.Popen([sys.executable, "-m", "advisor.trace.et_worker", str(path)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    except OSError:
        return None


def _finish_et_worker(worker: subprocess.Popen, path: Path) -> tuple[pd.DataFrame, et_mod.EtArgs]:
    try:
        result = pickle.load(worker.stdout)  # straight from the pipe: no second copy of the bytes
    except Exception:  # noqa: BLE001 - nothing or half a result: the worker died (out of memory, killed)
        result = None
    worker.stdout.close()
    if worker.wait() != 0 or result is None:  # parse it here instead, slower but sure
        return _et(path)
    if isinstance(result[0], str):  # ("error", message)
        raise AdvisorError(result[1])
    return result


def _et(path: Path, stream: bool = True) -> tuple[pd.DataFrame, et_mod.EtArgs]:
    what = "execution trace"
    table = et_mod.node_table()
    builder = et_mod.Builder(loads)
    try:
        if not stream:
            raise NotTorchLayout(what)
        chunks, _ = stream_array(path, what, "nodes", b"      ")
    except NotTorchLayout:
        doc = _parse(read_bytes(path, what), path, what)
        if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list):
            raise AdvisorError(f"{path} is JSON but not a PyTorch execution trace (no 'nodes' list)")
        builder.add_dicts(doc["nodes"], table)
        return table.frame(), builder.finish()
    for chunk in chunks:
        if not builder.chunk(chunk, table):
            builder.add_dicts(_parse_chunk(chunk, path, what), table)
    return table.frame(), builder.finish()
