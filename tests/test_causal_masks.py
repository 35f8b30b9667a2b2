"""A causal mask a captured graph builds from positions alone runs as causal attention with no mask
(`advisor.patching.causal_masks`); masks that read an input, or that are not exactly causal, stay."""
import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from advisor.patching.causal_masks import fold_causal_masks

B, H, L, D = 2, 3, 8, 16


def qkv(seed=0, length=L):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g) for n in (L, length, length)]


def positions(length=L, offset=0):
    # as HF's masking_utils builds it while dynamo traces: index comparisons over aranges
    q = torch.arange(offset, offset + L)[:, None]
    kv = torch.arange(length)[None, :]
    return q, kv


def causal_bool(q, k, v):
    qi, ki = positions(k.shape[-2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(ki <= qi).expand(B, 1, L, L))


def causal_float(q, k, v):
    qi, ki = positions(k.shape[-2])
    mask = torch.where(ki <= qi, torch.full((), 0.0), torch.full((), torch.finfo(torch.float32).min))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])


def windowed(q, k, v):  # a sliding window of 3: constant, not causal
    qi, ki = positions(k.shape[-2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(ki <= qi) & (ki > qi - 3))


def padded(q, k, v, keep):  # the caller's padding mask: read from an input
    qi, ki = positions(k.shape[-2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(ki <= qi) & keep[:, None, None, :])


def decoding(q, k, v):  # 8 new queries over 12 keys, aligned bottom-right as a KV cache is: not SDPA's is_causal
    qi, ki = positions(k.shape[-2], offset=4)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=ki <= qi)


def everything_bool(q, k, v):  # an encoder's mask without padding, as HF builds it while tracing
    qi, ki = positions(k.shape[-2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(ki >= 0) & (qi >= 0))


def everything_float(q, k, v):
    qi, ki = positions(k.shape[-2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where((ki >= 0) & (qi >= 0), torch.full((), 0.0),
                                                                          torch.full((), -1e9)))


def attention_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]


def causal_float16_lowest(q, k, v):  # what HF wrote on the H100 for a bfloat16 model: float16's lowest, rounded
    qi, ki = positions(k.shape[-2])
    blocked = torch.full((), torch.finfo(torch.float16).min).to(torch.bfloat16).float()  # -65536
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(ki <= qi, torch.full((), 0.0), blocked))


def biased(q, k, v):  # a small bias where keys are blocked: not the kernel's causal masking
    qi, ki = positions(k.shape[-2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(ki <= qi, torch.full((), 0.0),
                                                                          torch.full((), -30.0)))


@pytest.mark.parametrize("fn", [causal_bool, causal_float, causal_float16_lowest], ids=["bool", "float", "float16-lowest"])
def test_a_constant_causal_mask_becomes_is_causal(fn):
    args = qkv()
    gm = make_fx(fn)(*args)
    assert fold_causal_masks(gm) == 1
    (attn,) = attention_nodes(gm)
    assert attn.kwargs.get("is_causal") is True or True in attn.args[3:5]
    assert not any(n.target is torch.ops.aten.arange.start_step or "arange" in str(n.target) for n in gm.graph.nodes)
    torch.testing.assert_close(gm(*args), fn(*args))
    torch.testing.assert_close(gm(*args), F.scaled_dot_product_attention(*args, is_causal=True))


@pytest.mark.parametrize("fn, extra, length", [(windowed, (), L), (padded, (torch.tensor([[True] * L, [True] * 5 + [False] * 3]),), L),
                                               (decoding, (), 12), (biased, (), L)],
                         ids=["window", "padding-input", "bottom-right", "bias"])
def test_masks_that_read_inputs_or_are_not_causal_stay(fn, extra, length):
    args = [*qkv(length=length), *extra]
    gm = make_fx(fn)(*args)
    before = gm.code
    assert fold_causal_masks(gm) == 0
    assert gm.code == before
    torch.testing.assert_close(gm(*args), fn(*args))


def test_folded_inside_the_fake_mode_a_backend_is_called_in():
    """AOTAutograd calls the inference compiler inside its trace's fake mode: the mask is still computed on
    real tensors, and a mask that cannot be computed is left as it is, never an error."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = qkv()
    gm = make_fx(causal_float)(*args)
    with FakeTensorMode():
        assert fold_causal_masks(gm) == 1
    torch.testing.assert_close(gm(*args), F.scaled_dot_product_attention(*args, is_causal=True))
    broken = make_fx(causal_bool)(*args)
    arange = next(n for n in broken.graph.nodes if "arange" in str(n.target))
    arange.kwargs = {**arange.kwargs, "device": "no-such-device"}  # fails when run: the mask stays
    before = broken.code
    assert fold_causal_masks(broken) == 0 and broken.code == before


def test_a_mask_too_large_to_check_stays(monkeypatch):
    from advisor.patching import causal_masks

    monkeypatch.setattr(causal_masks, "MAX_ELEMENTS", B * L * L - 1)
    args = qkv()
    gm = make_fx(causal_bool)(*args)
    assert fold_causal_masks(gm) == 0


@pytest.mark.parametrize("fn", [everything_bool, everything_float], ids=["bool", "float"])
def test_a_constant_mask_allowing_every_key_is_dropped(fn):
    args = qkv()
    gm = make_fx(fn)(*args)
    assert fold_causal_masks(gm) == 1
    (attn,) = attention_nodes(gm)
    assert attn.kwargs.get("attn_mask") is None and not attn.kwargs.get("is_causal") and True not in attn.args[3:5]
    torch.testing.assert_close(gm(*args), F.scaled_dot_product_attention(*args))
