"""`optimize(..., isolate=True)` (issue 47: "a crash in any model's own code path during optimize leaves the model
unpatched and working, with the reason stored"): the first optimize runs in a probe process, and where that
process dies the model is left as it was and the report and apply.json say why."""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch

import advisor
from advisor.patching import patched_modules
from advisor.workflows import probe

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class CrashesInTheProbe(torch.nn.Module):
    """A block whose forward crashes the interpreter (SIGSEGV, as a native fast path or C extension may) in the
    probe process only: in the user's process it runs as usual."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)
        self.proj = torch.nn.Linear(32, 32)

    def forward(self, x):
        if probe.in_probe():
            os.kill(os.getpid(), signal.SIGSEGV)
        return self.proj(torch.nn.functional.gelu(self.norm(x + 1.0)))


class Survives(CrashesInTheProbe):
    def forward(self, x):
        return self.proj(torch.nn.functional.gelu(self.norm(x + 1.0)))


def test_a_probe_that_survives_hands_its_plan_to_the_users_process(tmp_path):
    """The probe's optimize stores its plan; this process's optimize then reuses it (no second profile) and patches."""
    torch.manual_seed(0)
    model = Survives().eval()
    report = advisor.optimize(model, (torch.randn(4, 32),), out=tmp_path, interpret=True, isolate=True)
    stored = json.loads((tmp_path / "apply.json").read_text())
    assert report.isolation.startswith("isolated: the first capture ran in a probe process"), stored["isolation"]
    assert stored["isolation"]["returncode"] == 0 and "raised" not in stored["isolation"]["stderr_tail"]
    assert stored["plan_reused"] and report.applied and report.runs["fused_launches_per_call"] > 0, str(report)


def test_a_crash_in_the_probe_leaves_the_model_unpatched_and_working(tmp_path):
    torch.manual_seed(0)
    model = CrashesInTheProbe().eval()
    x = torch.randn(4, 32)
    with torch.no_grad():
        before = model(x)
    report = advisor.optimize(model, (x,), out=tmp_path, reuse=False, interpret=True, isolate=True)
    assert "crashed a probe process (SIGSEGV)" in report.isolation and "left unpatched" in report.isolation
    assert "SIGSEGV" in str(report) and not report.applied
    stored = json.loads((tmp_path / "apply.json").read_text())
    assert stored["isolation"]["crashed"] and stored["isolation"]["signal"] == "SIGSEGV", stored["isolation"]
    assert stored["patterns"] == [] and "SIGSEGV" in stored["selection"]["decision"]
    assert not list(patched_modules(model))
    with torch.no_grad():
        assert torch.equal(model(x), before)


def test_a_model_that_cannot_be_pickled_is_optimised_in_process_with_a_note(tmp_path, monkeypatch):
    """No probe process for what cannot be handed over: said so, and optimize runs here as without isolation."""
    torch.manual_seed(0)
    model = CrashesInTheProbe().eval()
    model.unpicklable = lambda: None  # (a lambda among the attributes: pickle refuses it)
    ran = []
    monkeypatch.setattr(probe.subprocess, "run", lambda *a, **k: ran.append(a))
    report = advisor.optimize(model, (torch.randn(4, 32),), out=tmp_path, reuse=False, replacement="program",
                              select=False, isolate=True)
    assert not ran
    assert report.isolation.startswith("not isolated: the model or its inputs cannot be pickled"), report.isolation
    assert json.loads((tmp_path / "apply.json").read_text())["isolation"]["crashed"] is False


def test_how_a_probe_ended_in_words():
    assert not probe.outcome(0, "").crashed
    assert probe.outcome(-signal.SIGABRT, "").signal == "SIGABRT"
    assert "exit status 3" in probe.outcome(3, "").decision and probe.outcome(3, "").crashed
    loaded = probe.outcome(probe.UNLOADABLE, "AttributeError: Can't get attribute 'Model' on <module '__main__'>")
    assert not loaded.crashed and "could not load the model" in loaded.decision


def test_isolation_is_off_unless_asked(monkeypatch):
    monkeypatch.delenv(probe.ENV, raising=False)
    assert not probe.wanted(None) and probe.wanted(True)
    monkeypatch.setenv(probe.ENV, "1")
    assert probe.wanted(None) and not probe.wanted(False)
