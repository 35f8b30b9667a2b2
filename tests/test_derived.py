"""`advisor.kernels.derived`: tensors derived from weights (a BatchNorm folded into a conv) are computed once, and
again into the same tensors when a weight changes, also under a CUDA-graph replay (checked with a CPU stand-in)."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

import advisor
from advisor.kernels import derived as derived_mod
from advisor.kernels.derived import derived
from advisor.patching.capture import launched_sites
from advisor.patching.graphs import Graphed

sys.path.insert(0, str(Path(__file__).parent))
from zoo_models import BY_NAME  # noqa: E402


def scaled(w, s):
    scaled.calls += 1
    return (w * s,)


scaled.calls = 0


def test_computed_once_then_again_in_place_when_a_source_changes():
    w, s = torch.randn(4), torch.tensor(2.0)
    before = scaled.calls
    (a,) = derived(scaled, w, s)
    (b,) = derived(scaled, w, s)
    assert a is b and scaled.calls == before + 1
    with torch.no_grad():
        w.mul_(3)  # e.g. load_state_dict, an optimizer step: an in-place write bumps the version
    (c,) = derived(scaled, w, s)
    assert c is a and torch.equal(c, w * 2) and scaled.calls == before + 2
    other = torch.randn(4)  # other weights: their own entry
    (d,) = derived(scaled, other, s)
    assert d is not a and torch.equal(d, other * 2)


def test_entries_go_with_their_sources():
    w, s = torch.randn(4), torch.tensor(1.0)
    derived(scaled, w, s)
    n = len(derived_mod._CACHE)
    assert n >= 1
    del w  # validation's inputs, replaced weights: their folds are not kept
    assert len(derived_mod._CACHE) == n - 1


def test_inference_tensors_are_not_cached():
    # an inference tensor has no version counter: a change could not be seen, so the value is computed each call
    with torch.inference_mode():
        w = torch.randn(4)
    before = scaled.calls
    derived(scaled, w, torch.tensor(2.0))
    derived(scaled, w, torch.tensor(2.0))
    assert scaled.calls == before + 2


class FrozenReplayOnCpu:
    """A CUDA graph's contract on the CPU: a replay re-runs the recorded work on the recording's tensors, and runs
    none of the Python that chose them (derived tensors are read as they are, never re-checked)."""

    device_type = "cpu"

    def record(self, fn, args):
        outs = list(fn(*args))

        def replay():
            with derived_mod.frozen():
                for o, new in zip(outs, fn(*args)):
                    o.copy_(new)
        return replay, outs


def test_a_replay_sees_weights_changed_after_its_recording():
    w, two = torch.nn.Parameter(torch.randn(4), requires_grad=False), torch.tensor(2.0)
    g = Graphed(lambda w, x: [x * derived(scaled, w, two)[0]], FrozenReplayOnCpu())
    x = torch.randn(4)
    assert torch.equal(g(w, x)[0], x * w * 2)
    with torch.no_grad():
        w.copy_(torch.randn(4))  # new weights loaded in place: the recording stays, its fold must follow
    assert torch.equal(g(w, x)[0], x * w * 2) and len(g.recordings) == 1


def _optimized_convnet():
    """The zoo's convnet in eval mode, optimized (conv + BatchNorm + ReLU patched as one conv on folded weights),
    and a check that a call runs the conv epilogues (so that what follows reads the folds)."""
    arch = BY_NAME["convnet"]
    model, inputs = arch.model(), arch.inputs(2, 16)
    report = advisor.optimize(model, inputs, interpret=True, reuse=False)
    conv = {s.key for s in report.handle.plan.patterns if s.title.startswith("conv2d epilogue")}
    before = report.handle.launches()
    with torch.no_grad():
        model(**inputs)
    assert conv & set(launched_sites(before, report.handle.launches())), report
    return arch, model, inputs


def test_an_optimized_convnet_follows_weights_loaded_after_optimize():
    """The user's flow: optimize, then load other weights and statistics, or update the statistics in train
    mode: the patched model in eval mode gives the new model's outputs."""
    arch, model, inputs = _optimized_convnet()
    torch.manual_seed(1)
    other = arch.build().eval()  # other weights, other BatchNorm statistics
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.allclose(model(**inputs), other(**inputs), rtol=1e-4, atol=1e-4)
        model.train(), other.train()
        model(**inputs), other(**inputs)  # running statistics updated in place
        model.eval(), other.eval()
        assert torch.allclose(model(**inputs), other(**inputs), rtol=1e-4, atol=1e-4)
    advisor.unpatch(model)
    ref = copy.deepcopy(other)
    with torch.no_grad():
        assert torch.allclose(model(**inputs), ref(**inputs), rtol=1e-4, atol=1e-4)


def test_a_parameter_given_new_data_is_refolded():
    w, s = torch.nn.Parameter(torch.randn(4), requires_grad=False), torch.tensor(2.0)
    (a,) = derived(scaled, w, s)
    w.data = torch.randn(4)  # no version bump: a new storage
    (b,) = derived(scaled, w, s)
    assert b is a and torch.equal(b, w * 2)


def test_statistics_a_training_forward_updated_are_refolded():
    """A train-mode forward that runs the original ops (here: an input that needs a gradient) updates BatchNorm's
    running statistics in BatchNorm's native kernel, which bumps no version counter; the patched model in eval
    mode afterwards computes with the new statistics, as the unpatched model does."""
    arch, model, inputs = _optimized_convnet()
    stats = model.stem[1].running_var
    version, before = stats._version, stats.clone()
    model.train()
    model(pixel_values=inputs["pixel_values"].clone().requires_grad_())
    model.eval()
    assert not torch.equal(stats, before) and stats._version == version  # changed, unannounced
    fresh = arch.build().eval()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.allclose(model(**inputs), fresh(**inputs), rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def convnet_and_twin():
    """The optimized convnet and an unpatched copy of it: every test edits both the same way, then compares."""
    arch, model, inputs = _optimized_convnet()
    twin = copy.deepcopy(model)
    advisor.unpatch(twin)
    return model, twin, inputs


def _agree(model, twin, inputs, dtype=torch.float32) -> None:
    x = {k: v.to(dtype) for k, v in inputs.items()}
    with torch.no_grad():
        got, want = model(**x), twin(**x)
    tol = 1e-2 if dtype == torch.half else 1e-4
    assert got.dtype == want.dtype and torch.allclose(got, want, rtol=tol, atol=tol), \
        f"rel err {((got - want).norm() / want.norm()).item():.3g}"


def _launches(model) -> int:
    return sum(n for _, f in advisor.patching.patched_modules(model) for n in f.log().launches().values())


def test_weights_edited_through_data_are_refolded(convnet_and_twin):
    """`w.data.mul_(1.5)` writes through a tensor whose version counter is not the parameter's: the patched model
    had answered with the old weights (rel err 0.24). Also a `.data` held and written after a call."""
    model, twin, inputs = convnet_and_twin
    _agree(model, twin, inputs)
    for m in (model, twin):
        m.stem[0].weight.data.mul_(1.5)
        m.stem[1].running_var.data.add_(0.5)  # a buffer's too
    launched = _launches(model)
    _agree(model, twin, inputs)
    assert _launches(model) > launched  # the fused kernels still ran, on refolded weights
    held = [m.stem[0].weight.data for m in (model, twin)]
    _agree(model, twin, inputs)
    for h in held:
        h.mul_(0.5)
    _agree(model, twin, inputs)


def test_weights_loaded_with_assign_and_stepped_by_optimizers_are_refolded(convnet_and_twin):
    model, twin, inputs = convnet_and_twin
    torch.manual_seed(2)
    other = BY_NAME["convnet"].build().eval().state_dict()
    for m in (model, twin):
        m.load_state_dict(copy.deepcopy(other), assign=True)  # new tensors
    _agree(model, twin, inputs)
    for kind in ({"fused": True}, {"foreach": True}, {"foreach": False}):  # a fused step bumps no version
        for m in (model, twin):
            opt = torch.optim.Adam(m.parameters(), lr=0.05, **kind)
            m(**inputs).square().mean().backward()  # gradients enabled: the original forward
            opt.step()
            opt.zero_grad()
        _agree(model, twin, inputs)


def test_a_model_cast_to_another_dtype_gives_its_outputs(convnet_and_twin):
    model, twin, inputs = convnet_and_twin
    for dtype in (torch.float64, torch.half, torch.float32):
        for m in (model, twin):
            m.to(dtype)
        _agree(model, twin, inputs, dtype)
