"""PyTorch's own transformer layers (issue: nothing that matters fused on them). In inference
`nn.TransformerEncoderLayer` and `nn.MultiheadAttention` take a fused native fast path
(`torch._transformer_encoder_layer_fwd`, `torch._native_multi_head_attention`): the profile saw its
internals, the capture the one opaque op, and every LayerNorm candidate the report ranked was "not found in
the captured graphs". Profile and captured layers now both run the module-level path
(`advisor.fast_paths`): the ranked residual + LayerNorm candidates are patched and the outputs match."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import advisor
from candidates import RESIDUAL_LAYERNORM, Structure, candidates_of, describe, find_candidates

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
ROOT = Path(__file__).resolve().parents[1]
LAYERNORM = Structure(kind="norm", has=("layer_norm",))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.TransformerDecoderLayer(64, 4, 128, batch_first=True, norm_first=True)
                                    for _ in range(2))

    def forward(self, x, memory):
        for layer in self.layers:
            x = layer(x, memory)
        return x


class Block(nn.Module):
    """A self-attention block spelled with nn.MultiheadAttention: residual add + LayerNorm after it."""

    def __init__(self):
        super().__init__()
        self.attn, self.norm = nn.MultiheadAttention(64, 4, batch_first=True), nn.LayerNorm(64)

    def forward(self, x):
        return self.norm(x + self.attn(x, x, x, need_weights=False)[0])


def attention():
    return nn.Sequential(Block(), Block())


class VitEncoderBlock(nn.Module):
    """torchvision's `vision_transformer.EncoderBlock`, as it is written there (torchvision stays out of CI):
    pre-norm nn.MultiheadAttention and MLP, each with its residual add."""

    def __init__(self, hidden=64, heads=4, mlp=128):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.dropout = nn.Dropout(0.0)
        self.ln_2 = nn.LayerNorm(hidden, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(hidden, mlp), nn.GELU(), nn.Dropout(0.0), nn.Linear(mlp, hidden),
                                 nn.Dropout(0.0))

    def forward(self, input):
        x = self.ln_1(input)
        x, _ = self.self_attention(x, x, x, need_weights=False)
        x = self.dropout(x) + input
        return x + self.mlp(self.ln_2(x))


def vit_blocks():
    return nn.Sequential(VitEncoderBlock(), VitEncoderBlock())


def encoder():
    return nn.Sequential(*[nn.TransformerEncoderLayer(64, 4, 128, activation="gelu", batch_first=True,
                                                      norm_first=True) for _ in range(2)])


CASES = {
    "encoder": (encoder, lambda: (torch.randn(2, 8, 64),)),
    "decoder": (Decoder, lambda: (torch.randn(2, 8, 64), torch.randn(2, 6, 64))),
    "attention": (attention, lambda: (torch.randn(2, 8, 64),)),
    "torchvision_vit_block": (vit_blocks, lambda: (torch.randn(2, 8, 64),)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_layernorm_candidates_of_torch_transformer_layers_are_patched(name, tmp_path):
    build, inputs = CASES[name]
    torch.manual_seed(0)
    model = build().eval()
    untouched = copy.deepcopy(model)
    x = inputs()
    with torch.no_grad():
        report = advisor.optimize(model, x, out=tmp_path, reuse=False, interpret=True)
    doc = json.loads((tmp_path / "analysis.json").read_text())
    cands = candidates_of(report.patterns, doc)
    norms = [(p, c) for p, c in zip(report.patterns, cands) if LAYERNORM.matches(c)]
    assert find_candidates(doc["candidates"], RESIDUAL_LAYERNORM), describe(doc["candidates"])
    assert norms and all(p["patched"] for p, _ in norms), [(p["title"], p["status"]) for p, _ in norms]
    with torch.no_grad():
        got, want = model(*x), untouched(*x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.backends.mha.get_fastpath_enabled()  # the user's flag is left as it was


def test_apply_patches_the_encoder_layers_layernorms(tmp_path):
    """The issue's script, through the CLI: `apply` ranks residual + LayerNorm, patches it, and the patched
    outputs match; `analyze` gives the patterns the ids `apply` gave them."""
    script = tmp_path / "enc.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.TransformerEncoderLayer(64, 4, 128, activation="gelu", batch_first=True,
                                                           norm_first=True) for _ in range(2)]).eval()
        x = torch.randn(2, 8, 64)
        with torch.no_grad():
            for _ in range(3):
                model(x)
    """))
    out = tmp_path / "Y"
    run = subprocess.run([sys.executable, "-m", "advisor", "apply", str(script), "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads((out / "analysis.json").read_text())
    applied = json.loads((out / "apply.json").read_text())
    records = applied["patterns"]
    norms = [r for r, c in zip(records, candidates_of(records, doc)) if RESIDUAL_LAYERNORM.matches(c)]
    assert norms and all(r["patched"] for r in norms), [(r["title"], r["status"]) for r in records]
    # the patched model's outputs match the unpatched model's: the last check, of what stays patched, passed
    assert applied["checks"] and applied["checks"][-1]["ok"], applied["checks"]
    # `analyze` of a profile of its own names the same patterns by the same ids as `apply` did (its profile)
    analysed = tmp_path / "A"
    for cmd in (["profile", str(script), "--out", str(analysed)], ["analyze", str(analysed)]):
        r = subprocess.run([sys.executable, "-m", "advisor", *cmd], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ids = [{c["id"]: c["pattern_id"] for c in json.loads((d / "analysis.json").read_text())["candidates"]}
           for d in (out, analysed)]
    assert ids[0] == ids[1]
