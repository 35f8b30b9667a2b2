"""Fusion rule 11: a max-pool ends the chain before it (BatchNorm + ReLU + max-pool, ResNet's stem), the
chain computed at every tap of each window and its output never written.

Real pipeline: a small ResNet-like model (stem, two basic blocks) profiled, analysed, its kernels generated
and validated in Triton's interpreter, patched in place and compared with eager; channels-last as the
suite's ResNet-50 runs.
"""
import json
import re

import pytest
import torch
from torch import nn

import advisor
from advisor.analysis.api import analyze
from advisor.codegen import load_module
from advisor.collect.in_process import profile_calls
from advisor.jsonio import atomic_write
from advisor.patching.capture import launched_sites
from advisor.validate import validate


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)  # as torchvision's blocks: the stem's BatchNorm + relu_ again

    def forward(self, x):
        h = self.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + x)


class Stem(nn.Module):
    """torchvision ResNet's stem, in a module of its own (ResNet's lies in the model's root, which only the
    whole-stack capture fuses: a GPU's selection); `shared`: its BatchNorm + ReLU output is read past the
    pool too."""

    def __init__(self, c, shared):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, c, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(c)
        self.relu, self.maxpool = nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1)
        self.shared = shared

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        out = self.maxpool(y)
        return out + y.mean() if self.shared else out


class Net(nn.Module):
    def __init__(self, c=16, shared=False):
        super().__init__()
        self.stem = Stem(c, shared)
        self.layers = nn.Sequential(Block(c), Block(c))
        self.fc = nn.Linear(c, 16)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


def _net(channels_last=False, shared=False):
    torch.manual_seed(0)
    m = Net(shared=shared).eval()
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):  # statistics that move the values (init's are the identity)
            mod.running_mean.normal_()
            mod.running_var.uniform_(0.5, 2.0)
            mod.weight.data.normal_()
            mod.bias.data.normal_()
    x = torch.randn(2, 3, 30, 30)  # 15 x 15 after the stem: the last window hangs over the edge
    if channels_last:
        m, x = m.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    return m, x


def _pooled(doc):
    return [c for c in doc["candidates"] if any(op.endswith("max_pool2d") for op in c["ops"])]


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels-last"])
def test_batchnorm_relu_max_pool_is_one_kernel(channels_last, tmp_path):
    model, x = _net(channels_last)
    with torch.no_grad():
        ref = model(x)
    report = advisor.optimize(model, (x,), top=8, out=tmp_path, reuse=False, interpret=True)
    doc = json.loads((tmp_path / "analysis.json").read_text())
    [pool] = _pooled(doc)
    assert pool["ops"] == ["aten::batch_norm", "aten::relu_", "aten::max_pool2d"]
    assert pool["title"].startswith("BatchNorm + ReLU + max-pool")
    [chain] = [c for c in doc["candidates"] if c["id"] == pool["extends"]]
    # the chain alone (three sites) ranks above the pooled one (one), yet the pooled site is the pool's
    assert chain["ops"] == ["aten::batch_norm", "aten::relu_"] and chain["rank"] < pool["rank"]
    records = {r["candidate"]: r for r in report.patterns}
    assert records[pool["id"]]["validated"] and records[pool["id"]]["sites"] == 1
    # the chain's two other sites: the chain's kernel, or the conv epilogue that extends it (cuDNN's fused conv)
    conv = [c["id"] for c in doc["candidates"] if c.get("extends") == chain["id"] and c["kind"] == "epilogue"]
    assert sum(records[k]["sites"] for k in [chain["id"], *conv] if k in records) == 2, records
    before = report.handle.launches()
    with torch.no_grad():
        out = model(x)
    ran = launched_sites(before, report.handle.launches())
    assert ran.get(f"{pool['pattern_id']}:kernel") == 1, ran
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_chain_read_past_the_pool_is_not_pooled(tmp_path):
    model, x = _net(shared=True)
    doc = analyze(profile_calls(lambda: model(x), tmp_path, "cpu", calls=2)).doc
    assert not _pooled(doc)


def test_planted_wrong_window_is_rejected(tmp_path):
    from advisor.codegen import generate

    model, x = _net()
    doc = analyze(profile_calls(lambda: model(x), tmp_path, "cpu", calls=2)).doc
    [pool] = _pooled(doc)
    gen = generate(pool["program"], use_cache=False)
    assert validate(gen, load_module(gen.path), memo=False).validated
    for name, wrong in {"min-pool": re.sub(r"\((\w+) > (\w+)\)", r"(\1 < \2)", gen.code),
                        "edge-taps-kept": gen.code.replace('-float("inf")', "1e4")}.items():
        assert wrong != gen.code, name
        planted = load_module(atomic_write(tmp_path / f"{name}.py", wrong))
        assert not validate(gen, planted, memo=False).validated, name
