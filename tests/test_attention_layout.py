"""Attention whose layout alone sends SDPA to its math backend gets its inputs laid out
(`advisor.patching.attention_layout`). The fused kernels that refuse a strided mask are CUDA's: on this CPU the
decision is SDPA's own (CPU flash takes strided masks: nothing changes) or, to exercise the rewrite, CUDA's rule
as sdp_utils states it (every fused kernel needs a last dimension of stride 1)."""
from __future__ import annotations

import copy
import json

import torch
import torch.nn.functional as F

import advisor
from advisor.patching import attention_layout
from advisor.patching.attention_layout import lay_out_attention_inputs, sdpa_math_only_for_layout

B, H, L, D = 2, 4, 16, 8


class BiasedAttention(torch.nn.Module):
    """T5's self-attention as transformers 5.17 hands it to SDPA: a relative-position bias looked up in an
    embedding and permuted to heads-first (last dim of stride H), put under the padding mask by `torch.where`
    (which keeps that layout), then a residual and an output projection."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(H * D, 3 * H * D)
        self.out = torch.nn.Linear(H * D, H * D)
        self.bias = torch.nn.Embedding(2 * L, H)

    def forward(self, x, keep):
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
        pos = torch.arange(L)
        pb = self.bias(pos[None, :] - pos[:, None] + L).permute(2, 0, 1).unsqueeze(0)  # 1 x H x L x L, strided
        mask = torch.where(keep[:, None, None, :], pb, torch.finfo(x.dtype).min)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        return x + self.out(y.transpose(1, 2).reshape(B, L, H * D))


def cuda_rule(tensors, scalars, strided):  # what SDPA decides on CUDA for these layouts (sdp_utils)
    return True


def inputs():
    torch.manual_seed(0)
    keep = torch.ones(B, L, dtype=torch.bool)
    keep[-1, L - 5:] = False
    return torch.randn(B, L, H * D), keep


def captured(module, decide):
    """Dynamo's graph of `module`, rewritten, and the notes the rewrite gave."""
    seen = {}

    def backend(gm, example_inputs):
        seen["notes"] = lay_out_attention_inputs(gm, decide)
        seen["gm"] = gm
        return gm.forward

    torch._dynamo.reset()
    run = torch.compile(module, backend=backend, fullgraph=True)
    return run, seen


def test_a_strided_mask_is_laid_out_where_only_its_layout_sends_sdpa_to_math():
    model = BiasedAttention().eval()
    x, keep = inputs()
    with torch.no_grad():
        want = model(x, keep)
        run, seen = captured(model, cuda_rule)
        got = run(x, keep)
    assert len(seen["notes"]) == 1 and "attn_mask" in seen["notes"][0] and "stride 4" in seen["notes"][0]
    sdpa = next(n for n in seen["gm"].graph.nodes if n.target is torch._C._nn.scaled_dot_product_attention)
    laid = sdpa.kwargs["attn_mask"]
    assert laid.op == "call_method" and laid.target == "contiguous"
    assert laid.meta["example_value"].is_contiguous()
    torch.testing.assert_close(got, want)  # the same values, laid out


def test_nothing_changes_where_sdpa_takes_the_layout():
    model = BiasedAttention().eval()
    x, keep = inputs()
    with torch.no_grad():
        run, seen = captured(model, None)  # SDPA's own choice on this CPU: its flash kernel takes strided masks
        run(x, keep)
    assert seen["notes"] == []
    assert not any(n.op == "call_method" and n.target == "contiguous" for n in seen["gm"].graph.nodes)


def test_contiguous_inputs_and_cpu_tensors_are_never_copied():
    q = torch.randn(B, H, L, D)
    mask = torch.zeros(B, H, L, L)
    assert not sdpa_math_only_for_layout({"query": q, "key": q, "value": q, "attn_mask": mask.transpose(-1, -2)},
                                         {"dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False},
                                         ["attn_mask"])

    calls = []

    def spy(*a):
        calls.append(a)
        return True

    def plain(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    with torch.no_grad():
        run, seen = captured(plain, spy)
        run(q, q, q, mask)
    assert seen["notes"] == [] and calls == []  # nothing strided: SDPA's choice not even asked


def test_optimize_lays_the_mask_out_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(attention_layout, "sdpa_math_only_for_layout", cuda_rule)
    model = BiasedAttention().eval()
    untouched = copy.deepcopy(model)
    x, keep = inputs()
    report = advisor.optimize(model, (x, keep), interpret=True, reuse=False, out=tmp_path)
    notes = report.handle.attention_layouts()
    assert notes and all("attn_mask" in k for k in notes)
    assert json.loads((tmp_path / "apply.json").read_text())["attention_layouts"] == notes
    with torch.no_grad():
        torch.testing.assert_close(model(x, keep), untouched(x, keep))


def test_the_any_shape_compile_lays_out_too(monkeypatch):
    from advisor.patching import any_shape

    asked = []

    def rule(tensors, scalars, strided):
        asked.append(strided)
        return True

    monkeypatch.setattr(attention_layout, "sdpa_math_only_for_layout", rule)
    model = BiasedAttention().eval()
    x, keep = inputs()
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend=any_shape.laid_out_inductor, fullgraph=True)(x, keep)
        torch.testing.assert_close(got, model(x, keep))
    assert asked == [["attn_mask"]]
