"""Stage 1, collect: run a user's script under torch.profiler + ExecutionTraceObserver and write a trace dir.

    DIR/trace/kineto.json.gz   Kineto Chrome trace (export_chrome_trace, gzipped; opens in Perfetto/TensorBoard)
    DIR/trace/et.json.gz       PyTorch Execution Trace (gzipped JSON)
    DIR/trace/meta.json        what ran where, steady-state iterations, device bandwidth / launch cost

The script runs in-process as `__main__`, like `python SCRIPT ARGS`.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import platform
import runpy
import shutil
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from advisor import config
from advisor.collect.native_log import stop_execution_trace
from advisor.collect.schedule import ProfilerWindow, Schedule
from advisor.errors import AdvisorError, not_writable
from advisor.jsonio import META_SCHEMA_VERSION, write_json

DEVICE_ENV = config.DEVICE
EXIT_SCRIPT_FAILED = 1
EXIT_NO_TENSOR_WORK = 4


# ---------------------------------------------------------------------------------------------
# input checks
# ---------------------------------------------------------------------------------------------
def check_script(script: Path) -> None:
    """One clear AdvisorError line when SCRIPT cannot be run as a Python script."""
    if not script.exists():
        raise AdvisorError(f"script not found: {script}")
    if script.is_dir():
        raise AdvisorError(f"{script} is a directory, not a Python script")
    if script.suffix != ".py":
        raise AdvisorError(f"{script} is not a Python script (expected a .py file)")
    try:
        raw = script.read_bytes()
    except OSError as e:
        raise AdvisorError(f"cannot read {script}: {e.strerror or e}") from None
    if b"\x00" in raw:
        raise AdvisorError(f"{script} is not Python source (it contains binary data)")
    try:
        compile(raw, str(script), "exec", dont_inherit=True)
    except SyntaxError as e:
        where = f"{script}:{e.lineno}" if e.lineno else str(script)
        raise AdvisorError(f"{where}: not valid Python ({e.msg})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise AdvisorError(f"{script} is not Python source ({e})") from None


def resolve_device(device: str) -> str:
    import torch

    d = (device or "auto").strip().lower()
    if d not in ("auto", "cuda", "cpu"):
        raise AdvisorError(f"--device must be auto, cuda or cpu (got {device!r})")
    if d == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if d == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise AdvisorError(f"--device cuda, but no CUDA GPU is available (torch {torch.__version__}, {build}); use --device cpu")
    return d


# ---------------------------------------------------------------------------------------------
# running the script
# ---------------------------------------------------------------------------------------------
class _Outcome:
    def __init__(self) -> None:
        self.complete = False
        self.error: Optional[str] = None
        self.traceback: Optional[str] = None
        self.interrupted = False
        self.exit_code = EXIT_SCRIPT_FAILED  # what `python SCRIPT` would have exited with
        self.wall_s = 0.0


def _script_traceback(exc: BaseException, script: Path) -> str:
    """The traceback from the script's first frame on (the runner's own frames left out)."""
    target = os.path.realpath(script)
    tb = exc.__traceback__
    t = tb
    while t is not None and os.path.realpath(t.tb_frame.f_code.co_filename) != target:
        t = t.tb_next
    return "".join(traceback.format_exception(type(exc), exc, t if t is not None else tb))


@contextlib.contextmanager
def script_env(script: Path, args: Sequence[str], device: str):
    """sys.argv, sys.path[0] and FUSION_ADVISOR_DEVICE as `python SCRIPT ARGS` would see them; restored after."""
    old_argv, old_path, old_env = sys.argv[:], sys.path[:], os.environ.get(DEVICE_ENV)
    sys.argv = [str(script), *args]
    sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
    os.environ[DEVICE_ENV] = device
    try:
        yield
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
        if old_env is None:
            os.environ.pop(DEVICE_ENV, None)
        else:
            os.environ[DEVICE_ENV] = old_env


def preimport(script: Path) -> List[str]:
    """Import, before profiling starts, the installed packages that SCRIPT imports anywhere in its source.

    With `with_stack=True` the Python tracer records every call, and importing a large library
    (transformers: millions of calls) would swamp the trace and make exporting it take minutes. Only
    absolute imports of modules found outside the script's own directory are done (the user's local
    modules keep their import-time side effects where the script puts them); `from pkg import name`
    also resolves `name`, which loads lazily exported submodules. Failures are ignored: the script
    meets them itself. Returns the modules imported.
    """
    import ast
    import importlib
    import importlib.util

    try:
        tree = ast.parse(script.read_bytes(), str(script))
    except (SyntaxError, ValueError):
        return []
    script_dir = os.path.dirname(os.path.realpath(script)) + os.sep
    wanted: List[tuple] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            wanted += [(a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            wanted.append((node.module, tuple(a.name for a in node.names if a.name != "*")))
    done: List[str] = []
    for name, attrs in wanted:
        top = name.split(".")[0]
        if top == "advisor" or top == "__main__":
            continue
        try:
            spec = importlib.util.find_spec(top)
            origin = getattr(spec, "origin", None) or ""
            locs = list(getattr(spec, "submodule_search_locations", None) or [])
            if spec is None or any(os.path.realpath(x).startswith(script_dir) for x in [origin, *locs] if x):
                continue
            mod = importlib.import_module(name)
            for a in attrs:
                try:
                    getattr(mod, a)
                except AttributeError:
                    try:
                        importlib.import_module(f"{name}.{a}")
                    except Exception:
                        pass
            done.append(name)
        except KeyboardInterrupt:
            raise
        except BaseException:  # noqa: BLE001 - ImportError, SystemExit from odd modules, ...
            continue
    return done


def _run_as_main(script: Path, outcome: _Outcome) -> None:
    """runpy the script as __main__ (argv/path already set up); record how it ended in `outcome`."""
    t0 = time.perf_counter()
    try:
        runpy.run_path(str(script), run_name="__main__")
        outcome.complete = True
    except SystemExit as e:
        code = e.code
        if code is None or code == 0:
            outcome.complete = True
        else:
            outcome.error = f"SystemExit: {code}"
            if isinstance(code, int):  # passed on, so a shell sees what it would see without the advisor
                outcome.exit_code = code if 0 < code < 256 else EXIT_SCRIPT_FAILED
            else:  # `sys.exit("message")`: python prints the message and exits 1
                outcome.traceback = f"{code}\n"
    except KeyboardInterrupt:
        outcome.error = "KeyboardInterrupt"
        outcome.interrupted = True
    except BaseException as e:  # noqa: BLE001 - the workload's failure is reported, not ours
        outcome.error = f"{type(e).__name__}: {e}".strip()
        outcome.traceback = _script_traceback(e, script)
    finally:
        outcome.wall_s = time.perf_counter() - t0


def _all_threads() -> Dict[str, Any]:
    """Kineto records cpu ops of the profiling thread only, while the ET observer records every thread: a
    script that runs its model in worker threads left the analyzer ET ops without Kineto ops, and so no
    candidates (tests/test_reliability.py). Recent torch can profile all threads."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):  # older torch: the analyzer warns about the ops it cannot join
        return {}


def _schedule(schedule: Optional[Schedule], profile_calls: Optional[int]) -> Schedule:
    """The schedule asked for: `schedule`, else the first `profile_calls` calls (FUSION_ADVISOR_PROFILE_CALLS
    when neither is given), else `Schedule.default()`: the first call as warm-up and a few steady ones."""
    if schedule is not None:
        return schedule
    if profile_calls is None:
        profile_calls = config.current().profile_calls
    return Schedule.first_calls(profile_calls) if profile_calls else Schedule.default()


def _gzip_file(src: Path, dst: Path) -> None:
    with open(src, "rb") as fin, gzip.open(dst, "wb", compresslevel=6) as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
    src.unlink()


def _versions() -> Dict[str, Any]:
    import torch

    from advisor.version import __version__

    try:
        import triton  # noqa: F401

        triton_version = getattr(triton, "__version__", None)
    except Exception:
        triton_version = None
    return {
        "tool": f"fusion-advisor {__version__}",
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def profile_script(
    script: Path | str,
    args: Optional[List[str]] = None,
    out_dir: Path | str = "advisor_out",
    device: str = "auto",
    region: Optional[str] = None,
    console=None,
    preimport_modules: bool = True,
    profile_calls: Optional[int] = None,
    schedule: Optional[Schedule] = None,
    totals: bool = True,
) -> Dict[str, Any]:
    """Profile SCRIPT and write OUT_DIR/trace/{kineto.json.gz, et.json.gz, meta.json}; returns meta.

    Raises AdvisorError for bad input (exit 2), a failing script (exit 1; partial trace written with
    complete=false) and a script that did no tensor work (exit 4; trace written). `totals=False` leaves out the
    profiler's own count and time per iteration, where the analysis's report follows with its own.
    """
    from rich.console import Console

    from advisor.collect.nvtx_ranges import nvtx_range

    console = console or Console(highlight=False, soft_wrap=True)
    script = Path(script)
    args = list(args or [])
    if args and args[0] == "--":
        args = args[1:]
    check_script(script)
    dev = resolve_device(device)
    schedule = _schedule(schedule, profile_calls)
    from advisor.collect.distributed import DistributedProbe, clear_rank_dirs, trace_dir_for

    trace_dir, ranked = trace_dir_for(Path(out_dir))  # OUT/trace/rank-K inside a torchrun job
    try:
        trace_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise not_writable(trace_dir, e) from None
    if ranked is None:  # one process: a distributed run's rank folders here are not this run's
        clear_rank_dirs(trace_dir)

    import torch
    from torch.profiler import ExecutionTraceObserver, ProfilerActivity, profile

    from advisor.collect import steady as steady_mod
    from advisor.collect.module_scopes import module_scopes
    from advisor.collect.measure import device_info, measure
    from advisor.collect.nvtx_ranges import ranges_as_regions
    from advisor.fast_paths import module_level_paths

    kineto_gz, et_gz, meta_path = trace_dir / "kineto.json.gz", trace_dir / "et.json.gz", trace_dir / "meta.json"
    kineto_tmp, et_tmp = trace_dir / "kineto.json.tmp", trace_dir / "et.json.tmp"
    for p in (kineto_gz, et_gz, meta_path, kineto_tmp, et_tmp):
        if p.exists():
            p.unlink()

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    outcome = _Outcome()
    console.print(f"[bold]fusion-advisor[/] profiling [cyan]{script}[/] on [bold]{dev}[/] …")
    timings: Dict[str, float] = {}
    t_phase = time.perf_counter()
    probe = DistributedProbe(ranked or {})
    with script_env(script, args, dev):
        if preimport_modules:
            with nvtx_range("fusion-advisor.preimport"), console.status("importing the script's packages …", spinner="dots"):
                preimport(script)
        timings["preimport"] = time.perf_counter() - t_phase
        t_phase = time.perf_counter()
        et = ExecutionTraceObserver().register_callback(str(et_tmp))
        try:
            with nvtx_range("fusion-advisor.profile"):
                with console.status(f"running {script.name} under torch.profiler …", spinner="dots"), \
                        warnings.catch_warnings():
                    # torch 2.11 warns about schedule cycles, which a single profile() never has
                    warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle.*")
                    prof = profile(activities=activities, record_shapes=True, with_stack=True,
                                   execution_trace_observer=et, **_all_threads())
                    sync = torch.cuda.synchronize if dev == "cuda" else None
                    window = ProfilerWindow(prof, schedule, before_stop=sync)
                    try:
                        # module_level_paths: the ops a capture of the script's modules will see
                        with ranges_as_regions(), module_scopes(), module_level_paths(), probe, window:
                            _run_as_main(script, outcome)
                    finally:
                        try:
                            window.stop()
                        except Exception as e:  # a CUDA error from the workload surfaces here
                            if outcome.error is None:
                                outcome.complete, outcome.error = False, f"{type(e).__name__}: {e}"
        finally:
            stop_execution_trace(et)

    timings["profile"] = time.perf_counter() - t_phase
    t_phase = time.perf_counter()
    if not window.started:
        raise AdvisorError(f"nothing was profiled: the schedule waits for {schedule.wait} calls of the outermost "
                           f"nn.Module and {script} made {window.calls}", exit_code=EXIT_NO_TENSOR_WORK)
    if outcome.traceback:
        sys.stdout.flush()
        sys.stderr.write(outcome.traceback)
        sys.stderr.flush()

    with nvtx_range("fusion-advisor.export"), console.status("writing the trace …", spinner="dots"):
        prof.export_chrome_trace(str(kineto_tmp))
        with open(kineto_tmp, "rb") as f:
            trace = json.load(f)
        _gzip_file(kineto_tmp, kineto_gz)
        et_note = None
        if et_tmp.exists() and et_tmp.stat().st_size > 0:
            _gzip_file(et_tmp, et_gz)
        else:
            et_note = "the execution trace observer wrote no file"
        events = trace.get("traceEvents", []) if isinstance(trace, dict) else []
        steady = steady_mod.steady_state(events, region, warmup=schedule.warmup, wait=schedule.wait)
        summary = steady_mod.summarize(events, steady)
        del trace, events
    timings["export"] = time.perf_counter() - t_phase
    t_phase = time.perf_counter()

    with nvtx_range("fusion-advisor.measure"), console.status("measuring bandwidth and launch cost …", spinner="dots"):
        measured = measure(dev)
        dinfo = device_info(dev)
    timings["measure"] = time.perf_counter() - t_phase

    meta: Dict[str, Any] = {
        "schema_version": META_SCHEMA_VERSION,
        **_versions(),
        "device": dinfo,
        "script": str(script),
        "args": args,
        "steady_state": steady,
        "bandwidth_Bps": measured["bandwidth_Bps"],
        "launch_us": measured["launch_us"],
        "dispatch_us": measured["dispatch_us"],
        "complete": outcome.complete,
        "error": outcome.error,
        "kernels": summary["kernels"],
        "cpu_ops": summary["cpu_ops"],
        "wall_s": round(outcome.wall_s, 4),
        "profile_calls": schedule.last_call,
        "schedule": schedule.as_meta(),
        "module_calls": window.calls,  # calls of the outermost nn.Module the script made, profiled or not
        "collect_s": {k: round(v, 3) for k, v in timings.items()},
        # what this process exits with: 130 interrupted, the script's code, 4 no tensor work, else 0
        "exit_code": (130 if outcome.interrupted else outcome.exit_code if not outcome.complete
                      else EXIT_NO_TENSOR_WORK if summary["aten_ops"] == 0 else 0),
    }
    if ranked is not None:  # rank, world_size, local_rank, backend (torch.distributed's once its group was up)
        meta.update(probe.info)
    if "measure_error" in measured:
        meta["measure_error"] = measured["measure_error"]
    if et_note:
        meta["et_error"] = et_note
    write_json(meta_path, meta, indent=2)

    _print_summary(console, meta, summary, trace_dir, dev, region, totals)

    if outcome.interrupted:
        raise KeyboardInterrupt
    if not outcome.complete:
        raise AdvisorError(
            f"{script} failed ({outcome.error}); partial trace written to {trace_dir} (complete: false)",
            exit_code=outcome.exit_code,
        )
    if summary["aten_ops"] == 0:
        raise AdvisorError(
            f"{script} did no tensor work: no aten ops were recorded, so there is nothing to analyse "
            f"(trace written to {trace_dir})",
            exit_code=EXIT_NO_TENSOR_WORK,
        )
    return meta


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"  # pragma: no cover


def _print_summary(console, meta, summary, trace_dir: Path, dev: str, region: Optional[str], totals: bool = True) -> None:
    st = meta["steady_state"]
    if meta["complete"]:
        status = "[green]completed[/]"
    else:
        status = "[yellow]interrupted[/]" if meta["error"] == "KeyboardInterrupt" else f"[red]failed[/] ({meta['error']})"
    console.print(f"script {status} in {meta['wall_s']:.2f} s")
    n_it = len(st["iterations"])
    if st["source"] == "region":
        what = f"region [cyan]{st['name']}[/]"
    elif st["source"] == "module":
        what = f"calls of module [cyan]{st['name']}[/]" + \
            (", each with its backward and optimizer step" if st.get("training_step") else "")
    else:
        what = "the whole trace (no region or nn.Module call found)"
    dropped = f", {st['warmup_dropped']} warm-up dropped" if st["warmup_dropped"] else ""
    plural = "s" if n_it != 1 else ""
    console.print(f"steady state: {n_it} iteration{plural} of {what}{dropped} (found {st['found']})")
    if st.get("requested_region"):
        console.print(f"[yellow]warning:[/] no region named {st['requested_region']!r} was recorded; "
                      f"fell back to {st['source']}")
    console.print(f"recorded {summary['cpu_ops']} cpu ops ({summary['aten_ops']} aten), {summary['kernels']} kernels")
    last, made = meta.get("profile_calls"), meta.get("module_calls") or 0
    if last is not None and made > last:
        console.print(f"profiled calls {meta['schedule']['wait'] + 1}-{last} of the {made} the script made "
                      "(--calls N or --schedule WAIT,WARMUP,ACTIVE profiles others)")
    # The profiler's raw figures: every op event, nested ones included. The analysis counts the ops it models
    # over its own steady state; `run` prints only its figures ("over 37 cpu ops" sat above "8 ops").
    if totals and dev == "cuda":
        console.print(f"GPU time per steady iteration: {summary['gpu_us_per_iter'] / 1e3:.3f} ms "
                      f"over {summary['kernels_per_iter']:.0f} kernels")
    elif totals:
        console.print(f"CPU op time per steady iteration: {summary['cpu_op_us_per_iter'] / 1e3:.3f} ms "
                      f"in top-level ops ({summary['cpu_ops_per_iter']:.0f} op events, nested ones included)")
    bw, lu = meta.get("bandwidth_Bps"), meta.get("launch_us")
    bw_s = f"{bw / 1e9:.1f} GB/s" if bw else "n/a"
    lu_s = f"{lu:.2f} us" if lu else "n/a"
    console.print(f"device: {meta['device'].get('name')}; copy bandwidth {bw_s}, launch {lu_s}")
    sizes = ", ".join(f"{p.name} {_fmt_bytes(p.stat().st_size)}" for p in sorted(trace_dir.iterdir()) if p.is_file())
    console.print(f"trace written to [bold]{trace_dir}[/] ({sizes})")
