"""Stage 1, the collector: `fusion-advisor profile` on real workloads (no mocks of torch.profiler)."""
from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from rich.console import Console

from advisor.cli import main as cli_main
from advisor.collect import steady
from advisor.collect.runner import profile_script

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "examples" / "seed.py"


def _quiet():
    return Console(file=io.StringIO(), width=200)


def _cli(argv, capsys):
    """Run the CLI in-process; returns (exit code, stdout, stderr)."""
    code = 0
    try:
        cli_main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def _load(trace_dir: Path):
    with gzip.open(trace_dir / "kineto.json.gz", "rt") as f:
        kineto = json.load(f)
    with gzip.open(trace_dir / "et.json.gz", "rt") as f:
        et = json.load(f)
    meta = json.loads((trace_dir / "meta.json").read_text())
    return kineto, et, meta


def _script(tmp_path: Path, name: str, body: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


# ------------------------------------------------------------------------------------------------
# the seed example, end to end through `python -m advisor profile` in a subprocess
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def seed_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("seed")
    proc = subprocess.run(
        [sys.executable, "-m", "advisor", "profile", "examples/seed.py", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return proc, out / "trace"


def test_seed_writes_three_files(seed_run):
    proc, trace = seed_run
    assert proc.returncode == 0, proc.stderr
    for name in ("kineto.json.gz", "et.json.gz", "meta.json"):
        assert (trace / name).is_file(), name
    assert "steady state: 2 iterations" in proc.stdout
    assert str(trace) in proc.stdout


def test_seed_kineto_is_a_chrome_trace_joined_to_et(seed_run):
    _, trace = seed_run
    kineto, et, _ = _load(trace)
    events = kineto["traceEvents"]
    assert isinstance(events, list) and all("ph" in e for e in events)
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    aten = [e for e in ops if e["name"].startswith("aten::")]
    names = {e["name"] for e in aten}
    assert {"aten::add", "aten::relu", "aten::log"} <= names
    assert all(e["args"].get("Record function id", 0) != 0 for e in aten)
    # ET nodes join to Kineto cpu ops through rf_id == "Record function id"
    assert et["schema"].startswith("1.")
    rf_ids = {a["value"] for n in et["nodes"] for a in n["attrs"] if a["name"] == "rf_id"}
    joined = sum(1 for e in aten if e["args"]["Record function id"] in rf_ids)
    assert joined / len(aten) >= 0.9
    # the ET carries the shapes the analysis needs
    adds = [n for n in et["nodes"] if n["name"] == "aten::add"]
    assert adds and adds[0]["inputs"]["shapes"][0] == [1 << 16]


def test_seed_meta(seed_run):
    _, trace = seed_run
    _, _, meta = _load(trace)
    assert meta["tool"].startswith("fusion-advisor ")
    assert meta["torch"] == torch.__version__
    assert meta["python"].count(".") == 2
    assert "triton" in meta and "cuda" in meta
    assert meta["device"]["type"] == "cpu" and meta["device"]["name"]
    assert meta["script"] == "examples/seed.py" and meta["args"] == []
    assert meta["complete"] is True and meta["error"] is None
    assert meta["bandwidth_Bps"] > 1e8
    assert 0 < meta["launch_us"] < 1000
    assert meta["cpu_ops"] > 0 and meta["kernels"] == 0
    assert meta["wall_s"] > 0
    st = meta["steady_state"]
    assert st["source"] == "module" and st["name"] == "Seed_0"
    assert st["found"] == 3 and st["warmup_dropped"] == 1 and len(st["iterations"]) == 2
    # windows are in the Kineto time base and each holds exactly one add/relu/log chain
    kineto, _, _ = _load(trace)
    logs = [e for e in kineto["traceEvents"] if e.get("name") == "aten::log"]
    inside = [e for e in logs if any(b <= e["ts"] <= en for b, en in st["iterations"])]
    assert len(logs) == 3 and len(inside) == 2
    assert st["iterations"][0][0] > min(e["ts"] for e in logs)  # the warm-up call is not in a window


# ------------------------------------------------------------------------------------------------
# how the script is run
# ------------------------------------------------------------------------------------------------
def test_script_runs_as_main_with_argv_path_env(tmp_path, monkeypatch):
    report = tmp_path / "seen.json"
    script = _script(tmp_path, "probe.py", """
        import json, os, sys, torch
        torch.ones(3) * 2
        json.dump({"name": __name__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
                   "env": os.environ.get("FUSION_ADVISOR_DEVICE")}, open(sys.argv[-1], "w"))
    """)
    monkeypatch.chdir(ROOT)
    argv_before, path_before = sys.argv[:], sys.path[:]
    meta = profile_script(script, ["--", "--flag", "x", str(report)], out_dir=tmp_path / "o", device="cpu",
                          console=_quiet())
    seen = json.loads(report.read_text())
    assert seen["name"] == "__main__"
    assert seen["argv"] == [str(script), "--flag", "x", str(report)]
    assert seen["path0"] == str(tmp_path)
    assert seen["cwd"] == str(ROOT)
    assert seen["env"] == "cpu"
    assert sys.argv == argv_before and sys.path == path_before
    assert "FUSION_ADVISOR_DEVICE" not in os.environ
    assert meta["args"] == ["--flag", "x", str(report)]


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------
def test_missing_script(tmp_path, capsys):
    missing = tmp_path / "nope.py"
    code, out, err = _cli(["profile", str(missing), "--out", str(tmp_path / "o")], capsys)
    assert code != 0
    assert str(missing) in err and "not found" in err
    assert len(err.strip().splitlines()) == 1


def test_not_a_python_file(tmp_path, capsys):
    p = tmp_path / "notes.txt"
    p.write_text("hello\n")
    code, _, err = _cli(["profile", str(p)], capsys)
    assert code != 0 and "not a Python script" in err and len(err.strip().splitlines()) == 1
    b = tmp_path / "blob.py"
    b.write_bytes(b"\x7fELF\x00\x01\x02")
    code, _, err = _cli(["profile", str(b)], capsys)
    assert code != 0 and "not Python source" in err and len(err.strip().splitlines()) == 1


def test_syntax_error(tmp_path, capsys):
    p = _script(tmp_path, "broken.py", "def f(:\n    pass\n")
    code, _, err = _cli(["profile", str(p), "--out", str(tmp_path / "o")], capsys)
    assert code != 0
    assert f"{p}:1" in err and "not valid Python" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o" / "trace" / "meta.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_device_cuda_without_gpu(capsys):
    code, _, err = _cli(["profile", str(SEED), "--device", "cuda"], capsys)
    assert code == 2 and "no CUDA GPU" in err and len(err.strip().splitlines()) == 1
    code, _, err = _cli(["profile", str(SEED), "--device", "tpu"], capsys)
    assert code == 2 and "'auto', 'cuda', 'cpu'" in err


def test_raising_script_leaves_partial_trace(tmp_path, capsys):
    p = _script(tmp_path, "boom.py", """
        import torch
        x = torch.ones(4) + 1

        def explode():
            raise ValueError("boom at step 2")

        explode()
    """)
    code, _, err = _cli(["profile", str(p), "--out", str(tmp_path / "o"), "--device", "cpu"], capsys)
    assert code == 1
    # the script's own traceback, starting at the script (not at the runner)
    assert "Traceback (most recent call last)" in err
    assert f'File "{p}", line 8, in <module>' in err and "in explode" in err
    assert "ValueError: boom at step 2" in err
    assert "runpy" not in err and "runner.py" not in err
    assert "partial trace" in err
    _, _, meta = _load(tmp_path / "o" / "trace")
    assert meta["complete"] is False
    assert meta["error"] == "ValueError: boom at step 2"
    assert meta["cpu_ops"] > 0


def test_sys_exit_zero_is_normal_and_nonzero_is_failure(tmp_path, capsys):
    ok = _script(tmp_path, "ok.py", """
        import sys, torch
        torch.ones(4).relu()
        sys.exit(0)
        raise RuntimeError("not reached")
    """)
    code, out, err = _cli(["profile", str(ok), "--out", str(tmp_path / "a"), "--device", "cpu"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "a" / "trace" / "meta.json").read_text())["complete"] is True

    bad = _script(tmp_path, "bad.py", """
        import sys, torch
        torch.ones(4).relu()
        sys.exit(3)
    """)
    code, out, err = _cli(["profile", str(bad), "--out", str(tmp_path / "b"), "--device", "cpu"], capsys)
    assert code == 3 and "SystemExit: 3" in err  # the script's own code, as `python bad.py` gives
    meta = json.loads((tmp_path / "b" / "trace" / "meta.json").read_text())
    assert meta["complete"] is False and meta["error"] == "SystemExit: 3"


def test_no_tensor_work(tmp_path, capsys):
    p = _script(tmp_path, "idle.py", "print('just text')\n")
    code, out, err = _cli(["profile", str(p), "--out", str(tmp_path / "o"), "--device", "cpu"], capsys)
    assert code == 4
    assert "just text" in out
    assert "no tensor work" in err and len(err.strip().splitlines()) == 1
    _, _, meta = _load(tmp_path / "o" / "trace")
    assert meta["complete"] is True and meta["steady_state"]["source"] == "whole"


# ------------------------------------------------------------------------------------------------
# --region
# ------------------------------------------------------------------------------------------------
def test_region_from_advisor_region(tmp_path):
    p = _script(tmp_path, "steps.py", """
        import torch, advisor
        lin = torch.nn.Linear(16, 16)
        with torch.inference_mode():
            lin(torch.randn(2, 16))             # outside any region
            for _ in range(4):
                with advisor.region("step"):
                    lin(torch.randn(2, 16)).relu()
    """)
    meta = profile_script(p, [], out_dir=tmp_path / "o", device="cpu", region="step", console=_quiet())
    st = meta["steady_state"]
    assert st["source"] == "region" and st["name"] == "step"
    assert st["found"] == 4 and st["warmup_dropped"] == 1 and len(st["iterations"]) == 3
    kineto, _, _ = _load(tmp_path / "o" / "trace")
    regions = sorted((e["ts"], e["ts"] + e["dur"]) for e in kineto["traceEvents"]
                     if e.get("cat") == "user_annotation" and e["name"] == "advisor.region::step")
    assert len(regions) == 4
    assert all(abs(r[0] - w[0]) < 0.01 and abs(r[1] - w[1]) < 0.01 for r, w in zip(regions[1:], st["iterations"]))
    # without --region, the outermost module is used instead (5 calls of Linear, 1 dropped)
    meta = profile_script(p, [], out_dir=tmp_path / "o2", device="cpu", console=_quiet())
    assert meta["steady_state"]["source"] == "module" and meta["steady_state"]["found"] == 5


def test_unknown_region_falls_back_with_warning(tmp_path):
    p = _script(tmp_path, "plain.py", """
        import torch
        m = torch.nn.Linear(4, 4)
        for _ in range(2):
            m(torch.randn(1, 4))
    """)
    console = _quiet()
    meta = profile_script(p, [], out_dir=tmp_path / "o", device="cpu", region="nope", console=console)
    st = meta["steady_state"]
    assert st["source"] == "module" and st["requested_region"] == "nope"
    assert "no region named 'nope'" in console.file.getvalue()


def _torch_nvtx_works() -> bool:
    try:
        torch.cuda.nvtx.range_push("probe")
        torch.cuda.nvtx.range_pop()
        return True
    except Exception:
        return False


@pytest.mark.skipif(not _torch_nvtx_works(), reason="torch.cuda.nvtx needs a CUDA build of torch")
def test_region_from_torch_cuda_nvtx(tmp_path):
    p = _script(tmp_path, "tnvtx.py", """
        import torch
        lin = torch.nn.Linear(8, 8)
        for _ in range(3):
            torch.cuda.nvtx.range_push("iter")
            lin(torch.randn(2, 8))
            torch.cuda.nvtx.range_pop()
        with torch.cuda.nvtx.range("iter"):
            lin(torch.randn(2, 8))
    """)
    meta = profile_script(p, [], out_dir=tmp_path / "o", device="cpu", region="iter", console=_quiet())
    st = meta["steady_state"]
    assert st["source"] == "region" and st["found"] == 4 and len(st["iterations"]) == 3


def test_region_from_nvtx_package(tmp_path):
    pytest.importorskip("nvtx")
    p = _script(tmp_path, "pnvtx.py", """
        import nvtx, torch
        lin = torch.nn.Linear(8, 8)

        @nvtx.annotate("fwd")
        def fwd(x):
            return lin(x)

        for _ in range(3):
            nvtx.push_range("iter")
            with nvtx.annotate("inner"):
                fwd(torch.randn(2, 8))
            nvtx.pop_range()
    """)
    for region, found in (("iter", 3), ("inner", 3), ("fwd", 3)):
        meta = profile_script(p, [], out_dir=tmp_path / region, device="cpu", region=region, console=_quiet())
        st = meta["steady_state"]
        assert (st["source"], st["name"], st["found"], len(st["iterations"])) == ("region", region, found, 2)
    # the wrappers are gone after profiling; the package's own functions are back
    import nvtx

    from advisor.collect.nvtx_ranges import _ORIG

    assert nvtx.push_range is _ORIG["nvtx.push_range"] and nvtx.annotate is _ORIG["nvtx.annotate"]


# ------------------------------------------------------------------------------------------------
# steady-state selection on synthetic events
# ------------------------------------------------------------------------------------------------
def _py(pid, parent, name, ts, dur):
    return {"ph": "X", "cat": "python_function", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1,
            "args": {"Python id": pid, "Python parent id": parent}}


def test_root_module_is_most_called_outermost():
    ev = [_py(1, None, "script.py(1): <module>", 0, 1000)]
    pid = 10
    for i in range(3):  # Model_0 called 3 times, each calling Linear_0 twice (nested: not roots)
        t = 100 + i * 200
        ev.append(_py(pid, 1, "nn.Module: Model_0", t, 150))
        ev.append(_py(pid + 1, pid, "model.py(5): forward", t + 1, 140))
        ev.append(_py(pid + 2, pid + 1, "nn.Module: Linear_0", t + 2, 50))
        ev.append(_py(pid + 3, pid + 1, "nn.Module: Linear_0", t + 60, 50))
        pid += 10
    ev.append(_py(pid, 1, "nn.Module: Loss_0", 800, 10))  # a root called once
    st = steady.steady_state(ev)
    assert st["source"] == "module" and st["name"] == "Model_0"
    assert st["found"] == 3 and st["warmup_dropped"] == 1
    assert st["iterations"] == [[300, 450], [500, 650]]


def test_root_modules_called_as_often_are_told_apart_by_their_ops_not_their_time():
    """A model and its loss module, each called once a step: the model's calls ran more ops, and stay the iteration
    when a loaded machine makes the loss's calls take longer (by time, the iteration was the loss)."""
    def op(ts):
        return {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": ts, "dur": 1, "pid": 1, "tid": 1}

    ev, pid = [_py(1, None, "script.py(1): <module>", 0, 10_000)], 10
    for i in range(3):
        t = 100 + i * 2000
        ev += [_py(pid, 1, "nn.Module: Model_0", t, 100), *(op(t + 10 * k) for k in range(1, 6)),
               _py(pid + 1, 1, "nn.Module: Loss_0", t + 200, 1500), op(t + 300)]
        pid += 10
    st = steady.steady_state(ev)
    assert (st["name"], st["found"], st["iterations"]) == ("Model_0", 3, [[2100, 2200], [4100, 4200]])


def test_region_nesting_single_iteration_and_whole_fallback():
    def ua(name, ts, dur):
        return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1, "args": {}}

    ev = [ua("advisor.region::step", 0, 100), ua("advisor.region::step", 10, 20),  # nested: folded
          ua("advisor.region::step", 200, 100),
          {"ph": "X", "cat": "gpu_user_annotation", "name": "advisor.region::step", "ts": 5, "dur": 1}]
    st = steady.steady_state(ev, region="step")
    assert st["found"] == 2 and st["iterations"] == [[200, 300]]
    st = steady.steady_state(ev[:1], region="step")
    assert st["found"] == 1 and st["warmup_dropped"] == 0 and st["iterations"] == [[0, 100]]
    cpu = [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 5, "dur": 3, "pid": 1, "tid": 1},
           {"ph": "X", "cat": "cpu_op", "name": "aten::mul", "ts": 50, "dur": 10, "pid": 1, "tid": 1}]
    st = steady.steady_state(cpu)
    assert st == {"source": "whole", "name": None, "iterations": [[5, 60]], "calls": [1], "warmup_dropped": 0,
                  "found": 1}


def test_run_command_profiles_the_demo_then_analyses(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "advisor", "run", "--out", str(tmp_path), "--device", "cpu"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    meta = json.loads((tmp_path / "trace" / "meta.json").read_text())
    assert meta["script"].endswith("demo_workload.py") and meta["complete"] is True
    assert meta["steady_state"]["source"] == "module" and meta["steady_state"]["name"] == "DemoModel_0"
    try:
        import advisor.analysis.api  # noqa: F401
    except Exception:
        assert proc.returncode != 0 and "analysis stage cannot be loaded" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]


def test_profiler_chatter_dropped_other_native_stderr_kept(capfd):
    """fd 2 is filtered, not closed: a line the user's native code writes meanwhile still arrives."""
    from advisor.collect.native_log import without_profiler_chatter

    with without_profiler_chatter():
        os.write(2, b"[W1123 19:46:43.654 execution_trace_observer.cpp:989] Enabling Execution Trace Observer\n")
        os.write(2, b"USDT:2026-11-23 19:46:43 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a warning of the user's own\n")
    assert capfd.readouterr().err == "a warning of the user's own\n"
