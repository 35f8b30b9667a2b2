"""Synthetic Kineto + ET trace pairs of any size, cut from a real sample trace.

The first steady-state iteration of a recorded trace (by default the H100 hf_llama sample) is repeated
N times back to back, like a model with N times as many layers. Each copy gets fresh External ids,
correlation ids, Record function ids, Python ids, Ev Idx, ET node ids and tensor/storage ids (offset
per copy, so dataflow stays inside each copy) and timestamps shifted by the source's iteration period.
Everything the source recorded before that iteration (model set-up, the warm-up call) is kept once in
front, so the analyzer still has to cut the steady window out; meta.json gets one window over all copies.

The text is the source's own event text with only those numbers changed, so the layout (indentation,
field order, spacing) is exactly what torch wrote.

    python -m bench.synth_trace OUT_DIR --kernels 1000000   # OUT_DIR/trace/{kineto,et}.json.gz + meta.json
    python -m bench.synth_trace OUT_DIR --copies 3 --plain  # uncompressed kineto.json / et.json
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import queue
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SOURCE = ROOT / "sample_traces" / "hf_llama"
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}
OP_CATS = {"cpu_op", "user_annotation"}
RUNTIME_CATS = {"cuda_runtime", "cuda_driver"}

# Numbers that identify something; each alternative captures (prefix, number). A number is only renumbered
# when it is one of the copied iteration's own ids (a Python parent id of a frame opened before the
# iteration, or a ctrl_deps pointing at the ET root, stays as it is).
KINETO_IDS = re.compile(r'("ts": )(\d+)(?=\.)|("External id": )(\d+)|("Record function id": )(\d+)'
                        r'|("correlation": )(\d+)|("Python id": )(\d+)|("Python parent id": )(\d+)'
                        r'|("Ev Idx": )(\d+)|("ph": "[sf]", "id": )(\d+)')
KINETO_FAMILY = ["ts", "ext", "rf", "corr", "py", "py", "ev", "corr"]
ET_IDS = re.compile(r'("id": )(\d+)|("ctrl_deps": )(\d+)|("name": "rf_id", "type": "uint64", "value": )(\d+)'
                    r'|("name": "fw_parent", "type": "uint64", "value": )(\d+)'
                    r'|(\[)(\d+,\d+)(?=,\d+,\d+,\d+,"[^"]*"\])')  # a tensor: [tensor id, storage id, ...]
ET_FAMILY = ["node", "node", "rf", "rf", "tensor"]


def split_array(text: str, key: str, indent: str) -> tuple[str, list[str], str]:
    """(head, elements, tail) of the pretty-printed JSON array `key`, whose elements open at `indent`."""
    start = text.index(f'"{key}": [\n') + len(f'"{key}": [\n')
    end = text.rindex("\n  ]")
    sep = f"\n{indent}}},\n{indent}{{"
    parts = text[start:end].split(sep)
    elements = [(p if i == 0 else indent + "{" + p) + ("" if i == len(parts) - 1 else f"\n{indent}}}")
                for i, p in enumerate(parts)]
    return text[:start], elements, text[end:]


class Template:
    """The text of one copy with its renumbered ids as %d slots: copy k = text % (base + k * step)."""

    def __init__(self, elements: list[str], pattern: re.Pattern, families: list[str], own: dict, step: dict):
        base, steps = [], []

        def slot(m: re.Match) -> str:
            g = m.lastindex - 1  # the alternative that matched: groups (2g+1, 2g+2)
            family, prefix, num = families[g // 2], m.group(g), m.group(g + 1)
            if family == "tensor":  # two numbers: tensor id and storage id, both renumbered
                tid, sid = (int(x) for x in num.split(","))
                base.extend((tid, sid))
                steps.extend((step["tensor"], step["storage"]))
                return prefix + "%d,%d"
            value = int(num)
            if family != "ts" and value not in own[family]:
                return m.group(0)
            base.append(value)
            steps.append(step[family])
            return prefix + "%d"

        self.text = pattern.sub(slot, ",\n".join(elements).replace("%", "%%"))
        self.base = np.array(base, dtype=np.int64)
        self.step = np.array(steps, dtype=np.int64)

    def render(self, k: int) -> str:
        return self.text % tuple((self.base + k * self.step).tolist())


def _ints(events, cats, key) -> set:
    return {e["args"][key] for e in events if e.get("cat") in cats and isinstance((e.get("args") or {}).get(key), int)}


def _select_kineto(events: list[dict], a: float, b: float) -> tuple[list[int], list[int], list[int], dict]:
    """Indices of the iteration's events, of everything recorded before it, and of trace metadata."""
    cpu = [i for i, e in enumerate(events) if e.get("ph") == "X" and e.get("cat") not in GPU_CATS
           and e.get("cat") not in ("overhead", "Trace") and isinstance(e.get("ts"), (int, float))]
    it_cpu = [i for i in cpu if a <= events[i]["ts"] <= b]
    pre_cpu = [i for i in cpu if events[i]["ts"] < a]

    def with_gpu(cpu_idx: list[int]) -> tuple[list[int], dict]:
        evs = [events[i] for i in cpu_idx]
        own = {"ext": _ints(evs, OP_CATS | RUNTIME_CATS, "External id"), "rf": _ints(evs, OP_CATS, "Record function id"),
               "corr": _ints(evs, RUNTIME_CATS, "correlation"), "py": _ints(evs, {"python_function"}, "Python id"),
               "ev": _ints(evs, OP_CATS | {"python_function"}, "Ev Idx")}
        ua_ext = _ints(evs, {"user_annotation"}, "External id")
        gpu = []
        for i, e in enumerate(events):
            args = e.get("args") or {}
            if e.get("cat") in GPU_CATS and (args.get("correlation") in own["corr"]
                                             or (e["cat"] == "gpu_user_annotation" and args.get("External id") in ua_ext)):
                gpu.append(i)
            elif e.get("cat") == "ac2g" and e.get("id") in own["corr"]:
                gpu.append(i)
        return sorted(set(cpu_idx) | set(gpu)), own

    iteration, own = with_gpu(it_cpu)
    prefix, _ = with_gpu(pre_cpu)
    metadata = [i for i, e in enumerate(events) if e.get("ph") in ("M", "i") or e.get("cat") == "Trace"]
    return iteration, prefix, metadata, own


def _attr(node: dict, name: str):
    return next((x.get("value") for x in node.get("attrs", ()) if x.get("name") == name), None)


def synthesize(out_dir: Path, copies: int, source: Path = DEFAULT_SOURCE, compress: bool = True,
               log=lambda *a: None) -> Path:
    """Write out_dir/trace/{kineto,et}.json[.gz] + meta.json with `copies` copies of the source's iteration."""
    src = source / "trace" if (source / "trace").is_dir() else source
    meta = json.loads((src / "meta.json").read_text())
    kin_text = gzip.decompress((src / "kineto.json.gz").read_bytes()).decode()
    et_text = gzip.decompress((src / "et.json.gz").read_bytes()).decode()
    wins = meta["steady_state"]["iterations"]
    a, b = wins[0]
    period = math.ceil((wins[1][0] - a) if len(wins) > 1 else (b - a) + 1)  # whole us: fractions stay as written

    k_head, k_els, k_tail = split_array(kin_text, "traceEvents", "  ")
    events = json.loads(kin_text)["traceEvents"]
    assert len(events) == len(k_els), "source trace is not in torch's layout"
    it_idx, pre_idx, meta_idx, own = _select_kineto(events, a, b)

    e_head, e_els, e_tail = split_array(et_text, "nodes", "      ")
    nodes = json.loads(et_text)["nodes"]
    assert len(nodes) == len(e_els), "source execution trace is not in torch's layout"
    pre_rf = _ints([events[i] for i in pre_idx], OP_CATS, "Record function id")
    it_nodes = [i for i, n in enumerate(nodes) if _attr(n, "rf_id") in own["rf"]]
    pre_nodes = [i for i, n in enumerate(nodes) if _attr(n, "rf_id") in pre_rf]
    kept_ids = {nodes[i]["id"] for i in it_nodes + pre_nodes}
    parents = {nodes[i]["ctrl_deps"] for i in it_nodes + pre_nodes} - kept_ids
    by_id = {n["id"]: i for i, n in enumerate(nodes)}
    roots: set[int] = set()
    while parents:  # the ET's process/thread root nodes above the kept ops
        p = parents.pop()
        if p in by_id and by_id[p] not in roots:
            roots.add(by_id[p])
            parents.add(nodes[by_id[p]]["ctrl_deps"])
    own["node"] = {nodes[i]["id"] for i in it_nodes}

    def span(values) -> int:  # > every id of that kind in the source: copies never collide with anything
        return max(values) + 1

    tensors = [int(x) for m in re.finditer(r"\[(\d+),(\d+),\d+,\d+,\d+,\"[^\"]*\"\]", et_text) for x in m.groups()]
    step = {"ts": period, "ext": span(_ints(events, OP_CATS | RUNTIME_CATS | GPU_CATS, "External id")),
            "rf": span(_ints(events, OP_CATS, "Record function id") | {_attr(n, "rf_id") or 0 for n in nodes}),
            "corr": span(_ints(events, RUNTIME_CATS | GPU_CATS, "correlation")),
            "py": span(_ints(events, {"python_function"}, "Python id")),
            "ev": span(_ints(events, OP_CATS | {"python_function"}, "Ev Idx")),
            "node": span(n["id"] for n in nodes), "tensor": span(tensors[0::2]), "storage": span(tensors[1::2])}
    kin_tpl = Template([k_els[i] for i in it_idx], KINETO_IDS, KINETO_FAMILY, own, step)
    et_tpl = Template([e_els[i] for i in it_nodes], ET_IDS, ET_FAMILY, own, step)

    trace_dir = out_dir / "trace"
    trace_dir.mkdir(parents=True, exist_ok=True)
    ext = ".json.gz" if compress else ".json"
    for stale in trace_dir.glob("*.json*"):
        stale.unlink()
    t0 = time.perf_counter()
    _write(trace_dir / f"kineto{ext}", k_head, [k_els[i] for i in pre_idx], kin_tpl, copies,
           [k_els[i] for i in meta_idx], k_tail, compress)
    log(f"kineto written in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    _write(trace_dir / f"et{ext}", e_head, [e_els[i] for i in pre_nodes], et_tpl, copies,
           [e_els[i] for i in sorted(roots)], e_tail, compress)
    log(f"et written in {time.perf_counter() - t0:.1f} s")

    per_copy = sum(1 for i in it_idx if events[i].get("cat") == "kernel")
    meta["steady_state"] = {**meta["steady_state"], "iterations": [[a, b + (copies - 1) * period]],
                            "warmup_dropped": 0, "found": 1}
    meta["kernels"] = per_copy * copies
    meta["cpu_ops"] = sum(1 for i in it_idx if events[i].get("cat") == "cpu_op") * copies
    meta["synthetic"] = {"source": str(source), "copies": copies, "kernels_per_copy": per_copy,
                         "period_us": period}
    (trace_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return trace_dir


def _write(path: Path, head: str, before: list[str], tpl: Template, copies: int, after: list[str], tail: str,
           compress: bool, batch: int = 32) -> None:
    """head, elements before, the copies, elements after, tail; compressed on a second thread (zlib drops the GIL)."""
    q: queue.Queue = queue.Queue(maxsize=4)
    f = gzip.GzipFile(path, "wb", compresslevel=6, mtime=0) if compress else open(path, "wb")  # level 6: as the collector writes

    def writer():
        while (chunk := q.get()) is not None:
            f.write(chunk)

    t = threading.Thread(target=writer)
    t.start()
    try:
        q.put((head + "".join(e + ",\n" for e in before)).encode())
        for k0 in range(0, copies, batch):
            ks = range(k0, min(k0 + batch, copies))
            q.put(",\n".join(tpl.render(k) for k in ks).encode() + (b",\n" if ks[-1] < copies - 1 or after else b""))
        q.put(",\n".join(after).encode() + tail.encode())
    finally:
        q.put(None)
        t.join()
        f.close()


def copies_for(kernels: int, source: Path = DEFAULT_SOURCE) -> int:
    """How many copies of the source's iteration hold at least `kernels` kernels."""
    src = source / "trace" if (source / "trace").is_dir() else source
    meta = json.loads((src / "meta.json").read_text())
    events = json.loads(gzip.decompress((src / "kineto.json.gz").read_bytes()))["traceEvents"]
    a, b = meta["steady_state"]["iterations"][0]
    it_idx, _, _, _ = _select_kineto(events, a, b)
    per_copy = sum(1 for i in it_idx if events[i].get("cat") == "kernel")
    if not per_copy:
        raise SystemExit(f"{source} has no kernels in its first steady iteration: use --copies")
    return math.ceil(kernels / per_copy)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--kernels", type=int, help="at least this many kernels in the steady window")
    g.add_argument("--copies", type=int, help="this many copies of the source's iteration")
    ap.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="a trace dir (default: %(default)s)")
    ap.add_argument("--plain", action="store_true", help="write .json instead of .json.gz")
    a = ap.parse_args(argv)
    copies = a.copies or copies_for(a.kernels, a.source)
    t0 = time.perf_counter()
    d = synthesize(a.out, copies, a.source, not a.plain, log=lambda m: print(m, file=sys.stderr))
    sizes = ", ".join(f"{p.name} {p.stat().st_size / 1e6:.1f} MB" for p in sorted(d.iterdir()))
    print(f"{d}: {copies} copies in {time.perf_counter() - t0:.1f} s ({sizes})")


if __name__ == "__main__":
    main()
