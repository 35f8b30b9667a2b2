"""A patched model handed to PyTorch's other whole-model tools, and a model already wrapped by one of them:
`torch.compile` before `optimize`, `torch.export` / `torch.jit.trace` / `torch.onnx.export` after it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import advisor
from advisor.patching import patched_modules

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16)).eval()


def test_a_torch_compile_wrapper_is_optimised_underneath_and_keeps_working(tmp_path):
    model = mlp()
    x = torch.randn(4, 16)
    with torch.no_grad():
        expected = model(x)
    compiled = torch.compile(model)
    report = advisor.optimize(compiled, (x,), interpret=True, out=tmp_path / "plan")
    assert report.applied, str(report)
    assert patched_modules(model), "the module underneath the wrapper is patched"
    before = report.handle.launches()
    with torch.no_grad():
        through_wrapper = compiled(x)  # dynamo sees the original forwards: its own graph, eager's outputs
        assert torch.allclose(through_wrapper, expected, atol=1e-5)
        assert torch.allclose(model(x), expected, atol=1e-5)
    assert report.handle.launches() != before, "the module itself runs the fused kernels"
    assert advisor.unpatch(compiled) == 1
    handle = advisor.patch(compiled, tmp_path / "plan")  # a plan re-applied through the wrapper
    assert handle.modules and patched_modules(model)


@pytest.fixture(scope="module")
def patched():
    model = mlp()
    x = torch.randn(4, 16)
    with torch.no_grad():
        expected = model(x)
    report = advisor.optimize(model, (x,), interpret=True)
    assert report.applied, str(report)
    return model, x, expected, report.handle


def still_runs_its_kernels(model, x, expected, handle):
    before = handle.launches()
    with torch.no_grad():
        assert torch.allclose(model(x), expected, atol=1e-5)
    assert handle.launches() != before, "the patched model still runs its kernels after the trace"
    assert not handle.fallbacks(), handle.fallbacks()


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_sees_the_original_forward(patched, strict):
    model, x, expected, handle = patched
    exported = torch.export.export(model, (x,), strict=strict)
    assert torch.allclose(exported.module()(x), expected, atol=1e-5)
    assert not any("triton" in str(n.target) for n in exported.graph.nodes)  # the model's own ops
    still_runs_its_kernels(model, x, expected, handle)


def test_torch_jit_trace_sees_the_original_forward(patched):
    model, x, expected, handle = patched
    with torch.no_grad():
        traced = torch.jit.trace(model, (x,))
        assert torch.allclose(traced(x), expected, atol=1e-5)
    still_runs_its_kernels(model, x, expected, handle)


def test_export_and_jit_trace_are_named_in_the_log(caplog):
    from advisor.patching import forward

    model = mlp()
    x = torch.randn(4, 16)
    advisor.optimize(model, (x,), interpret=True)
    forward._TRACERS_TOLD.clear()
    with caplog.at_level("INFO", logger="advisor.patching.forward"):
        torch.export.export(model, (x,))
        with torch.no_grad():
            torch.jit.trace(model, (x,))
    told = [r.getMessage() for r in caplog.records if r.name == "advisor.patching.forward"]
    assert any("torch.export traces the original forward" in m for m in told), told
    assert any("torch.jit.trace traces the original forward" in m for m in told), told


def test_onnx_export_with_dynamo(patched, tmp_path):
    pytest.importorskip("onnx", reason="onnx is not installed (torch.onnx.export(dynamo=True) needs onnx, onnxscript)")
    pytest.importorskip("onnxscript", reason="onnxscript is not installed (torch.onnx.export(dynamo=True) needs it)")
    model, x, expected, handle = patched
    torch.onnx.export(model, (x,), str(tmp_path / "model.onnx"), dynamo=True)
    assert (tmp_path / "model.onnx").stat().st_size
    still_runs_its_kernels(model, x, expected, handle)
