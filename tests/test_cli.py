"""The command line as a new user meets it (issue 20), always through a subprocess: exit codes, one-line
errors, what is written where. `python -m advisor` runs `advisor.cli:main`, the entry point's target."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_traces" / "cpu" / "mlp_block"


def cli(*args, cwd=None, env=None, block_click=False, timeout=300) -> subprocess.CompletedProcess:
    """Run `fusion-advisor ARGS`; with block_click the `click` package cannot be imported, as in a venv made
    by the quick start alone (typer >= 0.24 brings its own copy of click, not the package)."""
    boot = "import sys\n" + ("sys.modules['click'] = None\n" if block_click else "")
    boot += "from advisor.cli import main\nmain()\n"
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120", **(env or {})}
    return subprocess.run([sys.executable, "-c", boot, *map(str, args)], cwd=cwd or ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def test_entry_point_is_main():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"fusion-advisor": "advisor.cli:main"}


# ------------------------------------------------------------------------------------------ item 1
USAGE_ERRORS = [
    (["--top", "abc", "analyze", "x"], "No such option: --top"),
    (["analyze", "--top", "abc", "x"], "'--top'"),
    (["analyse", "x"], "Did you mean 'analyze'"),
    (["--bogus"], "No such option: --bogus"),
    (["analyze"], "Missing argument"),
]


@pytest.mark.parametrize("args,expected", USAGE_ERRORS, ids=lambda a: " ".join(a) if isinstance(a, list) else None)
def test_usage_error_is_one_line_and_exit_2(args, expected):
    r = cli(*args, block_click=True)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], r.stderr
    assert "--help" in lines[0]  # where to look next


def test_no_arguments_prints_help():
    r = cli(block_click=True)
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr
    assert "analyze" in r.stdout and "profile" in r.stdout


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_flags(flag):
    r = cli(flag, block_click=True)
    assert r.returncode == 0 and "Usage" in r.stdout and "--version" in r.stdout
    r = cli("analyze", flag, block_click=True)
    assert r.returncode == 0 and "TRACE" in r.stdout


def test_version():
    from advisor import __version__

    r = cli("--version", block_click=True)
    assert r.returncode == 0 and r.stdout.startswith(f"fusion-advisor {__version__} (torch ")


# ------------------------------------------------------------------------------------------ item 2
TINY = """\
import torch

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.ln = torch.nn.LayerNorm(64)

    def forward(self, x):
        return self.ln(torch.nn.functional.gelu(self.lin(x)) + x)

model, x = Block(), torch.randn(8, 64)
with torch.no_grad():
    for _ in range(4):
        model(x)
"""


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """`fusion-advisor run` on a small script, once for the module: (OUT, the completed process)."""
    d = tmp_path_factory.mktemp("run")
    (d / "tiny.py").write_text(TINY)
    return d / "out", cli("run", d / "tiny.py", "--out", d / "out", "--device", "cpu")


def _last_line(r) -> str:
    return r.stdout.strip().splitlines()[-1]


def test_run_writes_the_report_and_ends_with_its_path(tiny_run):
    out, r = tiny_run
    assert r.returncode == 0, r.stderr
    for name in ("analysis.json", "report.html", "report.txt", "trace/kineto.json.gz"):
        assert (out / name).is_file(), name
    assert not (out / "trace" / "analysis.json").exists()
    assert _last_line(r).startswith(f"Report: {out / 'report.html'}")


@pytest.mark.parametrize("where", ["OUT", "OUT/trace"])
@pytest.mark.parametrize("command", ["report", "analyze"])
def test_commands_take_out_or_its_trace_dir(tiny_run, command, where):
    out, _ = tiny_run
    (out / "report.html").unlink()
    r = cli(command, out if where == "OUT" else out / "trace")
    assert r.returncode == 0, r.stderr
    assert (out / "report.html").is_file() and not (out / "trace" / "analysis.json").exists()
    assert _last_line(r).startswith(f"Report: {out / 'report.html'}")


@pytest.fixture
def sample_run(tmp_path):
    """A run directory holding a copy of a committed CPU trace (nothing else yet)."""
    import shutil

    shutil.copytree(SAMPLE / "trace", tmp_path / "trace")
    return tmp_path


def test_generate_takes_the_trace_dir(sample_run):
    r = cli("generate", sample_run / "trace", "--top", "1")
    assert r.returncode == 0, r.stderr
    assert {p.name for p in sample_run.iterdir()} >= {"analysis.json", "apply.json", "kernels", "report.html"}
    assert _last_line(r).startswith(f"Report: {sample_run / 'report.html'}")


# ------------------------------------------------------------------------------------------ item 3
@pytest.mark.parametrize("command", ["profile", "run"])
def test_the_scripts_exit_code_comes_back(tmp_path, command):
    script = tmp_path / "exits.py"
    script.write_text("import sys, torch\ntorch.ones(4).add(1)\nsys.exit(3)\n")
    r = cli(command, script, "--out", tmp_path / "out", "--device", "cpu")
    assert r.returncode == 3, r.stderr
    assert "SystemExit: 3" in r.stderr and "Traceback" not in r.stderr
    assert (tmp_path / "out" / "trace" / "kineto.json.gz").is_file()


def test_ctrl_c_exits_130_with_the_trace_saved(tmp_path):
    import json

    script = tmp_path / "interrupted.py"  # Ctrl-C arrives while the script works: SIGINT to the process
    script.write_text("import os, signal, torch\ntorch.ones(4).add(1)\nos.kill(os.getpid(), signal.SIGINT)\n"
                      "import time\ntime.sleep(30)\n")
    r = cli("profile", script, "--out", tmp_path / "out", "--device", "cpu")
    assert r.returncode == 130, r.stderr
    assert "interrupted" in r.stdout + r.stderr and "Traceback" not in r.stderr
    trace = tmp_path / "out" / "trace"
    assert (trace / "kineto.json.gz").is_file()
    assert json.loads((trace / "meta.json").read_text())["complete"] is False


# ------------------------------------------------------------------------------------------ item 4
BAD_OPTIONS = [
    (["analyze", "--top", "0", "TRACE"], "'--top'"),
    (["run", "--top", "-1", "SCRIPT"], "'--top'"),
    (["apply", "--iters", "-5", "SCRIPT"], "'--iters'"),
    (["apply", "--granularity", "foo", "SCRIPT"], "'layer', 'pattern', 'occurrence', 'root'"),
    (["apply", "--replacement", "foo", "SCRIPT"], "'kernel', 'program', 'subgraph'"),
    (["profile", "--device", "tpu", "SCRIPT"], "'auto', 'cuda', 'cpu'"),
]


@pytest.mark.parametrize("args,expected", BAD_OPTIONS, ids=lambda a: " ".join(a[:3]) if isinstance(a, list) else None)
def test_bad_options_fail_before_any_work(tmp_path, args, expected):
    script = tmp_path / "work.py"
    script.write_text(TINY)
    args = [str(script) if a == "SCRIPT" else str(SAMPLE) if a == "TRACE" else a for a in args]
    r = cli(*args, "--out", tmp_path / "out", cwd=tmp_path)
    assert r.returncode == 2 and expected in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work.py"]  # nothing profiled, nothing written


def test_choices_in_help():
    r = cli("apply", "--help")
    assert "auto|cuda|cpu" in r.stdout and "layer|pattern|occurrence|root" in r.stdout
    assert "kernel|program|subgraph" in r.stdout


def test_top_has_one_default_everywhere():
    import typer

    from advisor.cli import app

    commands = typer.main.get_command(app).commands
    tops = {name: next(p.default for p in c.params if p.name == "top") for name, c in commands.items()
            if any(p.name == "top" for p in c.params)}
    assert set(tops) == {"run", "analyze", "generate", "report", "apply"} and len(set(tops.values())) == 1, tops


# ------------------------------------------------------------------------------------------ item 5
CHATTER = ("Execution Trace Observer", "profiler_start", "profiler_stop", "USDT")


def test_profile_prints_no_torch_cpp_log_lines(tiny_run):
    _, r = tiny_run
    assert r.returncode == 0
    assert not [w for w in CHATTER if w in r.stdout + r.stderr], r.stderr


def test_optimize_prints_no_torch_cpp_log_lines(tmp_path):
    """In the user's own process, where torch was imported long before (TORCH_CPP_LOG_LEVEL is read then)."""
    script = tmp_path / "user.py"
    script.write_text("import sys, torch, advisor\n"
                      "model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU())\n"
                      "advisor.optimize(model, (torch.randn(4, 32),), top=1, out=sys.argv[1])\nprint('done')\n")
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    assert not [w for w in CHATTER if w in r.stdout + r.stderr], r.stderr


# ------------------------------------------------------------------------------------------ item 6
LOOP = """\
import torch
model, x = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()), torch.randn(8, 64)
for _ in range(12):
    model(x)
"""


@pytest.mark.parametrize("option,schedule,found", [
    (["--calls", "3"], {"wait": 0, "warmup": 1, "active": 2}, 3),
    (["--schedule", "5,2,3"], {"wait": 5, "warmup": 2, "active": 3}, 5),
])
def test_calls_and_schedule_bound_what_is_profiled(tmp_path, option, schedule, found):
    import json

    (tmp_path / "loop.py").write_text(LOOP)
    r = cli("profile", tmp_path / "loop.py", "--out", tmp_path / "out", "--device", "cpu", *option)
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "out" / "trace" / "meta.json").read_text())
    assert meta["schedule"] == schedule
    steady = meta["steady_state"]
    assert steady["found"] == found and steady["warmup_dropped"] == schedule["warmup"]
    assert len(steady["iterations"]) == schedule["active"]


@pytest.mark.parametrize("option,expected", [
    (["--schedule", "1,2"], "WAIT,WARMUP,ACTIVE"),
    (["--schedule", "1,1,0"], "ACTIVE must be at least 1"),
    (["--calls", "0"], "'--calls'"),
    (["--calls", "2", "--schedule", "1,1,1"], "not both"),
])
def test_bad_schedule_is_one_line(tmp_path, option, expected):
    (tmp_path / "loop.py").write_text(LOOP)
    r = cli("profile", tmp_path / "loop.py", "--out", tmp_path / "out", *option)
    assert r.returncode == 2 and expected in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ item 10
def test_generate_leaves_no_stale_kernels(sample_run):
    kernels = sample_run / "kernels"
    kernels.mkdir()
    for i in range(3, 10):  # an older run's kernels
        (kernels / f"c{i}_old_pattern.py").write_text("# from an older run\n")
    r = cli("generate", sample_run, "--top", "2")
    assert r.returncode == 0, r.stderr
    import json

    named = {Path(p["kernel_file"]).name for p in json.loads((sample_run / "apply.json").read_text())["patterns"]
             if p.get("kernel_file")}
    assert {p.name for p in kernels.glob("*.py")} == named and len(named) == 2


def test_the_test_session_leaves_no_cache_folder(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "FUSION_ADVISOR_CACHE"}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/test_cli.py::test_entry_point_is_main"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:]
    assert not list(tmp_path.glob("fusion-advisor-test-cache-*"))
