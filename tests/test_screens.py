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
