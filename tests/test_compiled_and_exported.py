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
