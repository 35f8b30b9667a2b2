"""A patched model called with gradients enabled, as many evaluation scripts call it (no `torch.no_grad()`): without
fused training such calls run the original forward, said once per model with what to do, and counted
(`handle.fallbacks()`); a frozen model (nothing requires a gradient) runs fused, through its no_grad capture; with
`train=True` such calls run the fused kernels and their generated backwards."""
from __future__ import annotations

import warnings

import torch

import advisor
from advisor.patching import rewrite
from advisor.patching.forward import TRAINING_CALL
from test_users_models import batch, launches, llama  # (pytest puts tests/ on sys.path)


def _optimize(tmp_path, train: bool = False):
    model = llama(layers=2)
    report = advisor.optimize(model, batch(), out=tmp_path, reuse=False, interpret=True, train=train)
    return model, report


def _captures(report) -> int:
    return sum(f._backend.captures for f in report.handle.forwards.values() if f._backend is not None)


def _said(calls) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in calls:
            call()
    return [str(w.message) for w in caught if "gradients enabled" in str(w.message)]


def test_calls_with_gradients_run_the_original_forward_said_once_and_counted(tmp_path):
    model, report = _optimize(tmp_path)
    before = launches(model)
    said = _said([lambda: model(**batch())] * 3)
    assert len(said) == 1 and "torch.no_grad()" in said[0] and "train=True" in said[0], said
    assert launches(model) == before  # the original forward ran
    counts = [why.get(TRAINING_CALL, 0) for why in report.handle.fallbacks().values()]
    assert counts and all(n == 3 for n in counts), report.handle.fallbacks()
    assert TRAINING_CALL in str(report)
    with torch.no_grad():
        model(**batch())
    assert launches(model) > before


def test_a_frozen_model_called_with_gradients_enabled_runs_fused_without_capturing_again(tmp_path):
    model, report = _optimize(tmp_path)
    model.requires_grad_(False)
    with torch.no_grad():
        want = model(**batch()).logits  # (captured again: dynamo guards on the parameters' requires_grad)
    before, captures = launches(model), _captures(report)
    assert not _said([lambda: model(**batch())])
    out = model(**batch()).logits
    assert launches(model) > before
    assert _captures(report) == captures  # served by the no_grad capture: no trace, no capture budget spent
    assert torch.equal(out, want) and not out.requires_grad
    assert not report.handle.fallbacks()


def test_with_fused_training_calls_with_gradients_run_fused(tmp_path):
    model, report = _optimize(tmp_path, train=True)
    fused = rewrite.fused_runs()
    assert not _said([lambda: model(**batch()).logits.sum().backward()])
    assert rewrite.fused_runs() > fused
