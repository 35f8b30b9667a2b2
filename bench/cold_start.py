#!/usr/bin/env python
"""Cold start per model and phase: fusion-advisor with empty caches, warm caches and from a bundle,
beside torch.compile's first call with empty and warm caches; Triton compiles counted in each.

    python -m bench.cold_start --out $OUT/cold_start                 # GPU, default models
    python -m bench.cold_start --models hf_llama,deit_small --out /tmp/cs
    python -m bench.cold_start --smoke --out /tmp/cs                 # CPU, a tiny model, seconds

Models: bench/workloads.py names (`hf_llama`, `seed`, ...) or bench/zoo.py's (`deit_small`, `qwen2`, ...).
Every run is its own child process, one after another (as a user's first and second run would be);
each child pays its process costs (imports, CUDA, dynamo's first use: bench.suite.process_warmup)
before its clock starts, then builds the model and calls it once eagerly. Per model:

- `advisor-empty`: fresh FUSION_ADVISOR_CACHE, TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR; `advisor.optimize`
  (its `phases_s`: profile, analyze, generate, patch, check = the first patched call, select), then
  the first call after it; the plan is then bundled (`advisor.save_bundle`).
- `advisor-warm`: the same caches, a new process: `optimize` reuses the stored plan.
- `advisor-empty-serial`: `advisor-empty` with its own fresh caches and the capture after the kernels'
  generation, not overlapped with it (`FUSION_ADVISOR_EARLY_CAPTURE=0`: what `optimize` did before
  `workflows/early_capture.py`), for the comparison in one run. Not in the default runs.
- `advisor-bundle`: fresh caches, a new process: `advisor.patch(model, bundle)` and the first call.
- `compile-empty` / `compile-warm`: `torch.compile(model)`'s first call with fresh, then the same caches.

`capture_phases_s` (advisor runs): `advisor.patching.timing` from the start of `optimize` / `patch` to the
end of the first call: dynamo (its tracing and guards), aot (AOTAutograd), rewrite (our matcher and
substitution; patterns, find, substitute, copy+lint, recompile within it), launchers (kernel modules
imported), record (CUDA-graph recordings), captures (graphs dynamo handed us) and rewrites (graphs
rewritten: shared ones count once). The markdown has the main ones as columns.

`first_inference_call_s`: the first call under `torch.inference_mode` after that first (`no_grad`) call, and
`inference_call_phases_s` its phases (dynamo's guards tell the modes apart: a capture of its own unless the
first call's serves it; torch.compile recompiles).

`triton_compiles`: entries Triton's caches gained during the timed part (a bundle's installed binaries
not counted). Writes OUT/cold_start.json and OUT/cold_start.md; OUT/<model>-<run>.log is each child's
output. Runs past `--budget` seconds are skipped and said so; a child past `--timeout` is killed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import child_command, child_env

RUNS = ("advisor-empty", "advisor-warm", "advisor-bundle", "advisor-empty-serial", "compile-empty", "compile-warm")
CACHES = ("FUSION_ADVISOR_CACHE", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
SMOKE_MODEL = "seed"  # bench/workloads.py's log(relu(x + b)), at its quick size: one kernel


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="hf_llama,deit_small", help="comma-separated workload or zoo names")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--top", type=int, default=5, help="optimize's top (its default)")
    p.add_argument("--budget", type=float, default=440.0, help="seconds for all runs: a child is killed at the end "
                   "of it, later runs are skipped")
    p.add_argument("--timeout", type=float, default=200.0, help="seconds per child process at most")
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny model, interpret=True, no torch.compile runs")
    p.add_argument("--runs", default=",".join(r for r in RUNS if r != "advisor-empty-serial"),
                   help=f"comma-separated, of {', '.join(RUNS)}")
    p.add_argument("--profile", action="store_true", help="advisor runs under cProfile: OUT/MODEL-RUN.prof.txt "
                   "(and .prof.pstats), the host's time by function (cumulative and own), to see where a cold start goes")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "RUN"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.out = a.out or Path(tempfile.mkdtemp(prefix="cold-start-"))
    if a.child:
        return child(a, *a.child)
    a.out.mkdir(parents=True, exist_ok=True)
    models = [SMOKE_MODEL] if a.smoke else [m for m in a.models.split(",") if m]
    runs = [r for r in RUNS if r in a.runs.split(",") and not (a.smoke and r.startswith("compile"))]
    if not runs:
        print(f"cold_start: no run named in --runs {a.runs!r} (runs: {', '.join(RUNS)})", file=sys.stderr)
        return 2
    t_start, records = time.time(), []
    for model in models:
        for run in runs:
            rec = {"model": model, "run": run}
            left = a.budget - (time.time() - t_start)
            if left < 20:
                rec["status"] = f"skipped: the {a.budget:.0f} s budget was spent"
            else:
                rec.update(spawn(a, model, run, min(a.timeout, left)))
            records.append(rec)
            print(json.dumps(rec), flush=True)
    doc = {"smoke": a.smoke, "models": models, "records": records, "wall_s": round(time.time() - t_start, 1)}
    (a.out / "cold_start.json").write_text(json.dumps(doc, indent=1))
    (a.out / "cold_start.md").write_text(markdown(doc))
    print(markdown(doc))
    print(f"written: {a.out / 'cold_start.json'}, {a.out / 'cold_start.md'}")
    return 0


def caches(out: Path, model: str, run: str) -> dict:
    """The cache folders of a run: warm runs share their empty run's, a bundle starts from nothing."""
    group = {"advisor-warm": "advisor-empty", "compile-warm": "compile-empty"}.get(run, run)
    return {k: str(out / "caches" / f"{model}-{group}" / k.lower()) for k in CACHES}


def spawn(a, model: str, run: str, timeout: float) -> dict:
    env = {**child_env(), **caches(a.out, model, run)}
    if run == "advisor-empty-serial":
        env["FUSION_ADVISOR_EARLY_CAPTURE"] = "0"
    cmd = child_command("bench.cold_start", "--child", model, run, "--out", a.out, "--top", a.top,
                        *(["--smoke"] if a.smoke else []), *(["--profile"] if a.profile else []))
    log, result = a.out / f"{model}-{run}.log", a.out / f"{model}-{run}.json"
    result.unlink(missing_ok=True)
    t0 = time.time()
    try:
        with open(log, "w") as f:
            r = subprocess.run(cmd, env=env, timeout=timeout, stdout=f, stderr=subprocess.STDOUT)
        status = "ok" if r.returncode == 0 and result.is_file() else \
            f"exit {r.returncode}: {(log.read_text().strip().splitlines() or [''])[-1][:300]}"
    except subprocess.TimeoutExpired:
        status = f"timeout after {timeout:.0f} s"
    rec = json.loads(result.read_text()) if status == "ok" else {}
    return {"status": status, "process_s": round(time.time() - t0, 1), **rec}


# ----------------------------------------------------------------------------------------- child
@contextlib.contextmanager
def profiled(path: Path | None):
    """cProfile around the block, its top functions by cumulative and by own time written to `path`."""
    if path is None:
        yield
        return
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        prof.dump_stats(str(path.with_suffix(".pstats")))  # all of it, for pstats later (the text has the top)
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("cumulative").print_stats(70)
        stats.sort_stats("tottime").print_stats(40)
        path.write_text(text.getvalue())


def child(a, model: str, run: str) -> int:
    import torch

    import advisor  # noqa: F401  (before triton: the interpreter where there is no GPU)
    from bench.common import process_warmup

    device = "cpu" if a.smoke else ("cuda" if torch.cuda.is_available() else "cpu")
    process_warmup(device)
    m, inputs = build(model, device, a.smoke)
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), dict(inputs))

    def call(target=m, mode=torch.no_grad):
        with mode():
            target(*args, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()

    call()  # the eager call a user's script makes anyway
    bundle = a.out / f"{model}.fab"
    before, hosts_before = triton_entries(), host_module_dirs()
    from advisor.patching import timing

    phases_before = timing.snapshot()
    rec: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    t0 = time.perf_counter()
    target = m
    if run.startswith("compile"):
        target = torch.compile(m)
        call(target)
        rec["first_call_s"] = round(time.perf_counter() - t0, 3)
    elif run == "advisor-bundle":
        handle = advisor.patch(m, bundle)
        rec["patch_s"] = round(time.perf_counter() - t0, 3)
        t1 = time.perf_counter()
        call()
        rec["first_call_s"] = round(time.perf_counter() - t1, 3)
        rec["patched_modules"] = len(handle.manifest())
    else:
        with profiled(a.out / f"{model}-{run}.prof.txt" if a.profile else None):
            report = advisor.optimize(m, inputs, top=a.top, out=a.out / f"{model}-{run}", interpret=a.smoke)
        rec["optimize_s"] = round(time.perf_counter() - t0, 3)
        t1 = time.perf_counter()
        call()
        rec["first_call_s"] = round(time.perf_counter() - t1, 3)
        rec.update(phases_s=report.phases_s, patched=[p["title"] for p in report.applied])
        # each candidate's job in the compile workers: generate, load, validate and its steps (`validate_steps`)
        rec["jobs_s"] = {r.candidate: r.seconds for r in report.results if r.seconds}
    rec["to_first_call_s"] = round(time.perf_counter() - t0, 3)
    # where the captures' time went, up to the end of the first call (optimize's own calls included)
    rec["capture_phases_s"] = timing.since(phases_before)
    installed = set()
    if run == "advisor-bundle":  # the bundle's binaries, copied into Triton's cache by `patch`: not compiles
        import zipfile

        with zipfile.ZipFile(bundle) as z:
            header = json.loads(z.read("header.json"))
        installed = set(header.get("binaries") or [])
        rec["binaries_installed"] = len(installed)
        rec["host_modules_installed"] = len(header.get("host_modules") or [])
        installed |= set(header.get("host_modules") or [])
    rec["triton_compiles"] = len({e for e in triton_entries() - before if Path(e).name not in installed})
    # Triton's launchers (one per argument signature) and CUDA utilities, built by gcc on first use
    rec["host_modules_built"] = len({e for e in host_module_dirs() - hosts_before
                                     if Path(e).name not in installed})
    # The other way users call a model: a capture of its own, unless the first call's serves it too
    phases_before, t3 = timing.snapshot(), time.perf_counter()
    call(target, torch.inference_mode)
    rec["first_inference_call_s"] = round(time.perf_counter() - t3, 3)
    rec["inference_call_phases_s"] = timing.since(phases_before)
    if run == "advisor-empty":
        t2 = time.perf_counter()
        advisor.save_bundle(report, bundle)
        rec.update(bundle_s=round(time.perf_counter() - t2, 3), bundle_bytes=bundle.stat().st_size)
    (a.out / f"{model}-{run}.json").write_text(json.dumps(rec))
    return 0


def build(name: str, device: str, quick: bool):
    """(model, inputs) of a bench/workloads.py or bench/zoo.py model."""
    import torch

    from bench import workloads

    if name in workloads.NAMES:
        w = workloads.build(name, device, quick)
        return w.model, w.inputs
    from bench import zoo

    if name not in zoo.MODELS:
        raise SystemExit(f"unknown model {name!r}: one of {', '.join(workloads.NAMES + list(zoo.MODELS))}")
    model, inputs, _ = zoo.MODELS[name](device, torch.bfloat16 if device == "cuda" else torch.float32)
    return model, inputs


def host_module_dirs() -> set:
    """Every entry of this process's Triton cache holding a shared object (host modules gcc built, not kernels;
    `bundle.host_module_entries` is those a bundle carries)."""
    from advisor.workflows.bundle import triton_cache_root

    root = triton_cache_root()
    return {str(f.parent) for f in root.glob("*/*.so")} if root.is_dir() else set()


def triton_entries() -> set:
    """Compiled-kernel entries in this process's Triton and Inductor caches (each holds a `__grp__` file)."""
    out = set()
    for key in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        root = os.environ.get(key)
        if root and Path(root).is_dir():
            out.update(str(g.parent) for g in Path(root).rglob("__grp__*.json"))
    return out


# ------------------------------------------------------------------------------------------ report
INNER = ("workers start", "jobs", "alternatives", "outer check", "timed runs")


def markdown(doc: dict) -> str:
    cols = ["model", "run", "status", "to first call s", "profile", "analyze", "capture", "generate", "patch", "check",
            "select", "first call s", "dynamo", "aot", "rewrite", "record", "captures", "Triton compiles",
            "host modules built", "first inference-mode call s", "its dynamo", "process s"]
    lines = ["# Cold start" + (" (smoke: CPU, interpreter)" if doc.get("smoke") else ""), "",
             "Seconds. `to first call`: from `optimize` / `patch` / `torch.compile` to the end of the first "
             "call after it; phases are `optimize`'s (`capture`: the model captured while the kernels compile, "
             "`generate` then the wait for them; `check` = its first patched call); `process` "
             "includes the child's start-up; dynamo / aot / rewrite / record: `capture_phases_s`, seconds spent "
             "in dynamo's tracing, AOTAutograd, our rewrite and CUDA-graph recording up to the end of the first "
             "call (every capture `optimize` makes included), captures: graphs dynamo handed us; first "
             "inference-mode call: the first call under `torch.inference_mode` after that, and dynamo's "
             "seconds in it; host modules built: Triton's kernel launchers and CUDA utilities gcc built in the "
             "timed part.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in doc["records"]:
        ph = r.get("phases_s") or {}
        if r.get("run") == "advisor-bundle":
            ph = {"patch": r.get("patch_s")}
        cells = [r["model"], r["run"], r.get("status", ""), _f(r.get("to_first_call_s")),
                 *(_f(ph.get(k)) for k in ("profile", "analyze", "capture", "generate", "patch", "check", "select")),
                 _f(r.get("first_call_s")),
                 *(_f((r.get("capture_phases_s") or {}).get(k)) for k in ("dynamo", "aot", "rewrite", "record")),
                 str(int((r.get("capture_phases_s") or {}).get("captures", 0))),
                 str(r.get("triton_compiles", "")), str(r.get("host_modules_built", "")),
                 _f(r.get("first_inference_call_s")),
                 _f((r.get("inference_call_phases_s") or {}).get("dynamo")), _f(r.get("process_s"))]
        lines.append("| " + " | ".join(cells) + " |")
    inner = [(r["model"], r["run"], {k: v for k, v in (r.get("capture_phases_s") or {}).items() if k in INNER})
             for r in doc["records"]]
    if any(ph for _, _, ph in inner):
        lines += ["", "Inside `generate` and `select` (s): waiting for the compile workers to start, the workers' jobs, "
                      "timing validated alternatives; the whole stack's capture and check, the interleaved timed runs:", ""]
        lines += [f"- {m} {run}: " + ", ".join(f"{k} {ph[k]:.2f}" for k in INNER if k in ph) for m, run, ph in inner if ph]
    jobs = [(r["model"], c, sec) for r in doc["records"] for c, sec in (r.get("jobs_s") or {}).items()]
    if jobs:
        lines += ["", "Each candidate's job in the compile workers (s; `validate` broken down into its steps, "
                      "summed over the shape cases; `kernel <case>`: that case's launch, its Triton compile included):", ""]
        for model, c, sec in jobs:
            steps = sec.get("validate_steps") or {}
            top = ", ".join(f"{k} {v:.2f}" for k, v in sec.items() if isinstance(v, (int, float)))
            lines.append(f"- {model} {c}: {top}" + (f" ({', '.join(f'{k} {v:.2f}' for k, v in steps.items())})"
                                                    if steps else ""))
    return "\n".join(lines) + "\n"


def _f(x) -> str:
    return "" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    sys.exit(main())
