"""The model is captured while its kernels compile (`advisor/workflows/early_capture.py`, issue 17).

Real HF Llama from a tiny config, real kernels generated and validated in Triton's interpreter, real dynamo
captures: `optimize` captures the patched model (dynamo, AOTAutograd, the rewrite) during generation, with
no kernel loaded or launched before generation has ended, and keeps those captures when every kernel
validated; a kernel that fails validation sends the model back to being patched and captured with what did.
"""
from __future__ import annotations

import copy
import dataclasses
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_users_models import batch, llama, logits  # noqa: E402  (tests/ is not a package)

import advisor  # noqa: E402
from advisor.patching import PatternSpec, capture, timing  # noqa: E402
from advisor.workflows import early_capture, generate  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def watched(monkeypatch):
    """Records what happened during `optimize`: when generation ended, which kernel modules were loaded before
    and after that, how many graphs dynamo handed the backend by the end of the early capture, and whether
    the early captures were kept. Generation starts only once the early capture has ended (the H100's order:
    its kernels take longer than the capture), so no kernel module exists while the model is captured."""
    seen = {"generated": False, "loads": [], "captures_after_early": None, "kept": None}
    kernel_specs, captured, same, load = (early_capture.kernel_specs, early_capture._captured, early_capture._same,
                                          capture.load_launcher)

    captured_event = threading.Event()

    def generating(*a, **k):  # generation starts once the model is captured: no module exists during the capture
        assert captured_event.wait(timeout=300)
        out = kernel_specs(*a, **k)
        seen["generated"] = True
        return out

    def capturing(*a, **k):
        try:
            out = captured(*a, **k)
        finally:
            captured_event.set()
        seen["captures_after_early"] = timing.SECONDS["captures"]
        return out

    def compared(*a):
        seen["kept"] = same(*a)
        return seen["kept"]

    def loading(path):
        seen["loads"].append((Path(path).name, seen["generated"]))
        return load(path)

    monkeypatch.setattr(early_capture, "kernel_specs", generating)
    monkeypatch.setattr(early_capture, "_captured", capturing)
    monkeypatch.setattr(early_capture, "_same", compared)
    monkeypatch.setattr(capture, "load_launcher", loading)
    return seen


def _sites(report) -> dict:
    return {p["candidate"]: p["sites"] for p in report.applied}


def test_the_model_is_captured_while_its_kernels_compile_and_those_captures_are_kept(tmp_path, watched, monkeypatch):
    model = llama(layers=2)
    untouched, serial = copy.deepcopy(model), copy.deepcopy(model)
    report = advisor.optimize(model, batch(), out=tmp_path / "early", reuse=False, interpret=True)

    assert watched["kept"] is True, "every kernel validated: the generation ended with the specs captured against"
    assert report.phases_s.get("capture", 0) > 0 and "patch" not in report.phases_s
    assert timing.SECONDS["captures"] == watched["captures_after_early"], "no capture after the early one"
    assert watched["loads"], "the kernels were launched by the check"
    assert all(done for _, done in watched["loads"]), f"a kernel module was loaded before it validated: {watched}"
    assert report.applied and all(p["sites"] >= 1 for p in report.applied)
    torch.testing.assert_close(logits(model, batch()), logits(untouched, batch()), rtol=1e-4, atol=1e-4)

    # The same patterns and sites as patched after generation, one after the other (as before)
    monkeypatch.setenv(early_capture.ENV, "0")
    before = timing.SECONDS["captures"]
    again = advisor.optimize(serial, batch(), out=tmp_path / "serial", reuse=False, interpret=True)
    assert "capture" not in again.phases_s and timing.SECONDS["captures"] > before
    assert _sites(again) == _sites(report)
    torch.testing.assert_close(logits(serial, batch()), logits(model, batch()), rtol=0, atol=0)


def test_a_kernel_that_fails_validation_sends_the_model_back_to_be_captured_without_it(tmp_path, watched,
                                                                                        monkeypatch):
    job = generate._job
    failed = []

    def failing_first(c, out_dir):  # the first kernel of the run fails to validate (jobs run in this process)
        entry = job(c, out_dir)
        if not failed and entry.validated:
            failed.append(c.id)
            entry = dataclasses.replace(entry, validated=False, reason="made to fail by the test")
        return entry

    monkeypatch.setattr(generate, "_job", failing_first)
    model = llama(layers=2)
    untouched = copy.deepcopy(model)
    report = advisor.optimize(model, batch(), out=tmp_path / "out", reuse=False, interpret=True)

    assert failed and watched["kept"] is False
    assert timing.SECONDS["captures"] > watched["captures_after_early"], "captured again with the validated kernels"
    assert failed[0] not in _sites(report) and report.applied, report.patterns
    assert failed[0] not in {s.candidate for s in report.handle.plan.patterns}
    torch.testing.assert_close(logits(model, batch()), logits(untouched, batch()), rtol=1e-4, atol=1e-4)


def test_a_pending_kernel_is_loaded_at_its_first_launch(tmp_path):
    path = tmp_path / "k.py"
    launcher = capture.PendingLauncher(str(path))
    # written after the capture, before the first launch
    path.write_text("DIFFERENTIABLE = True\n\ndef run(x):\n    return x + 1\n")
    assert launcher(1) == 2
    spec = PatternSpec("c1", "p", "t", {"inputs": [], "nodes": []}, kernel_file=str(path))
    with capture.pending_kernels():
        assert capture.kernels_pending()
        assert capture.differentiable(spec) is False  # not read from a module that may still change
    assert not capture.kernels_pending() and capture.differentiable(spec) is True


def test_tritons_set_up_is_done_in_a_thread_while_the_model_is_captured(monkeypatch):
    """Triton hashes its sources, and makes its CUDA driver (gcc builds the driver's utilities into an empty
    cache), the first time a process launches or compiles a kernel: `patch`, `optimize` and each compile
    worker start both in a thread, and a recording's first launches wait for it rather than do it beside it."""
    from triton.runtime.cache import triton_key as tritons_key
    from triton.runtime.driver import driver

    from advisor.patching import triton_setup

    class Driver:  # this CPU has no CUDA driver: one that says when it is asked for the device
        asked = threading.Event()

        def get_current_device(self):
            time.sleep(0.2)  # `wait` must wait for this too
            self.asked.set()
            return 0

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton_setup, "_THREAD", [])
    monkeypatch.setattr(driver, "_active", Driver())
    triton_setup.wait()  # none started: returns at once
    tritons_key.cache_clear()
    triton_setup.start()
    triton_setup.start()  # once a process
    assert len(triton_setup._THREAD) == 1 and triton_setup._THREAD[0].name == "fusion-advisor-triton-setup"
    triton_setup.wait(timeout=120)
    assert not triton_setup._THREAD[0].is_alive() and tritons_key.cache_info().currsize == 1
    assert Driver.asked.is_set()


def test_a_generation_that_fails_leaves_the_model_unpatched(tmp_path, monkeypatch):
    """The model is patched (for the early capture) before its kernels exist: a generation that raises must not
    leave it patched with kernels that never validated."""
    from advisor.patching import patched_modules

    def broken(*a, **k):
        raise RuntimeError("generation broke")

    monkeypatch.setattr(early_capture, "kernel_specs", broken)
    model = llama(layers=2)
    with pytest.raises(RuntimeError, match="generation broke"):
        advisor.optimize(model, batch(), out=tmp_path / "out", reuse=False, interpret=True)
    assert not list(patched_modules(model))
