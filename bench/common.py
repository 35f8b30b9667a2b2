"""What the maintained benchmarks share: the timing protocol, the child processes, and the report files.

- The timing protocol: `process_warmup` (the process's one-time costs, paid before anything is timed) and
  `interleaved` (every configuration warmed up, then timed in interleaved rounds, reversed every other round:
  `advisor.measure.timing.time_call`, CUDA events on a GPU); `kernel_count` (kernels one call launches) and
  `errors_vs` (an output's error against eager's) beside them.
- Child processes: each benchmark measures one model per process (a crash or an OOM loses one model, not the
  run); `child_command` starts `python -m bench.NAME ...` with this checkout first on PYTHONPATH.
- Reports: OUT.json holds `{"results": {model: ...}}`, merged model by model (`load_results`), and is
  rewritten, with OUT.md rendered from it, after every model (`write_report`), so a run stopped part-way
  leaves a report.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------ child processes
def child_env(env: dict | None = None) -> dict:
    """The environment for a benchmark's child: this checkout first on PYTHONPATH (`bench`, `advisor`)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def child_command(module: str, *args) -> list:
    """`python -m <module> ARGS` (module: `bench.zoo`, ...), run with `child_env()` from any folder."""
    return [sys.executable, "-m", module, *map(str, args)]


def git_rev() -> str:
    """The checkout's short commit ('' outside git)."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


# ------------------------------------------------------------------------------------ reports
def load_results(out: Path) -> dict:
    """OUT.json's document as an earlier run left it (its models are kept unless measured again), or a new one;
    OUT's folder is made."""
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.with_suffix(".json")
    return json.loads(path.read_text()) if path.exists() else {"results": {}}


def write_report(out: Path, doc: dict, markdown: str | None = None) -> None:
    """OUT.json (the whole document) and, given its text, OUT.md."""
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str))
    if markdown is not None:
        out.with_suffix(".md").write_text(markdown)


# ------------------------------------------------------------------------------------ measuring
def process_warmup(device: str) -> None:
    """One-time process costs, paid before anything is timed so neither cold start carries them: the
    advisor's and Inductor's imports, CUDA/cuBLAS, Triton's driver, dynamo + AOTAutograd first use."""
    import torch

    import advisor.analysis.api  # noqa: F401
    import advisor.workflows.live_model  # noqa: F401
    import advisor.patching  # noqa: F401
    import advisor.patching.verify  # noqa: F401
    try:
        import torch._inductor.compile_fx  # noqa: F401  (also in the warm-cache process: same start for both)
    except Exception:
        pass
    if device == "cuda":
        x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
        (x @ x).sum().item()
        try:
            from triton.runtime.driver import driver
            driver.active.get_current_device()
            driver.active.utils  # noqa: B018  (builds/loads Triton's launcher utilities)
        except Exception:
            pass
    f = torch.compile(lambda t: torch.relu(t) + 1, backend="aot_eager")
    f(torch.randn(8, device=device))
    torch._dynamo.reset()


def interleaved(fns: dict, device: str, iters: int, rounds: int, warmup_s: float) -> dict:
    """Each callable warmed up (>= 3 calls and `warmup_s`), then timed in `rounds` interleaved rounds, in
    reversed order every other round (`advisor.measure.timing.time_call`: CUDA events on a GPU): median over
    all samples; spread = max - min of the round medians."""
    import torch

    from advisor.measure.timing import round_order, time_call

    for fn in fns.values():
        t0, n = time.perf_counter(), 0
        while n < (3 if warmup_s else 1) or time.perf_counter() - t0 < warmup_s:
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            n += 1
    rounds = max(1, min(rounds, iters))
    per = math.ceil(iters / rounds)
    samples = {k: [] for k in fns}
    medians = {k: [] for k in fns}
    for r in range(rounds):
        for k in round_order(list(fns), r):
            t = time_call(fns[k], device, warmup=1, iters=per)
            samples[k] += t.samples_ms
            medians[k].append(t.median_ms)
    out = {}
    for k in fns:
        s = sorted(samples[k])
        out[k] = {"median_ms": round(statistics.median(s), 4), "spread_ms": round(max(medians[k]) - min(medians[k]), 4),
                  "min_ms": round(s[0], 4), "max_ms": round(s[-1], 4),
                  "p10_ms": round(s[int(0.1 * (len(s) - 1))], 4), "p90_ms": round(s[int(0.9 * (len(s) - 1))], 4),
                  "round_medians_ms": [round(m, 4) for m in medians[k]], "iters": len(s), "rounds": rounds,
                  "method": "cuda_events" if device == "cuda" else "perf_counter"}
    return out


def kernel_count(fn, device: str, root: Path) -> dict | None:
    """GPU kernels (and memcpy/memset) one call launches: torch.profiler's `kernel` events."""
    if device != "cuda":
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    fd, name = tempfile.mkstemp(dir=root, suffix=".json")
    os.close(fd)
    path = Path(name)
    try:
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    finally:
        path.unlink(missing_ok=True)
    cats = [e.get("cat") for e in events if isinstance(e, dict)]
    return {"kernels": cats.count("kernel"), "memcpy": cats.count("gpu_memcpy"), "memset": cats.count("gpu_memset")}


def errors_vs(ref, out) -> dict:
    """Max error of `out` against the eager output, relative to max |eager| (finite elements), rel_l2,
    and how many elements are non-finite in one but not (identically) the other."""
    import torch

    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        what = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return {"max_rel_err": None, "rel_l2": None, "error_note": f"output {what}, eager {tuple(ref.shape)}"}
    r, o = ref.detach(), out.detach()
    fr, fo = torch.isfinite(r), torch.isfinite(o)
    both = fr & fo
    same_nonfinite = (~fr & ~fo) & ((r == o) | (torch.isnan(r) & torch.isnan(o)))
    mismatch = int((~both & ~same_nonfinite).sum())
    del fr, fo, same_nonfinite
    d = (o.float() - r.float()).masked_fill_(~both, 0).abs_()
    rb = r.float().masked_fill(~both, 0)  # (not in place: .float() of a float32 tensor is that tensor)
    scale = float(rb.abs().max()) if rb.numel() else 0.0
    max_abs = float(d.max()) if d.numel() else 0.0
    nr = float(torch.linalg.vector_norm(rb, dtype=torch.float64)) if rb.numel() else 0.0
    nd = float(torch.linalg.vector_norm(d, dtype=torch.float64)) if d.numel() else 0.0
    rel_l2 = nd / nr if nr else (0.0 if max_abs == 0 else float("inf"))
    return {"max_abs_err": max_abs, "max_rel_err": max_abs / scale if scale else max_abs, "rel_l2": rel_l2,
            "nonfinite_mismatch": mismatch, "bit_identical": bool(torch.equal(ref, out))}


def write_json(path: Path, doc: dict) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(path)
