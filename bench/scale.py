"""Analyzer scale benchmark: wall time and peak memory at 100k, 300k and 1M kernels, against json.load.

    python -m bench.scale                       # sizes 100000 300000 1000000, report to reports/scale/README.md
    python -m bench.scale --sizes 100000 --dir /tmp/fa_scale --no-report

Each size is a synthetic trace (bench/synth_trace.py, cached in --dir) analysed by `advisor.analyze` in
a child process of its own, so each measurement starts cold. Peak memory is reported two ways: the
largest process (resource usage of the child, which folds in its own children as a maximum) and the sum
over the child's process tree, sampled every 20 ms (the analyzer parses a big ET in a second process).
`json.load` of the same two files runs in its own child too, under a memory cap: where it cannot fit,
the table says so instead of crashing the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench import synth_trace

ROOT = Path(__file__).resolve().parents[1]

TARGET_S, TARGET_GB, TARGET_LINEAR = 60.0, 4.0, 1.5

ANALYZE = r"""
import json, sys, time, resource
sys.path.insert(0, sys.argv[2])
from advisor.analysis import api
phases = {}
def timed(name, f):
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); phases[name] = time.perf_counter() - t; return r
    return g
api.load_trace = timed("load", api.load_trace)
api.build_graph = timed("graph", api.build_graph)
t = time.perf_counter()
a = api.analyze(sys.argv[1])
wall = time.perf_counter() - t
phases["rest"] = wall - phases["load"] - phases["graph"]
print(json.dumps({"wall_s": wall, "phases": phases, "candidates": len(a.doc["candidates"]),
                  "nodes": len(a.graph.nodes), "kernels_per_iter": a.doc["totals"]["kernels"]}))
"""

JSON_LOAD = r"""
import gzip, json, sys, time
t = time.perf_counter()
for p in sys.argv[1:]:
    with gzip.open(p, "rt") if p.endswith(".gz") else open(p) as f:
        doc = json.load(f)
    del doc
print(json.dumps({"wall_s": time.perf_counter() - t}))
"""


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (0 once gone)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return total


def run_child(args: list[str], mem_cap: int | None = None, timeout: float = 1800) -> dict:
    """Run a Python child; wall time, its own peak RSS (wait4) and the sampled peak of its process tree."""
    def cap():
        if mem_cap:
            resource.setrlimit(resource.RLIMIT_AS, (mem_cap, mem_cap))

    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=cap)
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss(p.pid))
            done.wait(0.02)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    wall = time.perf_counter() - t0
    done.set()
    th.join()
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)  # cumulative; the per-child figure comes from wait4 below
    res = {"rc": p.returncode, "wall_outer_s": wall, "tree_peak_gb": peak[0] / 1e9, "stderr": err.decode()[-2000:]}
    try:
        res.update(json.loads(out.decode().strip().splitlines()[-1]))
    except (ValueError, IndexError):
        pass
    res["cpu_children_total_s"] = ru.ru_utime + ru.ru_stime
    return res


def run_with_rusage(args: list[str], **kw) -> dict:
    """run_child, plus the child's own ru_maxrss (Linux: KiB), read with wait4 on a fresh fork."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a middle process whose only child is the measured one: its RUSAGE_CHILDREN is that child's
        os.close(r)
        res = run_child(args, **kw)
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        res["maxrss_gb"] = ru.ru_maxrss * 1024 / 1e9
        res["cpu_s"] = ru.ru_utime + ru.ru_stime
        os.write(w, json.dumps(res).encode())
        os._exit(0)
    os.close(w)
    chunks = []
    while b := os.read(r, 1 << 16):
        chunks.append(b)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks))


def ensure_trace(base: Path, kernels: int) -> Path:
    d = base / f"k{kernels}"
    copies = synth_trace.copies_for(kernels)
    meta = d / "trace" / "meta.json"
    if not meta.exists() or json.loads(meta.read_text()).get("synthetic", {}).get("copies") != copies:
        print(f"generating {kernels} kernels ({copies} copies) in {d} ...", flush=True)
        synth_trace.synthesize(d, copies)
    return d


def raw_size(path: Path) -> int:
    """Uncompressed bytes (gzip stores the size mod 2^32 in its trailer: read it through instead)."""
    import zlib

    d, n = zlib.decompressobj(31), 0
    with open(path, "rb") as f:
        while b := f.read(1 << 22):
            n += len(d.decompress(b))
    return n


def measure(base: Path, sizes: list[int], json_load: bool, reuse: bool = False) -> list[dict]:
    rows = []
    old = {r["kernels"]: r for r in json.loads((base / "scale.json").read_text())} \
        if reuse and (base / "scale.json").exists() else {}
    mem_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    json_per_byte = None  # json.load peak bytes per JSON byte, from the sizes that fit
    for n in sizes:
        d = ensure_trace(base, n)
        files = [d / "trace" / "kineto.json.gz", d / "trace" / "et.json.gz"]
        gz = sum(f.stat().st_size for f in files)
        sizes = d / "sizes.json"
        if not sizes.exists() or json.loads(sizes.read_text())["gz"] != gz:
            sizes.write_text(json.dumps({"gz": gz, "raw": sum(raw_size(f) for f in files)}))
        raw = json.loads(sizes.read_text())["raw"]
        print(f"{n} kernels: {raw / 1e9:.2f} GB of JSON ({gz / 1e9:.2f} GB gzipped); analysing ...", flush=True)
        load_before = os.getloadavg()[0]
        a = run_with_rusage(["-c", ANALYZE, str(d), str(ROOT)])
        if a.get("rc") != 0:
            raise SystemExit(f"analysis failed at {n}:\n{a.get('stderr')}")
        row = {"kernels": n, "json_gb": raw / 1e9, "gz_gb": gz / 1e9, "analyze": a,
               "loadavg": [load_before, os.getloadavg()[0]]}
        print(f"  analysed in {a['wall_s']:.1f} s (cpu {a['cpu_s']:.1f} s), peak {a['maxrss_gb']:.2f} GB "
              f"(process tree {a['tree_peak_gb']:.2f} GB); phases {json.dumps({k: round(v, 1) for k, v in a['phases'].items()})}",
              flush=True)
        if reuse and "json_load" in old.get(n, {}) and abs(old[n]["json_gb"] - raw / 1e9) < 1e-6:
            row["json_load"] = old[n]["json_load"]  # same files: json.load's figures do not depend on our code
            if "maxrss_gb" in row["json_load"]:
                json_per_byte = row["json_load"]["maxrss_gb"] * 1e9 / raw
        elif json_load:
            predicted = json_per_byte * raw if json_per_byte else None
            if predicted and predicted > 0.8 * mem_total:
                row["json_load"] = {"skipped": f"would need about {predicted / 1e9:.0f} GB "
                                               f"({json_per_byte:.1f} bytes per JSON byte at smaller sizes); "
                                               f"the machine has {mem_total / 1e9:.0f} GB"}
            else:
                j = run_with_rusage(["-c", JSON_LOAD, *map(str, files)], mem_cap=int(0.8 * mem_total))
                if j.get("rc") != 0:
                    row["json_load"] = {"skipped": f"failed under a {0.8 * mem_total / 1e9:.0f} GB cap: "
                                                   f"{(j.get('stderr') or '').strip().splitlines()[-1:]}"}
                else:
                    row["json_load"] = j
                    json_per_byte = j["maxrss_gb"] * 1e9 / raw
                    print(f"  json.load: {j['wall_s']:.1f} s, peak {j['maxrss_gb']:.2f} GB", flush=True)
            if "skipped" in row["json_load"]:
                print(f"  json.load: {row['json_load']['skipped']}", flush=True)
        rows.append(row)
    return rows


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import numpy
    import pandas

    try:
        import orjson

        oj = orjson.__version__
    except ImportError:
        oj = "not installed"
    return (f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, Linux {platform.release()}; Python "
            f"{platform.python_version()}, numpy {numpy.__version__}, pandas {pandas.__version__}, orjson {oj}")


def report(rows: list[dict], path: Path) -> str:
    lines = ["| kernels | JSON (gzipped) | analysis wall | CPU (all processes) | peak RSS: largest process / process tree | "
             "µs per kernel: wall / CPU | json.load | analysis / json.load | load avg before–after |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a, j = r["analyze"], r.get("json_load") or {}
        jl = f"{j['wall_s']:.1f} s, {j['maxrss_gb']:.1f} GB" if "wall_s" in j else ("not run: " + j["skipped"] if j else "-")
        ratio = f"{a['wall_s'] / j['wall_s']:.2f}" if "wall_s" in j else "-"
        lines.append(f"| {r['kernels']:,} | {r['json_gb']:.2f} GB ({r['gz_gb']:.2f} GB) | {a['wall_s']:.1f} s | "
                     f"{a['cpu_s']:.1f} s | {a['maxrss_gb']:.2f} / {a['tree_peak_gb']:.2f} GB | "
                     f"{a['wall_s'] / r['kernels'] * 1e6:.0f} / {a['cpu_s'] / r['kernels'] * 1e6:.0f} | {jl} | {ratio} | "
                     f"{r['loadavg'][0]:.1f}–{r['loadavg'][1]:.1f} |")
    lines += ["", "Phases (wall s): " + "; ".join(
        f"{r['kernels']:,}: " + ", ".join(f"{k} {v:.1f}" for k, v in r["analyze"]["phases"].items()) for r in rows)]
    verdict = []
    big = next((r for r in rows if r["kernels"] >= 1_000_000), None)
    small = next((r for r in rows if r["kernels"] <= 100_000), None)
    if big:
        a = big["analyze"]
        verdict.append(f"- 1M kernels in ≤ {TARGET_S:.0f} s: **{'met' if a['wall_s'] <= TARGET_S else 'missed'}** "
                       f"({a['wall_s']:.1f} s)")
        verdict.append(f"- ≤ {TARGET_GB:.0f} GB peak RSS at 1M: **{'met' if a['tree_peak_gb'] <= TARGET_GB else 'missed'}** "
                       f"({a['tree_peak_gb']:.2f} GB, whole process tree)")
    if big and small:
        per = {k: (big["analyze"][k] / big["kernels"]) / (small["analyze"][k] / small["kernels"])
               for k in ("wall_s", "cpu_s")}
        verdict.append(f"- linear growth (time per kernel at 1M within {TARGET_LINEAR}× of 100k): "
                       f"**{'met' if per['wall_s'] <= TARGET_LINEAR else 'missed'}** by wall time ({per['wall_s']:.2f}×), "
                       f"{per['cpu_s']:.2f}× by CPU time (which other sessions' load on the machine does not skew)")
    text = "\n".join(lines + [""] + verdict)
    return text


def write_section(path: Path, name: str, body: str) -> None:
    """Replace the `name` section of the report (between its markers), keeping the rest."""
    start, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    old = path.read_text() if path.exists() else "# Scale\n\n"
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in old and end in old:
        new = old[:old.index(start)] + block + old[old.index(end) + len(end):]
    else:
        new = old.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 300_000, 1_000_000])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/fa_scale"), help="where synthetic traces are cached")
    ap.add_argument("--no-json-load", action="store_true")
    ap.add_argument("--reuse-json-load", action="store_true",
                    help="take json.load's figures from the last run's scale.json where the files are the same")
    ap.add_argument("--report", type=Path, default=ROOT / "reports" / "scale" / "README.md")
    ap.add_argument("--no-report", action="store_true")
    ap.add_argument("--render", action="store_true", help="only re-render the report from the last scale.json")
    a = ap.parse_args(argv)
    if a.render:
        rows = json.loads((a.dir / "scale.json").read_text())
    else:
        rows = measure(a.dir, sorted(a.sizes), not a.no_json_load, a.reuse_json_load)
        for r in rows:
            r["measured"] = time.strftime("%Y-%m-%d %H:%M")
    when = rows[-1].get("measured", "?") if rows else "?"
    body = (f"Measured {when} by `python -m bench.scale` on {machine()}.\n"
            f"Synthetic traces: the H100 hf_llama sample's steady iteration repeated (bench/synth_trace.py), "
            f"gzipped at level 6 like the collector writes them.\n\n{report(rows, a.report)}\n")
    print(body)
    if not a.render:
        (a.dir / "scale.json").write_text(json.dumps(rows, indent=1))
    if not a.no_report:
        write_section(a.report, "analyzer", body)


if __name__ == "__main__":
    main()
