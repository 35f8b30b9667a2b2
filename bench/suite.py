#!/usr/bin/env python
"""GPU benchmark suite (issue 7): fusion-advisor against eager PyTorch and torch.compile, in one run.

    python -m bench.suite                                  # all seven, within --budget (540 s) on an H100
    python -m bench.suite --workloads hf_llama,hf_gpt2     # a subset
    python -m bench.suite --quick --device cpu             # tiny shapes on the CPU (what the tests run)

For each workload (bf16 inference, random weights, nothing downloaded; shapes in bench/workloads.py)
one child process (a crash or OOM loses one workload, not the run) measures, in one process:
- eager: steady-state median and spread (CUDA events), kernels launched per call, the reference output;
- torch.compile (default mode): the first call (cold: empty Inductor and Triton caches), steady state,
  kernels per call, max error vs eager;
- fusion-advisor: `advisor.optimize` with an empty kernel cache (fresh FUSION_ADVISOR_CACHE and Triton
  cache) up to the first optimised call; then each patched pattern timed alone (`time_patterns`) and
  only the patterns that are faster alone are kept, and only if the kept set is faster than eager end
  to end (otherwise the model is unpatched and the report says so); steady state, kernels, max error;
- all three timed again in interleaved rounds (the numbers reported: drift hits all alike).
Order in the child: eager, the advisor (cold), selection, torch.compile, final timing, kernel counts.
A second child process re-runs `advisor.optimize` on a fresh copy of the model with the kernel cache
(and Triton's cache) the first one filled: the cold start with a warm cache, paid in a new process as
a real second run would (in-process, dynamo's capture cache would make it look cheaper).

Writes OUT/bench-<gpu>.jsonl (one line per finished workload, as it goes), OUT/bench-<gpu>.json and
OUT/bench-<gpu>.md (rewritten after every workload, so a partial run leaves a report); prints a short
table at the end. On the CPU generated kernels run in Triton's interpreter: every time is reported as
not meaningful and no speedup is claimed.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench.common import (  # noqa: F401  (the timing protocol: suite.interleaved etc. stay importable)
    ROOT, child_command, errors_vs, interleaved, kernel_count, process_warmup, write_json)
from bench.suite_report import (  # the report: the summary against the targets, OUT.md, the printed lines
    NOT_MEANINGFUL, _time, _workloads, count_files, markdown, one_line, summarise, tail_table, within_quarter)

SCHEMA_VERSION = 1
DEFAULT_BUDGET_S = 540.0  # all workloads; leaves room inside a 10-minute command limit (start-up, overruns)


# ===================================================================================== parent
def main(argv=None) -> int:
    a = parse_args(argv)
    if a.child:
        return child_main(a)
    return parent_main(a)


def parse_args(argv=None):
    NAMES = _workloads().NAMES

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="all", help=f"comma-separated subset of: {', '.join(NAMES)} (default all: "
                    "issue 7's seven; `anchored` is issue 10's three)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (the CPU test run); reports get a -quick suffix")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--out", default=str(ROOT / "reports"), help="directory for bench-<gpu>.{md,json,jsonl}")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for all selected workloads (default {DEFAULT_BUDGET_S:.0f}, "
                         "shared by weight; time a workload leaves over goes to the next)")
    ap.add_argument("--top", type=int, default=8, help="advisor candidates to generate (default 8)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per configuration (default 30; quick 3)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the workloads of an earlier bench-<gpu>.json that this run does not measure "
                         "(finish a suite in two commands); each row says which run it is from")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (debugging)")
    ap.add_argument("--logs", default=None, help="keep each child's log here (default: a temporary directory)")
    # internal: one workload in this process
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.workloads in ("all", ""):
        a.names = list(_workloads().SUITE)
    elif a.workloads == "anchored":
        a.names = list(_workloads().ANCHORED)
    else:
        a.names = [w.strip() for w in a.workloads.split(",") if w.strip()]
        bad = [w for w in a.names if w not in NAMES]
        if bad:
            ap.error(f"unknown workload(s) {', '.join(bad)} (known: {', '.join(NAMES)})")
    if a.iters is None:
        a.iters = 3 if a.quick else 30
    if a.iters < 1:
        ap.error("--iters must be >= 1")
    return a


def host_info(device: str) -> dict:
    import platform
    from importlib import metadata

    import torch

    def ver(pkg):
        try:
            return metadata.version(pkg)
        except Exception:
            return None

    info = {"python": platform.python_version(), "torch": torch.__version__, "triton": ver("triton"),
            "transformers": ver("transformers"), "timm": ver("timm"), "torchvision": ver("torchvision"),
            "cpu_count": os.cpu_count(), "device": device, "device_name": None, "cuda": torch.version.cuda}
    if device == "cuda":
        info["device_name"] = torch.cuda.get_device_name(0)
    else:
        info["device_name"] = platform.processor() or platform.machine() or "cpu"
    try:
        from advisor import __version__
        info["fusion_advisor"] = __version__
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        info["git"] = rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
        if os.environ.get("FUSION_ADVISOR_REV"):  # a copy of the tree without its .git (the GPU machine's snapshot)
            info["git"] = os.environ["FUSION_ADVISOR_REV"]
    except Exception:
        pass
    return info


def gpu_slug(device: str, name: str | None) -> str:
    """`NVIDIA H100 80GB HBM3` -> `h100`; the CPU -> `cpu`."""
    if device != "cuda" or not name:
        return "cpu"
    words = re.sub(r"[^a-z0-9 ]", " ", name.lower()).split()
    words = [w for w in words if w not in ("nvidia", "geforce", "tesla", "amd", "radeon", "instinct")]
    for w in words:
        if re.fullmatch(r"[a-z]{1,3}\d{2,4}[a-z]?", w):
            return w
    for w in words:
        if re.search(r"\d", w) and not re.fullmatch(r"\d+(gb|g)", w):
            return w
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def parent_main(a) -> int:
    import torch

    WEIGHTS = _workloads().WEIGHTS

    t_run = time.time()
    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("suite: --device cuda but no GPU is visible", file=sys.stderr)
        return 2
    host = host_info(device)
    slug = gpu_slug(device, host["device_name"]) + ("-quick" if a.quick else "")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {k: out / f"bench-{slug}.{k}" for k in ("md", "json", "jsonl")}
    earlier = []
    if a.merge and paths["json"].exists():
        try:
            earlier = [r for r in json.loads(paths["json"].read_text()).get("workloads", [])
                       if r.get("workload") not in a.names]
        except Exception as e:
            print(f"suite: --merge: cannot read {paths['json']} ({e}); starting afresh", file=sys.stderr)
    if not a.merge or not paths["jsonl"].exists():
        paths["jsonl"].write_text("")
    logs = Path(a.logs) if a.logs else Path(tempfile.mkdtemp(prefix="fa-suite-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    budget = a.budget if a.budget is not None else DEFAULT_BUDGET_S
    meaningful = device == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
    doc = {"schema_version": SCHEMA_VERSION, "generated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": " ".join([Path(sys.executable).name, "-m", "bench.suite", *sys.argv[1:]]), "host": host, "device": device,
           "quick": a.quick, "timing_meaningful": meaningful, "budget_s": budget, "top": a.top, "iters": a.iters,
           "workloads": [], "summary": {}}
    print(f"suite: {len(a.names)} workload(s) on {host['device_name']} ({device}{', quick shapes' if a.quick else ''}), "
          f"budget {budget:.0f} s; child logs in {logs}", flush=True)
    deadline = t_run + budget
    NAMES = _workloads().NAMES

    def merged(done):
        rows = earlier + done
        return sorted(rows, key=lambda r: NAMES.index(r["workload"]) if r.get("workload") in NAMES else 99)

    done = []
    for i, name in enumerate(a.names):
        left = deadline - time.time()
        rest = sum(WEIGHTS[n] for n in a.names[i:])
        share = max(0.0, left * WEIGHTS[name] / rest)
        if share < 15:
            res = {"workload": name, "status": "skipped", "reason": f"time budget used up ({left:.0f} s left)"}
        else:
            res = run_workload(a, name, device, share, logs)
        res["run"] = doc["generated"]
        res["rev"] = doc["host"].get("git")  # merged reports name each run's commit
        done.append(res)
        doc["workloads"] = merged(done)
        doc["summary"] = summarise(doc["workloads"], meaningful)
        with paths["jsonl"].open("a") as f:
            f.write(json.dumps(res, default=str) + "\n")
        write_json(paths["json"], doc)
        paths["md"].write_text(markdown(doc))
        print(f"[{i + 1}/{len(a.names)}] {one_line(res, meaningful)}", flush=True)
    doc["wall_s"] = round(time.time() - t_run, 1)
    doc["workloads"] = merged(done)
    doc["summary"] = summarise(doc["workloads"], meaningful)
    write_json(paths["json"], doc)
    paths["md"].write_text(markdown(doc))
    print()
    print(tail_table(doc))
    print(f"\nwrote {paths['md']}, {paths['json'].name}, {paths['jsonl'].name} ({doc['wall_s']:.0f} s)")
    return 0


def run_workload(a, name: str, device: str, share: float, logs: Path) -> dict:
    """The main child, then (if the advisor ran) the warm-cache child; both under `share` seconds."""
    t0 = time.time()
    root = Path(tempfile.mkdtemp(prefix=f"fa-suite-{name}-"))
    try:
        warm_reserve = min(45.0, max(20.0, 0.3 * share))
        main_s = max(10.0, share - warm_reserve)
        res = run_child(a, name, device, root, root / "result.json", main_s, logs / f"{name}.log", warm=False)
        adv = res.get("advisor") or {}
        left = share - (time.time() - t0)
        if adv.get("cold_empty_s") is None:
            res.setdefault("advisor", {})["cold_warm_s"] = None
            res["warm_status"] = "not run: the advisor's empty-cache run did not finish"
        elif left < 10:
            res["warm_status"] = f"not run: {left:.0f} s left of this workload's budget"
        else:
            w = run_child(a, name, device, root, root / "warm.json", left, logs / f"{name}.warm.log", warm=True)
            wa = w.get("warm") or {}
            res["advisor"]["cold_warm_s"] = wa.get("cold_s")
            res["warm"] = wa
            res["warm_status"] = w.get("status")
            if w.get("status") != "ok":
                res["warm"]["log_tail"] = w.get("log_tail")
                res["warm"]["errors"] = w.get("errors")
        res["wall_s"] = round(time.time() - t0, 1)
        res["budget_s"] = round(share, 1)
        return res
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_child(a, name, device, root: Path, result: Path, timeout: float, log: Path, warm: bool) -> dict:
    cmd = child_command("bench.suite", "--child", name, "--device", device, "--root", str(root),
                        "--result", str(result), "--top", str(a.top), "--iters", str(a.iters),
                        "--deadline", f"{time.time() + timeout:.1f}")
    cmd += ["--quick"] * a.quick + ["--no-compile"] * a.no_compile + ["--warm"] * warm
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.time()
    with log.open("w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout + 5)  # the child watches its deadline too; this is the hard stop
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.returncode
        _kill_group(proc, leftovers_only=True)  # compile workers the child left behind, if any
    try:
        res = json.loads(result.read_text())
    except Exception:
        res = {"workload": name}
    res["child_rc"] = rc
    res["child_s"] = round(time.time() - t0, 1)
    if timed_out and res.get("phase") == "done":
        res["note"] = f"the child finished its work but not its exit within {timeout:.0f} s; stopped"
    elif timed_out:
        res["status"] = f"timeout after {timeout:.0f} s (in {res.get('phase') or 'start-up'})"
    elif rc != 0 and res.get("status") in (None, "running"):
        res["status"] = f"crashed (exit {rc}) in {res.get('phase') or 'start-up'}"
    if res.get("status") not in ("ok", "not installed"):
        res["log_tail"] = _tail(log, 40)
    return res


def _kill_group(proc, leftovers_only: bool = False) -> None:
    """Stop the child and what it started (Inductor's compile workers): its own process group (the
    child was started in a new session, so the group id is its pid and holds nothing else)."""
    if leftovers_only:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, n: int) -> list:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [ln[:300] for ln in lines[-n:]]


# ===================================================================================== child
class Child:
    """One workload in this process. `self.r` is the result, saved after every phase."""

    def __init__(self, a):
        self.a = a
        self.t0 = time.time()
        self.deadline = a.deadline or float("inf")
        self.root = Path(a.root or tempfile.mkdtemp(prefix="fa-suite-"))
        self.result = Path(a.result) if a.result else self.root / "result.json"
        self.r = {"workload": a.child, "status": "running", "phase": "start-up", "errors": {}, "phase_s": {},
                  "skipped": {}, "quick": a.quick}

    def save(self) -> None:
        self.r["elapsed_s"] = round(time.time() - self.t0, 1)
        write_json(self.result, self.r)

    def left(self) -> float:
        return self.deadline - time.time()

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time a phase; an exception is recorded under errors[name] and does not end the run."""
        self.r["phase"] = name
        self.save()
        print(f"--- {name} ({self.left():.0f} s left)", flush=True)
        t = time.time()
        box = {"ok": False}
        try:
            yield box
            box["ok"] = True
        except Exception as e:
            traceback.print_exc()
            tb = traceback.format_exc().strip().splitlines()
            self.r["errors"][name] = f"{type(e).__name__}: {e}"[:2000]
            self.r["errors"][name + "_traceback"] = tb[-12:]
        finally:
            self.r["phase_s"][name] = round(time.time() - t, 2)
            self.save()


def child_main(a) -> int:
    name = a.child
    device = a.device if a.device != "auto" else None
    root = Path(a.root or tempfile.mkdtemp(prefix="fa-suite-"))
    # Caches: fresh per workload (the advisor's kernel cache, Triton's, Inductor's), set before any import.
    os.environ["FUSION_ADVISOR_CACHE"] = str(root / "advisor-cache")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor-cache")
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton-warmup")
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # triton reads it when first imported
    c = Child(a)
    try:
        rc = run_child_phases(c, name, device, root)
    except BaseException as e:  # record, then let the parent see a failure
        c.r["status"] = f"error in {c.r.get('phase')}: {type(e).__name__}: {e}"[:500]
        c.r["errors"]["fatal"] = traceback.format_exc().strip().splitlines()[-12:]
        c.save()
        raise
    # The result is saved: skip the interpreter's teardown (Inductor's worker pool, CUDA) and its seconds.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def run_child_phases(c: Child, name: str, device: str | None, root: Path) -> int:
    import torch

    workloads = _workloads()
    a = c.a
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    meaningful = device == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
    c.r.update(device=device, timing_meaningful=meaningful, title=workloads.TITLES[name])
    if not meaningful:
        c.r["timing_note"] = NOT_MEANINGFUL
    with c.phase("build") as ok:
        try:
            w = workloads.build(name, device, a.quick)
        except workloads.NotInstalled as e:
            c.r.update(status="not installed", reason=str(e))
            c.save()
            return 0
    if not ok["ok"]:
        c.r["status"] = "error in build"
        c.save()
        return 1
    c.r.update(shape=w.shape, dtype=str(w.dtype).replace("torch.", ""), notes=w.notes,
               params=sum(p.numel() for p in w.model.parameters()))
    with c.phase("warm-up") as ok:
        process_warmup(device)
    args, kwargs = w.args_kwargs()

    def runner(m):
        def call():
            with torch.inference_mode():
                return m(*args, **kwargs)
        return call

    if a.warm:
        return warm_run(c, w, device, root, runner)

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    eager = runner(w.model)
    pre_iters, pre_warm = (2, 1) if a.quick else (10, 3)

    # ---- eager: the reference output and a first timing
    with c.phase("eager") as ok:
        ref = workloads.main_output(eager())
        sync()
        ref = ref.detach().clone()
        t = _time(eager, device, pre_warm, pre_iters)
        c.r["eager"] = {"prelim": t, "output": f"{tuple(ref.shape)} {str(ref.dtype).replace('torch.', '')}",
                        "output_all_finite": bool(torch.isfinite(ref).all())}
    if not ok["ok"]:
        c.r["status"] = "error in eager"
        c.save()
        return 1
    # The advisor patches its model in place: its own copy (torch.compile wraps the original, unchanged).
    m_adv = copy.deepcopy(w.model)

    # ---- the advisor, empty kernel cache: optimize -> first optimised call. It runs first, so that it is
    # the process's first real dynamo capture as in the warm-cache process (torch.compile, after it, may
    # profit from a warmer dynamo, never the advisor); capped so torch.compile still gets its turn.
    adv = c.r["advisor"] = {"top": a.top}
    report = None
    # Time kept for what comes after: torch.compile 1.5x its first call in the table (C++ on the
    # CPU: more), then the final timing (3 configurations warmed up and timed) and the kernel counts.
    compile_reserve = 0.0 if a.no_compile else (
        40.0 if device != "cuda" else 6.0 + 1.5 * workloads.ANCHORS.get(name, (0, 0, workloads.COMPILE_S))[2])
    eager_s = c.r["eager"]["prelim"]["median_ms"] / 1e3
    final_reserve = 4.0 + 3 * (1.5 + 1.5 * (a.iters + 8) * eager_s) if not a.quick else 5.0
    with c.phase("advisor") as ok, time_limit(c.left() - compile_reserve - final_reserve, "advisor.optimize",
                                              floor=0.6 * c.left()):
        from advisor.workflows.live_model import optimize

        os.environ["TRITON_CACHE_DIR"] = str(root / "triton-advisor")
        call = runner(m_adv)
        sync()
        t1 = time.perf_counter()
        report = optimize(m_adv, w.inputs, top=a.top, out=root / "advisor-out", select=False,
                          interpret=True)  # selected below; interpret: the quick CPU run exercises the patcher
        t2 = time.perf_counter()
        out = call()
        sync()
        adv["cold_empty_s"] = round(time.perf_counter() - t1, 2)
        adv["optimize_s"] = round(t2 - t1, 2)
        adv["phases_s"] = report.phases_s
        adv["plan_key_parts"] = _key_parts(report.out_dir)
        adv["cache_files"] = count_files(Path(os.environ["FUSION_ADVISOR_CACHE"]))
        adv["check"] = report.check
        adv["patterns"] = [slim_pattern(p) for p in report.patterns]
        adv["patched"] = len(report.applied)
        errs = report.handle.errors() if report.handle is not None and hasattr(report.handle, "errors") else []
        if errs:
            adv["capture_errors"] = [str(e)[:300] for e in errs[:10]]
        adv["all_patched_errors"] = errors_vs(ref, workloads.main_output(out))
        del out
    if not ok["ok"]:
        report = None
        _unpatch_quietly(m_adv)

    # ---- keep only what is faster (GPU): each pattern alone, then the kept set end to end
    if report is not None:
        from advisor.patching.verify import float32_reference

        with c.phase("select") as ok, time_limit(c.left() - compile_reserve - final_reserve, "selection",
                                                 floor=min(30.0, 0.3 * c.left())):
            select_patterns(c, report, m_adv, runner(m_adv), device, meaningful, compile_reserve + final_reserve,
                            float32_reference(m_adv, args, kwargs))
        if not ok["ok"]:  # half-way through a re-patch: measure the advisor as it was left, say so
            adv["decision"] = f"selection failed, the model is measured as it was left: {c.r['errors'].get('select')}"

    # ---- torch.compile, default mode: the first call (empty Inductor/Triton caches), then steady state
    compiled = None
    if a.no_compile:
        c.r["skipped"]["compile"] = "--no-compile"
    else:
        with c.phase("compile") as ok, time_limit(c.left() - final_reserve, "torch.compile", floor=0.5 * c.left()):
            os.environ["TRITON_CACHE_DIR"] = str(root / "triton-compile")
            compiled_mod = torch.compile(w.model)
            call = runner(compiled_mod)
            sync()
            t1 = time.perf_counter()
            out = call()
            sync()
            first = time.perf_counter() - t1
            comp = c.r["compile"] = {"first_call_s": round(first, 2), "mode": "default"}
            comp.update(errors_vs(ref, workloads.main_output(out)))
            del out
            comp["prelim"] = _time(call, device, pre_warm, pre_iters)
            compiled = call

    # ---- final: eager, advisor, compile timed in interleaved rounds
    fns = {"eager": eager}
    if report is not None:
        fns["advisor"] = runner(m_adv)
    if compiled is not None:
        fns["compile"] = compiled
    with c.phase("final timing") as ok:
        rounds = 1 if a.quick else 3
        warmup_s = 0.0 if a.quick else 0.5
        times = interleaved(fns, device, a.iters, rounds, warmup_s)
        for k, t in times.items():
            c.r.setdefault(k, {})["timing"] = t
            c.r[k]["median_ms"] = t["median_ms"]
            c.r[k]["spread_ms"] = t["spread_ms"]
    # Kernel counts last: the profiler's first use in a process (CUPTI) is then part of the advisor's cold
    # start here, as it is in the warm-cache process.
    with c.phase("outputs") as ok:
        if "advisor" in fns:
            out = fns["advisor"]()
            c.r["advisor"].update(errors_vs(ref, workloads.main_output(out)))
            del out
        for k, fn in fns.items():
            c.r[k]["kernels_per_iter"] = kernel_count(fn, device, root)
        if "advisor" in fns:
            from advisor.patching import patched_modules

            failed = {q or "<root>": f.failed for q, f in patched_modules(m_adv) if getattr(f, "failed", None)}
            if failed:  # a patched forward that raised runs the original code from then on: say so
                c.r["advisor"]["failed_forwards"] = failed
                c.r["errors"]["patched forward"] = "; ".join(f"{q}: {v}" for q, v in failed.items())[:1000]
    finish(c, meaningful)
    c.r["status"] = "ok" if not any(k for k in c.r["errors"] if not k.endswith("_traceback")) else "partial"
    c.r["phase"] = "done"
    c.save()
    return 0


def finish(c: Child, meaningful: bool) -> None:
    """Speedups (eager / x, same run) and the estimate-vs-measured comparison."""
    r = c.r
    e = (r.get("eager") or {}).get("median_ms")
    for k in ("advisor", "compile"):
        x = (r.get(k) or {}).get("median_ms")
        if k in r:
            r[k]["speedup"] = round(e / x, 4) if (meaningful and e and x) else None
    adv = r.get("advisor") or {}
    if adv.get("speedup") and adv.get("kept") == []:
        # Nothing kept: the advisor's model *is* eager, and its ratio to eager is noise; count it as 1.
        adv["speedup_note"] = (f"nothing kept (the model runs eager): its own measurement, {adv['median_ms']:.3f} ms "
                               f"({adv['speedup']:.2f}x), is noise")
        adv["measured_speedup"], adv["speedup"] = adv["speedup"], 1.0
    if meaningful and e and adv.get("median_ms"):
        kept = [p for p in adv.get("patterns", []) if p.get("kept")]
        est = sum(p.get("est_us") or 0.0 for p in kept)
        meas = (e - adv["median_ms"]) * 1e3
        adv["end_to_end"] = {"measured_saved_us": round(meas, 1), "est_saved_us_kept": round(est, 1),
                             "ratio": round(meas / est, 3) if est else None}


def select_patterns(c: Child, report, model, call, device: str, meaningful: bool, reserve: float = 0.0,
                    exact=None) -> None:
    """`advisor.workflows.selection.keep_faster`: each patched pattern timed alone, the ones that save time kept, and
    the kept set only if it beats eager end to end (else the model runs unpatched); what it decided goes
    into the workload's record. Skipped (all kept) when the budget has no time left for it."""
    from advisor.workflows.selection import final_status, keep_faster

    adv = c.r["advisor"]
    patched = [p for p in report.patterns if p.get("patched")]
    need = 4.0 + 1.2 * (3 + len(patched))
    if patched and meaningful and c.left() - reserve < need:
        adv["decision"] = f"all patched patterns kept (no time left to time them alone: {c.left():.0f} s)"
        adv["kept"] = [p["candidate"] for p in patched]
        c.r["skipped"]["select"] = adv["decision"]
        _mark(adv, set(adv["kept"]))
        return
    # `exact`: the float32 reference the outer capture's check judges low-precision outputs by, as optimize's
    handle, sel, report.results = keep_faster(call, report.handle, device, report.results, iters=20, exact=exact)
    if sel.get("outer") and sel.get("outer_sites") is not None:  # as optimize's: patterns only the whole stack fuses
        doc = json.loads((report.out_dir / "analysis.json").read_text())
        report.results = final_status(report.results, handle.plan.patterns, handle,
                                      report.check.get("dropped") or {}, doc, sel["outer_sites"], sel)
    adv.update(decision=sel["decision"], kept=sel["kept"])
    # what the final comparison timed (every state, the whole stack's included) and why a state was refused
    adv["selection"] = {k: sel.get(k) for k in ("state", "states", "final", "outer", "outer_check")}
    if sel.get("all_patched"):
        adv["all_patched"] = sel["all_patched"]
    if sel.get("kept_set"):
        adv["kept_set_tuning"] = sel["kept_set"]
    from bench.retime import retime_unresolved

    patterns = report.patterns  # JSON made afresh at each access: one copy, retimed in place
    adv["retimed"] = retime_unresolved(call, handle, patterns, set(sel["kept"]), device)
    adv["patterns"] = [slim_pattern(p) for p in patterns]
    _mark(adv, set(adv["kept"]))


def _unpatch_quietly(model) -> None:
    try:
        from advisor.patching import unpatch

        unpatch(model)
    except Exception:
        pass


class PhaseTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float, what: str, floor: float = 5.0):
    """Raise `PhaseTimeout` in this (main) thread after `seconds` (SIGALRM), so one slow phase cannot eat
    the time of the phases after it. No limit when `seconds` is infinite."""
    if seconds is None or math.isinf(seconds) or not hasattr(signal, "setitimer"):
        yield
        return
    seconds = max(floor, seconds)

    def on_alarm(signum, frame):
        raise PhaseTimeout(f"{what} did not finish within its {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _mark(adv: dict, kept: set) -> None:
    for p in adv.get("patterns", []):
        p["kept"] = p["candidate"] in kept


def slim_pattern(p: dict) -> dict:
    """An apply.json pattern record without the kernel source, plus estimate vs measured."""
    from bench.retime import measured

    alone = p.get("applied_alone") or {}
    # the estimate for the sites actually patched (selection.estimate_for_sites), else the whole pattern's;
    # measured: the benchmark's longer timing where selection's did not resolve ±25% (bench/retime.py)
    est = alone.get("est_saved_us_per_iter", p.get("est_time_saved_us"))
    meas, spread, how = measured(alone)
    out = {"candidate": p.get("candidate"), "pattern_id": p.get("pattern_id"), "title": p.get("title"),
           "occurrences": p.get("occurrences"), "validated": p.get("validated"), "patched": bool(p.get("patched")),
           "sites": p.get("sites"), "status": p.get("status") or p.get("reason"),
           "est_us": round(est, 2) if isinstance(est, (int, float)) else None,
           "measured_us": meas, "measured_spread_us": spread, "measured_by": how,
           "selection_measured_us": alone.get("saved_us_per_iter"), "selection_spread_us": alone.get("spread_us"),
           "kernel_file": Path(p["kernel_file"]).name if p.get("kernel_file") else None}
    if isinstance(est, (int, float)) and est and isinstance(meas, (int, float)):
        out["measured_over_est"] = round(meas / est, 3)
        out["within_25pct"] = within_quarter(est, meas)
    out["matmul_epilogue"] = bool(re.search(r"\b(linear|addmm|mm|bmm|matmul|conv\w*) epilogue",
                                            str(p.get("title") or "")))
    return out


def warm_run(c: Child, w, device: str, root: Path, runner) -> int:
    """A new process, the kernel cache (and Triton's) the empty-cache run filled: optimize -> first call."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    before = count_files(Path(os.environ["FUSION_ADVISOR_CACHE"]))
    with c.phase("advisor warm") as ok:
        from advisor.workflows.live_model import optimize

        os.environ["TRITON_CACHE_DIR"] = str(root / "triton-advisor")
        call = runner(w.model)
        call()  # one eager call first, as the empty-cache run had before its optimize
        sync()
        t1 = time.perf_counter()
        report = optimize(w.model, w.inputs, top=c.a.top, out=root / "advisor-warm-out", select=False, interpret=True)
        call()
        sync()
        c.r["warm"] = {"cold_s": round(time.perf_counter() - t1, 2), "patched": len(report.applied),
                       "phases_s": report.phases_s, "plan_key_parts": _key_parts(report.out_dir),
                       "cache_files_before": before,
                       "cache_files_after": count_files(Path(os.environ["FUSION_ADVISOR_CACHE"])),
                       "patterns": [{"candidate": p.get("candidate"), "title": p.get("title"),
                                     "patched": bool(p.get("patched")), "status": p.get("status")}
                                    for p in report.patterns]}
    c.r["status"] = "ok" if ok["ok"] else "error in advisor warm"
    c.r["phase"] = "done"
    c.save()
    return 0 if ok["ok"] else 1


def _key_parts(out_dir: Path) -> dict | None:
    """The plan key's per-section digests (apply.json): which section differs when a warm run misses."""
    try:
        return json.loads((Path(out_dir) / "apply.json").read_text()).get("plan_key_parts")
    except (OSError, ValueError):
        return None

if __name__ == "__main__":
    sys.exit(main())
