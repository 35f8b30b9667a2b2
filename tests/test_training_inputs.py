"""`optimize(train=True)` with the inputs a training loop really passes: labels (the loss computed inside the
model), keyword arguments, tuples. The training check calls the model with the caller's inputs as they are
(the caller's labels, never a second value for them); a check that fails leaves the model working, with a
one-line reason and its full error and traceback in apply.json."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from advisor.errors import exception_details, exception_reason
from advisor.patching import autograd as ag
from advisor.workflows import training

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path_factory.getbasetemp() / "kernel-cache"))
    monkeypatch.setattr(ag, "_BACKWARDS", {})


def stand_in_clocks(monkeypatch, fused_ms: float = 8.0):
    """Meaningful clocks (as a GPU's) where fused runs `fused_ms` against 9 ms: each timed state still runs once,
    so the check's calls are real."""
    from advisor.measure.timing import Timing

    def time_configs(call, configs, device, iters=20, rounds=5):
        for make in configs.values():
            with make():
                call()
        ms = {k: fused_ms if k == "fused" else 9.0 for k in configs}
        return {k: Timing(ms[k], 5, "perf_counter", [ms[k]] * 5, 0.0, [ms[k]] * 5) for k in configs}

    monkeypatch.setattr(training.timing, "timing_meaningful", lambda device: True)
    monkeypatch.setattr(training.timing, "time_configs", time_configs)


@pytest.fixture
def timed_training_check(monkeypatch):
    """`optimize`'s training checks (the LM loss's, the training call's) with stand-in clocks, and only they:
    selection keeps its CPU behaviour (nothing timed), the checks run as on a GPU."""
    from advisor.workflows import live_model

    def clocked(check):
        def run(*args, **kwargs):
            with pytest.MonkeyPatch.context() as inside:
                stand_in_clocks(inside)
                return check(*args, **kwargs)
        return run

    monkeypatch.setattr(live_model, "keep_faster_lm_loss", clocked(live_model.keep_faster_lm_loss))
    monkeypatch.setattr(live_model, "keep_faster_training", clocked(live_model.keep_faster_training))


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128, vocab_size=200,
                                        max_position_embeddings=64, use_cache=False))


IDS = torch.randint(0, 200, (2, 8), generator=torch.Generator().manual_seed(0))
FORMS = {"dict-with-labels": lambda: {"input_ids": IDS, "labels": IDS, "use_cache": False},
         "tuple": lambda: (IDS,),
         "kwargs": lambda: {"input_ids": IDS, "attention_mask": torch.ones_like(IDS)}}


@pytest.mark.parametrize("form", list(FORMS))
def test_a_causal_lm_trains_fused_from_the_inputs_a_training_loop_passes(form, tmp_path, timed_training_check):
    """The training check runs on the example as the caller gave it (labels among them: the loss is the model's
    own, from those labels) and keeps fused training; the loop's `model(input_ids=..., labels=...)` then runs
    the fused kernels and gives eager's loss and gradients."""
    import advisor
    from advisor.patching import rewrite

    model = tiny_llama()
    twin = copy.deepcopy(model)
    report = advisor.optimize(model, FORMS[form](), out=tmp_path, reuse=False, interpret=True, train=True)
    assert report.training["kept"] and report.training["lm_loss"]["kept"], report.training
    assert "fused training kept" in report.training["decision"], report.training["decision"]
    stored = json.loads((tmp_path / "apply.json").read_text())["training"]
    assert "traceback" not in stored and "traceback" not in stored["lm_loss"]
    before = rewrite.fused_runs()
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    assert rewrite.fused_runs() > before, "the loop's step ran the fused kernels"
    want = twin(input_ids=IDS, labels=IDS).loss
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-4)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4, msg=name)


class OwnLoss(torch.nn.Module):
    """A model that computes its own loss from labels, HF-style, and records the labels each call got."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.seen = []

    def forward(self, x, labels=None):
        out = self.lin(x)
        self.seen.append(labels)
        loss = None if labels is None else torch.nn.functional.mse_loss(out, labels)
        return type("Output", (), {"loss": loss, "logits": out})()


def test_the_training_call_trains_on_the_callers_labels_however_they_are_passed():
    """Labels the caller passed (by keyword or by position) are the ones the step trains on, never given twice;
    labels the check would add (a causal LM's input_ids) are used only where the caller passed none; the step
    backpropagates the model's own loss."""
    x, mine, added = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    model = OwnLoss()
    for args, kwargs in [((), {"x": x, "labels": mine}), ((x, mine), {}), ((x,), {"labels": mine})]:
        model.seen.clear()
        step = training.training_call(model, args, kwargs, labels=added)
        step()
        assert model.seen and all(torch.equal(seen, mine) for seen in model.seen), (args, kwargs)  # (on a snapshot)
    model.seen.clear()
    training.training_call(model, (x,), {}, labels=added)()
    assert model.seen and all(torch.equal(seen, added) for seen in model.seen)
    model.seen.clear()  # labels only among the caller's inputs (no LM loss added): still the model's own loss
    step = training.training_call(model, (), {"x": x, "labels": mine})
    step()
    assert model.seen and all(torch.equal(seen, mine) for seen in model.seen)
    assert all(p.grad is None for p in model.parameters())  # set to None after the step, as zero_grad does


def test_a_stored_reason_is_one_line_without_the_models_repr():
    """Python names a module called with an argument twice by its whole repr: the reason says what failed in
    one line, the module by its class name; the full text goes with the traceback."""
    model = tiny_llama()
    try:
        model(**{"input_ids": IDS, "labels": IDS}, labels=IDS)
    except TypeError as e:
        error = e
    for reason in (exception_reason(error), exception_reason(error, named=(model,))):
        assert "\n" not in reason and "embed_tokens" not in reason and len(reason) <= 300, reason
        assert reason.startswith("TypeError: LlamaForCausalLM") and "got multiple values for keyword argument " \
            "'labels'" in reason, reason
    assert exception_reason(error, named=(model,)) == \
        "TypeError: LlamaForCausalLM got multiple values for keyword argument 'labels'"
    details = exception_details(error)
    assert "(embed_tokens)" in details["error"] and "Traceback" in details["traceback"]


class FailsToTrain(torch.nn.Module):
    """Runs for inference; a training call raises, naming the model by its (multi-line) repr."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        if torch.is_grad_enabled() and self.training:
            raise RuntimeError(f"{self} cannot train here")
        return torch.nn.functional.gelu(self.norm(self.lin(x)) + x)


def test_a_training_check_that_fails_leaves_the_model_working_and_stores_the_traceback(tmp_path,
                                                                                      timed_training_check):
    import advisor

    model = FailsToTrain().eval()
    x = torch.randn(4, 16)
    report = advisor.optimize(model, (x,), out=tmp_path, reuse=False, interpret=True, train=True)
    decision = report.training["decision"]
    assert not report.training["kept"] and "its comparison failed" in decision, decision
    assert "\n" not in decision and "(norm)" not in decision and "FailsToTrain cannot train here" in decision
    stored = json.loads((tmp_path / "apply.json").read_text())["training"]
    assert stored["decision"] == decision
    assert "(norm): LayerNorm" in stored["error"] and "cannot train here" in stored["traceback"]
    assert "Traceback" in stored["traceback"] and "forward" in stored["traceback"]
    assert not model.training  # left as found, and it still runs
    with torch.no_grad():
        torch.testing.assert_close(model(x), torch.nn.functional.gelu(model.norm(model.lin(x)) + x))


def test_a_failure_outside_the_checks_own_handlers_leaves_training_on_the_original_forwards(tmp_path,
                                                                                           monkeypatch):
    """optimize still hands back the patched model: training runs the original forwards, with the reason and
    the traceback recorded, and a training step gives eager's gradients."""
    import advisor
    from advisor.patching.forward import TRAINING_CALL
    from advisor.workflows import live_model

    def broken(*args, **kwargs):
        raise RuntimeError("the check's own bug")

    monkeypatch.setattr(live_model, "keep_faster_lm_loss", broken)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.GELU())
    twin = copy.deepcopy(model)
    x = torch.randn(4, 16)
    report = advisor.optimize(model, (x,), out=tmp_path, reuse=False, interpret=True, train=True)
    assert report.applied and not report.training["kept"], report.training
    assert "RuntimeError: the check's own bug" in report.training["decision"]
    assert "the check's own bug" in json.loads((tmp_path / "apply.json").read_text())["training"]["traceback"]
    model(x).pow(2).mean().backward()
    twin(x).pow(2).mean().backward()
    assert TRAINING_CALL in str(report.handle.fallbacks()), report.handle.fallbacks()  # the original forward ran
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
