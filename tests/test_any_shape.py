"""Calls at shapes past the capture budget run Inductor's dynamic-shape compile of the original forward
(`optimize(..., dynamic=True)`, `patching.any_shape`): a real HF Llama from a tiny config, Inductor's C++ backend on
this CPU, our kernels in Triton's interpreter; outputs and greedy tokens compared with an untouched copy."""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

import advisor
from advisor.patching import any_shape
from advisor.patching.forward import EXTRA_CAPTURES, SPENT

transformers = pytest.importorskip("transformers")

# Shapes never profiled, more of them than the budget captures; batch 1 is one of dynamo's own specialisations.
NEW_SHAPES = [(1, 9), (5, 20), (2, 7), (4, 30), (6, 11), (1, 5), (3, 17)]


def _tiny_llama():
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _optimized(tmp_path, dynamic):
    model = _tiny_llama()
    untouched = copy.deepcopy(model)
    report = advisor.optimize(model, {"input_ids": torch.randint(0, 256, (3, 12))}, interpret=True, reuse=False,
                              out=tmp_path, dynamic=dynamic)
    return model, untouched, report


@pytest.fixture(scope="module")
def dynamic_llama(tmp_path_factory):
    return _optimized(tmp_path_factory.mktemp("dynamic"), True)


def test_shapes_past_the_budget_run_inductor_s_dynamic_compile(dynamic_llama):
    model, untouched, report = dynamic_llama
    assert json.loads((report.out_dir / "apply.json").read_text())["dynamic"] is True
    with torch.no_grad():
        for shape in NEW_SHAPES:
            ids = torch.randint(0, 256, shape)
            torch.testing.assert_close(model(input_ids=ids).logits, untouched(input_ids=ids).logits,
                                       rtol=1e-4, atol=1e-4)
    calls = report.handle.any_shape_calls()
    layers = model.config.num_hidden_layers
    # every call past the budget (the first EXTRA_CAPTURES new shapes captured) in every layer
    assert calls and sum(calls.values()) == layers * (len(NEW_SHAPES) - EXTRA_CAPTURES), calls
    assert not any(SPENT in why for f in report.handle.fallbacks().values() for why in f), report.handle.fallbacks()
    # one graph for every batch and length, one more where dynamo specialises a size of 1 (batch 1): no storm
    graphs = report.handle.any_shape_graphs()
    assert set(graphs) == set(calls) and all(1 <= n <= 2 for n in graphs.values()), graphs


def test_inference_mode_calls_take_the_same_compile(dynamic_llama):
    model, untouched, report = dynamic_llama
    with torch.no_grad():
        for shape in NEW_SHAPES[:EXTRA_CAPTURES]:  # the budget spent (already, where the test above ran first)
            model(input_ids=torch.randint(0, 256, shape))
    before = sum(report.handle.any_shape_calls().values())
    ids = torch.randint(0, 256, (4, 30))
    with torch.inference_mode():
        got = model(input_ids=ids).logits
        want = untouched(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert sum(report.handle.any_shape_calls().values()) == before + model.config.num_hidden_layers


def test_generate_through_the_dynamic_compile_gives_the_unpatched_tokens(dynamic_llama):
    """Each decode step is a new shape (one token, the cache grown): past the budget Inductor's compile runs it."""
    model, untouched, report = dynamic_llama
    prompt = torch.randint(1, 256, (3, 12))
    before = sum(report.handle.any_shape_calls().values())
    with torch.no_grad():
        want = untouched.generate(prompt, max_new_tokens=10, do_sample=False)
        got = model.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(got, want)
    assert sum(report.handle.any_shape_calls().values()) > before


def test_without_dynamic_past_the_budget_runs_the_original_ops(tmp_path):
    model, untouched, report = _optimized(tmp_path, False)
    assert json.loads((report.out_dir / "apply.json").read_text())["dynamic"] is False
    with torch.no_grad():
        for shape in NEW_SHAPES[:EXTRA_CAPTURES + 1]:
            ids = torch.randint(0, 256, shape)
            torch.testing.assert_close(model(input_ids=ids).logits, untouched(input_ids=ids).logits,
                                       rtol=1e-5, atol=1e-5)
    assert not report.handle.any_shape_calls()
    assert any(SPENT in why for f in report.handle.fallbacks().values() for why in f)


def test_a_compile_that_fails_is_said_once_and_the_original_forward_runs(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        def fn(*a, **k):
            raise RuntimeError("no compiler here")
        return fn

    monkeypatch.setattr(any_shape, "compile_fresh", broken)
    model, untouched, report = _optimized(tmp_path, True)
    with warnings.catch_warnings(record=True) as said, torch.no_grad():
        warnings.simplefilter("always")
        for shape in NEW_SHAPES:
            ids = torch.randint(0, 256, shape)
            torch.testing.assert_close(model(input_ids=ids).logits, untouched(input_ids=ids).logits,
                                       rtol=1e-5, atol=1e-5)
    told = [w for w in said if "dynamic-shape compile of the original forward failed" in str(w.message)]
    assert len(told) == model.config.num_hidden_layers, [str(w.message) for w in said]  # once per patched forward
    reasons = {why for f in report.handle.fallbacks().values() for why in f}
    assert any("no compiler here" in why for why in reasons), reasons
    assert not report.handle.any_shape_calls()


@pytest.mark.parametrize("name, bad", [("dynamic", "yes"), ("dynamic", 1), ("inductor", "auto")])
def test_a_route_flag_that_is_not_a_bool_is_one_clear_error(name, bad):
    from advisor.errors import AdvisorError

    with pytest.raises(AdvisorError, match=rf"{name} is True, False,? (or )?None .*got") as e:
        advisor.optimize(torch.nn.Linear(2, 2), (torch.randn(1, 2),), **{name: bad})
    assert "\n" not in str(e.value)
