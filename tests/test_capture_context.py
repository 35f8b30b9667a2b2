"""A call whose context refuses the capture (dynamo's "attempted to set_stance in a torch.compile region", met
under TORCH_CUDA_SANITIZER) runs that call on the original forward and leaves the module fused for later calls:
it had switched the module to its original forward for good."""
from __future__ import annotations

import copy

import torch
from torch import nn

import advisor
from advisor.patching import forward


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm = nn.Linear(32, 32), nn.LayerNorm(32)

    def forward(self, x):
        return self.norm(x + torch.relu(self.fc(x)))


def test_a_refused_call_falls_back_for_that_call_only(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block()).eval()  # one capture of the class serves the second block
    untouched = copy.deepcopy(model)
    x = torch.randn(2, 16, 32)
    report = advisor.optimize(model, (x,), interpret=True, reuse=False, out=tmp_path)
    fused = report.runs["fused_launches_per_call"]
    assert fused >= 2, report.runs
    real = torch.compiler.set_stance

    def refuse(*a, **k):
        raise RuntimeError("attempted to set_stance in a torch.compile region")

    with torch.no_grad():
        monkeypatch.setattr(torch.compiler, "set_stance", refuse)
        torch.testing.assert_close(model(x), untouched(x))
        monkeypatch.setattr(torch.compiler, "set_stance", real)
        before = report.handle.launches()
        torch.testing.assert_close(model(x), untouched(x))
        after = report.handle.launches()
    assert sum(n - before.get(k, 0) for k, n in after.items()) == fused  # every site fused again
    assert not any(f.failed for f in report.handle.forwards.values())
    said = [why for whys in report.handle.fallbacks().values() for why in whys]
    assert any(why.startswith(forward.CONTEXT_REFUSED) for why in said), said
