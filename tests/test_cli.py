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
