"""A pattern that occurs at several shapes (a convnet's stages) is patched at every one of them: the
analysis keeps one program per shape (`variants`), a kernel is generated and validated per shape, and the
capture substitutes each where its shape occurs. Real profiler trace, real Triton kernels in the
interpreter, a ResNet-like model in channels_last with eval BatchNorm (torchvision stays out of CI).
The pattern followed is BatchNorm + ReLU as a pointwise kernel: conv epilogues (cuDNN's fused conv on the folded
BatchNorm, `codegen/conv.py`, which would take these sites by default) are switched off here (`pointwise_only`)."""
from __future__ import annotations

import contextlib
import copy
import json

import pytest
import torch
from torch import nn

import advisor
from advisor.analysis import api, fusion
from advisor.records import Kind


class Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, stride: int = 1):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, mid * 4, 1, bias=False), nn.BatchNorm2d(mid * 4)
        self.relu = nn.ReLU(inplace=True)
        self.down = None if cin == mid * 4 and stride == 1 else \
            nn.Sequential(nn.Conv2d(cin, mid * 4, 1, stride, bias=False), nn.BatchNorm2d(mid * 4))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += x if self.down is None else self.down(x)
        return self.relu(out)


class SmallResNet(nn.Module):
    """Two stages of two bottlenecks: BatchNorm + ReLU at three shapes (the stages' widths and the strided
    conv's resolution)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        self.layer1 = nn.Sequential(Bottleneck(16, 8), Bottleneck(32, 8))
        self.layer2 = nn.Sequential(Bottleneck(32, 16, 2), Bottleneck(64, 16))
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(self.layer2(self.layer1(self.stem(x))).mean((2, 3)))


def build():
    torch.manual_seed(0)
    model = SmallResNet().eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):  # statistics that are not the identity
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    x = torch.randn(2, 3, 16, 16)
    return model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)


@contextlib.contextmanager
def pointwise_only():
    """No conv epilogue offered: BatchNorm + ReLU is the pointwise kernel at every conv -> BatchNorm -> ReLU."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fusion, "conv_epilogue_fits", lambda ops: False)
        yield


def bn_relu(report):
    """(candidate, result) of the BatchNorm + ReLU pattern, found by its ops, not its title."""
    doc = json.loads((report.out_dir / "analysis.json").read_text())
    c = next(c for c in doc["candidates"] if c["kind"] == Kind.NORM.value and c["ops"] == ["aten::batch_norm", "aten::relu_"])
    return c, next(r for r in report.results if r.candidate == c["id"])


@pytest.fixture(scope="module")
def optimized(tmp_path_factory):
    model, x = build()
    untouched = copy.deepcopy(model)
    with pointwise_only():
        report = advisor.optimize(model, (x,), interpret=True, out=tmp_path_factory.mktemp("variants"))  # stores its plan
    return model, untouched, x, report


def test_every_shape_of_a_pattern_is_patched(optimized):
    model, untouched, x, report = optimized
    c, r = bn_relu(report)
    # three shapes (16 channels at 16x16: the stem and layer2's first conv; 8 at 16x16; 16 at 8x8 after the
    # strided conv): the first occurrence's program and two others
    assert len(c["variants"]) == 2
    assert [v["validated"] for v in r.variants] == [True] * 2  # a kernel per shape, each validated
    assert r.patched and r.sites == c["occurrences"] == 9  # every occurrence, not the first shape's 2
    with torch.no_grad():
        torch.testing.assert_close(model(x), untouched(x), rtol=1e-4, atol=1e-4)


def test_a_reused_plan_patches_every_shape_again(optimized, tmp_path):
    """The shapes' kernels travel in the plan (apply.json's manifest names each): a fresh copy of the model
    optimised again reuses the plan and patches the same sites, without generating anything."""
    _, untouched, x, report = optimized
    with pointwise_only():
        again = advisor.optimize(copy.deepcopy(untouched), (x,), interpret=True, out=tmp_path)
    assert json.loads((again.out_dir / "apply.json").read_text())["plan_reused"]
    assert "generate" not in again.phases_s
    c, r = bn_relu(again)
    assert r.sites == 9


def test_without_variants_only_the_first_shape_is_reached(monkeypatch, tmp_path):
    """What the variants buy: the first occurrence's program alone matches its own shape only."""
    monkeypatch.setattr(api, "MAX_SHAPE_VARIANTS", 0)
    model, x = build()
    with pointwise_only():
        report = advisor.optimize(model, (x,), interpret=True, reuse=False, out=tmp_path)
    c, r = bn_relu(report)
    assert "variants" not in c
    assert 0 < r.sites < c["occurrences"]


class WindowAttention(nn.Module):
    """timm's Swin WindowAttention without the shift mask: q, k and v are views of one projection, scores plus a
    per-head position bias, softmax, times v (eager: the scores materialised)."""

    def __init__(self, dim: int, heads: int, n: int = 16):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)
        self.bias = nn.Parameter(torch.randn(heads, n, n))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        attn = ((q * self.scale) @ k.transpose(-2, -1) + self.bias.unsqueeze(0)).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class TwoStages(nn.Module):
    """Swin's stages in small: windows of 16 tokens, 3 heads at width 48, then 6 heads at width 96."""

    def __init__(self):
        super().__init__()
        self.stage1, self.stage2 = WindowAttention(48, 3), WindowAttention(96, 6)
        self.merge = nn.Linear(48, 96)

    def forward(self, x):
        h = self.stage1(x)
        return self.stage2(self.merge(h.reshape(-1, 2, 16, 48).mean(1)))


def attention(report):
    doc = json.loads((report.out_dir / "analysis.json").read_text())
    c = next(c for c in doc["candidates"] if c["kind"] == Kind.ATTENTION.value)
    return c, next(r for r in report.results if r.candidate == c["id"])


@pytest.mark.parametrize("variants", [True, False], ids=["variants", "first-shape-only"])
def test_unfused_attention_is_patched_at_every_stage(variants, monkeypatch, tmp_path):
    """Unfused attention's kernel fixes the number of heads (q, k and v are views of one projection, at offsets
    of whole heads): Swin-T's attention was patched at 1 block of 7 (the 3-head stage) until its other shapes got
    kernels of their own as a fusion's do."""
    if not variants:
        monkeypatch.setattr(api, "MAX_SHAPE_VARIANTS", 0)
    torch.manual_seed(0)
    model = TwoStages().eval()
    untouched = copy.deepcopy(model)
    x = torch.randn(8, 16, 48)
    report = advisor.optimize(model, (x,), interpret=True, reuse=False, out=tmp_path)
    c, r = attention(report)
    assert c["occurrences"] == 2
    if variants:
        assert len(c["variants"]) == 1 and [v["validated"] for v in r.variants] == [True]
        assert r.patched and r.sites == 2
    else:
        assert "variants" not in c and r.sites == 1
    with torch.no_grad():
        torch.testing.assert_close(model(x), untouched(x), rtol=1e-4, atol=1e-4)
