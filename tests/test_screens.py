"""What a new user sees in the first hour with their own model ("the first hour" issues): the screens the
commands print, their errors on bad input, and what they leave behind. Through the entry point (a
subprocess of `python -m advisor`) or the public API, on real models."""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from tests.test_cli import ROOT, SAMPLE, cli

TINY = """
import torch

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x):
        return torch.relu(self.fc(x) * 2.0 + 1.0)

model, x = Block(), torch.randn(8, 64)
with torch.no_grad():
    for _ in range(4):
        model(x)
"""


# ------------------------------------------------------------------ C: an output that cannot be written
@pytest.fixture(params=["read-only folder", "a file in the way"])
def unwritable(request, tmp_path):
    """An --out folder no command can write into."""
    if request.param == "read-only folder":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(stat.S_IRUSR | stat.S_IXUSR)
        yield d
        d.chmod(stat.S_IRWXU)
    else:
        (tmp_path / "file").write_text("")
        yield tmp_path / "file" / "out"


@pytest.fixture(scope="module")
def tiny_script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("script") / "tiny.py"
    path.write_text(TINY)
    return path


@pytest.mark.parametrize("command", ["analyze", "generate", "run", "profile", "bundle"])
def test_an_unwritable_output_is_one_line_and_exit_2(command, unwritable, tiny_script, tmp_path):
    plan = tmp_path / "plan"  # what `bundle` packs: an OUT of `apply`
    plan.mkdir()
    for name in ("analysis", "apply"):
        (plan / f"{name}.json").write_text((ROOT / "tests" / "fixtures" / f"{name}_example.json").read_text())
    args = {"analyze": ["analyze", SAMPLE / "trace", "--out", unwritable],
            "generate": ["generate", SAMPLE / "trace", "--out", unwritable, "--top", "1"],
            "run": ["run", tiny_script, "--out", unwritable, "--device", "cpu"],
            "profile": ["profile", tiny_script, "--out", unwritable, "--device", "cpu"],
            "bundle": ["bundle", plan, "-o", unwritable / "plan.fab"]}[command]
    r = cli(*args)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot write {unwritable}"), r.stderr


# ------------------------------------------------------------------ D: what the commands leave behind
OPTIMIZE = """\
import json, os, sys, tempfile, torch, advisor
os.umask(0o022)
model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU())
report = advisor.optimize(model, (torch.randn(4, 32),), top=1, reuse=False)
out = report.out_dir
print(json.dumps({"repr": repr(report), "str": str(report), "out": str(out),
                  "in_temp": str(out).startswith(tempfile.gettempdir()),
                  "modes": {str(p.relative_to(out)): oct(p.stat().st_mode & 0o777) for p in out.rglob("*") if p.is_file()},
                  "apply": (out / "apply.json").is_file()}))
"""


def test_optimize_without_out_leaves_nothing_in_temp_and_writes_normal_files(tmp_path):
    import json
    import subprocess

    temp = tmp_path / "tmp"
    temp.mkdir()
    script = tmp_path / "user.py"
    script.write_text(OPTIMIZE)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(temp)})
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["in_temp"] and seen["apply"]  # while the process runs, the report's paths are there
    assert "kernels/" in " ".join(seen["modes"]) and "analysis.json" in seen["modes"]
    assert set(seen["modes"].values()) == {"0o644"}, seen["modes"]  # as report.html: the umask, not mkstemp's 0600
    assert len(seen["repr"]) < 200 and seen["repr"].startswith("<OptimizeReport ") and seen["out"] in seen["repr"]
    assert seen["str"].startswith("fusion-advisor: ") and len(seen["str"].splitlines()) > 1
    assert not [p.name for p in temp.iterdir() if p.name.startswith("fusion-advisor-")]


def test_cli_outputs_follow_the_umask(tmp_path):
    out = tmp_path / "out"
    r = cli("generate", SAMPLE / "trace", "--out", out, "--top", "1")
    assert r.returncode == 0, r.stderr
    modes = {str(p.relative_to(out)): oct(p.stat().st_mode & 0o777) for p in out.rglob("*") if p.is_file()}
    assert {"analysis.json", "apply.json", "report.html"} <= set(modes) and len(set(modes.values())) == 1, modes


def test_the_next_step_after_the_demo_names_no_installed_file(tmp_path):
    out = tmp_path / "out"
    r = cli("run", "--out", out, "--", "--iters", "2")
    assert r.returncode == 0, r.stderr
    # one count per iteration on the screen: the report's, not the profiler's nested op events above it
    assert "Per iteration" in r.stdout and "per steady iteration" not in r.stdout, r.stdout
    step = next(line for line in r.stdout.splitlines() if "fusion-advisor apply" in line)
    assert "demo_workload" not in step and ".py" not in step, step
    assert f"fusion-advisor apply --out {out}" in step


# ------------------------------------------------------------------ A, B: the demo applied, at 80 columns
@pytest.fixture(scope="module")
def demo_applied(tmp_path_factory):
    """`fusion-advisor apply` on the bundled demo, as a pipe gets it (80 columns): (OUT, the process)."""
    out = tmp_path_factory.mktemp("demo") / "out"
    return out, cli("apply", "--out", out, env={"COLUMNS": "80"})


def test_apply_ends_with_the_final_verdict_in_one_line(demo_applied):
    import json

    out, r = demo_applied
    assert r.returncode == 0, r.stderr
    assert "Warning" not in r.stdout + r.stderr, r.stderr  # numpy's from the interpreter (log of 0)
    lines = r.stdout.strip().splitlines()
    assert lines[-1].startswith("Report: ")
    verdict = lines[-2]
    checks = json.loads((out / "apply.json").read_text())["checks"]
    assert checks and checks[-1]["ok"], checks
    assert "MISMATCH" not in r.stdout, r.stdout  # the final model matches: no line says otherwise
    assert verdict.startswith("check DemoModel: patched vs unpatched outputs match"), verdict
    dropped = [why for c in checks for why in (c.get("dropped") or {}).values()]
    if dropped:  # what was dropped and why, on that line
        assert " was dropped: " in verdict and dropped[0] in verdict, verdict


def test_the_report_fits_80_columns_and_says_each_thing_once(demo_applied):
    import re

    import advisor

    out, r = demo_applied
    r = cli("report", out, env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    screen = r.stdout
    commands = [line for line in screen.splitlines() if line.startswith(("  fusion-advisor ", "Report: "))]
    assert f"  fusion-advisor apply --out {out}" in commands, screen  # one line, to paste: outside any box
    assert all(len(line) <= 80 for line in screen.splitlines() if line not in commands), screen
    for label in ("Measured", "✓ patched", "– not patched"):  # columns and labels whole, not "Measur", "✓ val"
        assert label in screen, screen
    text, html = (out / "report.txt").read_text(), (out / "report.html").read_text()
    for shown in (screen, text, html):
        assert "Launches" not in shown  # a CPU trace launched no kernel
        assert "not patched: not patched" not in shown and "not patched: unpatched" not in shown
    # the same figure in the same unit as the report: not "22650.4 µs"
    assert not re.search(r"\d{4,}(\.\d+)? µs", advisor.analyze(out).summary())
