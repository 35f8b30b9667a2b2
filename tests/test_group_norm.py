"""GroupNorm (+ SiLU, + residual): found as one fusion candidate, generated as one kernel whose rows are the
(sample, group) pairs, validated against PyTorch, patched into a model (a diffusion UNet's resnet block) and
checked there. Real kernels, in Triton's interpreter on the CPU."""
import copy
import os

import pytest
import torch
from torch import nn

import advisor
from advisor.codegen import Unsupported, generate, load_module
from advisor.codegen.record import record_program
from advisor.validate import validate

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
F = torch.nn.functional
DEV = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path_factory.getbasetemp() / "kernel-cache"))


def _inputs(shape, groups, dtype=torch.float32, channels_last=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3 + 1).to(dtype)  # not centred: the mean matters
    if channels_last:
        x = x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    c = shape[1]
    w = (torch.rand(c, generator=g) + 0.5).to(dtype)
    b = torch.randn(c, generator=g).to(dtype)
    return x.to(DEV), w.to(DEV), b.to(DEV)


def _norm_silu(groups):
    return lambda x, w, b: F.silu(F.group_norm(x, groups, w, b, eps=1e-5))


def _check(fn, inputs, tol=1e-5, module=None):
    gen = generate(record_program(fn, *inputs)) if module is None else None
    mod = module or load_module(gen.path)
    got = mod.run(*[t.clone() for t in inputs])
    want = fn(*inputs)
    want = want if isinstance(want, tuple) else (want,)
    for g_, w_ in zip(got, want):
        assert g_.shape == w_.shape and g_.dtype == w_.dtype
        torch.testing.assert_close(g_, w_, atol=tol, rtol=tol)
    return gen, mod


@pytest.mark.parametrize("shape,groups,channels_last", [
    ((2, 32, 8, 8), 8, False),     # a UNet block: four channels per group
    ((2, 32, 8, 8), 8, True),      # the same input channels_last: the group's elements are strided
    ((1, 12, 5, 7), 3, False),     # one sample (a pinned size-1 dim), odd spatial sizes
    ((3, 16, 6, 5), 1, False),     # one group: a LayerNorm over (C, H, W)
    ((2, 16, 4, 4), 16, False),    # a group per channel: InstanceNorm
    ((2, 8, 33), 4, False),        # 1-d signals (wav2vec2's feature encoder)
    ((2, 8, 3, 4, 5), 2, False),   # 3-d volumes
])
def test_group_norm_silu_kernel_matches_pytorch(shape, groups, channels_last):
    gen, mod = _check(_norm_silu(groups), _inputs(shape, groups, channels_last=channels_last))
    assert validate(gen, mod).validated
    assert "tl.sum" in gen.code  # one kernel reduces each group itself


def test_one_kernel_serves_other_batch_and_spatial_sizes_but_not_other_channel_counts():
    gen, mod = _check(_norm_silu(4), _inputs((2, 16, 8, 8), 4))
    _check(_norm_silu(4), _inputs((5, 16, 3, 11), 4, seed=1), module=mod)
    _check(_norm_silu(4), _inputs((1, 16, 64, 64), 4, seed=2), module=mod)  # 4096-wide groups: the looped kernel
    with pytest.raises(ValueError, match="differ from the pattern"):
        mod.run(*_inputs((2, 32, 8, 8), 4))  # C / G is part of the kernel


def test_bf16_group_norm_rounds_as_eager_and_validates():
    fn = lambda x, w, b: F.silu(F.group_norm(x, 8, w, b)) + x  # noqa: E731  (a residual read too)
    gen, mod = _check(fn, _inputs((2, 32, 6, 6), 8, torch.bfloat16), tol=2e-2)
    assert validate(gen, mod).validated


@pytest.mark.parametrize("name", ["features", "no affine", "scale-shift"])
def test_group_norm_variants_users_write(name):
    """GroupNorm over (N, C) features, without its affine, and a diffusion model's scale-shift after it
    (`norm(x) * (1 + scale) + shift`, scale and shift per sample and channel)."""
    x, w, b = _inputs((2, 16) if name == "features" else (2, 16, 5, 5), 4)
    g = torch.Generator().manual_seed(7)
    if name == "features":
        fn, inputs = (lambda x, w, b: F.silu(F.group_norm(x, 4, w, b))), (x, w, b)
    elif name == "no affine":
        fn, inputs = (lambda x: F.silu(F.group_norm(x, 4))), (x,)
    else:
        scale, shift = (torch.randn(2, 16, 1, 1, generator=g).to(DEV) for _ in range(2))
        fn, inputs = (lambda x, w, b, s, t: F.silu(F.group_norm(x, 4, w, b) * (1 + s) + t)), (x, w, b, scale, shift)
    gen, mod = _check(fn, inputs)
    assert validate(gen, mod).validated


def test_native_group_norm_statistics_are_outputs_per_group():
    def fn(x, w, b):
        return torch.ops.aten.native_group_norm(x, w, b, x.shape[0], x.shape[1], x.shape[2] * x.shape[3], 4, 1e-5)
    gen, mod = _check(fn, _inputs((3, 16, 5, 5), 4))
    assert validate(gen, mod).validated


def test_a_group_norm_over_another_grouping_in_the_same_program_is_refused():
    fn = lambda x, w, b: F.group_norm(F.group_norm(x, 4, w, b), 2, w, b)  # noqa: E731
    with pytest.raises(Unsupported, match="other rows"):
        generate(record_program(fn, *_inputs((2, 16, 4, 4), 4)))


class ResnetBlock(nn.Module):
    """A diffusion UNet's resnet block: GroupNorm -> SiLU -> conv, twice, plus the input."""

    def __init__(self, c=32, groups=8):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(groups, c), nn.Conv2d(c, c, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(groups, c), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        return x + self.conv2(F.silu(self.norm2(h)))


class UNetMid(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([ResnetBlock() for _ in range(2)])
        self.out_norm = nn.GroupNorm(8, 32)

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return F.silu(self.out_norm(x))


def test_optimize_patches_group_norm_silu_in_a_unet_block(tmp_path):
    torch.manual_seed(0)
    model = UNetMid().eval()
    for m in model.modules():  # trained-looking affine parameters
        if isinstance(m, nn.GroupNorm):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.normal_(m.bias)
    twin = copy.deepcopy(model)
    x = torch.randn(2, 32, 8, 8)
    report = advisor.optimize(model, (x,), out=tmp_path, interpret=True, reuse=False)
    norms = [p for p in report.patterns if p["title"].startswith("GroupNorm")]
    assert norms and any(p["patched"] for p in norms), [(p["title"], p["status"]) for p in report.patterns]
    with torch.no_grad():
        for shape in [(2, 32, 8, 8), (3, 32, 6, 10)]:  # the example's shape, and another
            y = torch.randn(shape)
            torch.testing.assert_close(model(y), twin(y), rtol=1e-4, atol=1e-4)
        y = torch.randn(2, 32, 8, 8).to(memory_format=torch.channels_last)
        torch.testing.assert_close(model(y), twin(y), rtol=1e-4, atol=1e-4)
    advisor.unpatch(model)
