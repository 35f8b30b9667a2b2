#!/usr/bin/env python
"""Where `advisor.optimize`'s cold start goes, per workload: empty caches, then warm caches in a new process.

    python bench/cold_start.py --workloads seed,hf_llama --out /tmp/cold      # full shapes (GPU)
    python bench/cold_start.py --quick --device cpu --workloads hf_llama      # tiny shapes

Each run is a child process (as a user's second run would be): build the workload (bench/workloads.py),
one eager call, then `advisor.optimize(model, inputs, top=N)` and the first optimised call, under
cProfile. Prints and writes OUT/cold_start.jsonl (one line per run: wall seconds, `phases_s`, what
was patched), OUT/<workload>-<empty|warm>.txt (the costliest functions by cumulative and own time) and
.err (the child's output; the stacks of all threads if it overruns). As in bench/suite.py the process's
one-time costs (imports, CUDA and dynamo first use) are paid before the clock starts.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="seed,hf_llama")
    p.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="cold-start-")))
    p.add_argument("--device", default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--timeout", type=float, default=240.0, help="per child process, seconds")
    p.add_argument("--child", nargs=2, metavar=("WORKLOAD", "LABEL"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a, *a.child)
    a.out.mkdir(parents=True, exist_ok=True)
    for name in a.workloads.split(","):
        env = {**os.environ, "FUSION_ADVISOR_CACHE": str(a.out / f"cache-{name}"),
               "TRITON_CACHE_DIR": str(a.out / f"triton-{name}")}
        for label in ("empty", "warm"):
            cmd = [sys.executable, __file__, "--child", name, label, "--out", str(a.out), "--top", str(a.top),
                   *(["--quick"] if a.quick else []), *(["--device", a.device] if a.device else [])]
            t0 = time.time()
            err = a.out / f"{name}-{label}.err"
            try:
                with open(err, "w") as f:
                    r = subprocess.run(cmd, env=env, timeout=a.timeout, stdout=f, stderr=subprocess.STDOUT, text=True)
                last = err.read_text().strip().splitlines()[-1:]
                status = "ok" if r.returncode == 0 else f"exit {r.returncode}: {last}"
            except subprocess.TimeoutExpired:
                status = f"timeout after {a.timeout:.0f} s"
            if status != "ok":
                with open(a.out / "cold_start.jsonl", "a") as f:
                    f.write(json.dumps({"workload": name, "cache": label, "status": status,
                                        "wall_s": round(time.time() - t0, 1)}) + "\n")
            print(f"{name} {label}: {status} ({time.time() - t0:.1f} s with start-up)", flush=True)
    for line in (a.out / "cold_start.jsonl").read_text().splitlines():
        print(line)
    return 0


def child(a, name: str, label: str) -> int:
    import faulthandler

    faulthandler.dump_traceback_later(max(5.0, a.timeout - 10), exit=False)  # where a run that overruns is
    sys.path.insert(0, str(ROOT))
    import torch

    import advisor  # noqa: F401  (before triton: the interpreter on a machine without a GPU)
    from bench import workloads
    from bench.suite import process_warmup

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    process_warmup(device)  # imports and first-use costs of the process, paid before timing as in the suite
    w = workloads.build(name, device, a.quick)
    args, kwargs = w.args_kwargs()
    with torch.inference_mode():
        w.model(*args, **kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
    from advisor.workflows.live_model import optimize

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    report = optimize(w.model, w.inputs, top=a.top, out=a.out / f"{name}-{label}")
    with torch.inference_mode():
        w.model(*args, **kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
    prof.disable()
    wall = time.perf_counter() - t0
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
    try:  # what dynamo did: cProfile does not see inside its frame evaluation
        from torch._dynamo.utils import compile_times, counters

        text.write("\n" + compile_times(repr="str") + "\n")
        text.write(json.dumps({k: dict(v) for k, v in counters.items() if v}, default=str)[:4000] + "\n")
    except Exception as e:  # pragma: no cover - a torch without these helpers
        text.write(f"dynamo stats unavailable: {e}\n")
    (a.out / f"{name}-{label}.txt").write_text(text.getvalue())
    rec = {"workload": name, "cache": label, "status": "ok", "device": device, "wall_s": round(wall, 2),
           "phases_s": report.phases_s, "check_s": report.check.get("seconds"), "patched": [p["title"] for p in report.applied],
           "not_patched": {p["title"]: p.get("status") for p in report.patterns if not p.get("patched")}}
    with open(a.out / "cold_start.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
