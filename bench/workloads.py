"""The benchmark suite's workloads (issue 7): model builders with random weights, nothing downloaded.

`build(name, device, quick)` returns a `Workload`: the model (eval mode, on `device`), its example
inputs (positional tuple or keyword dict; random, never all zeros) and a description of the shape.
Full shapes are the issue's table (bf16 on cuda; the seed workload is fp32 by definition). `quick`
shapes are tiny, for the CPU test run (fp32 on the CPU, bf16 on cuda). timm and torchvision are
imported only when their workload is built; `NotInstalled` says which package is missing.

Used by bench/suite.py; `UNetBlocks` also by bench/zoo.py and tests/zoo_models.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

SUITE = ["seed", "mlp_block", "hf_llama", "hf_gpt2", "hf_bert", "timm_vit", "tv_resnet50"]  # issue 7's table
# Issue 10's matmul-anchored workloads: eager (unfused) attention, and the SPLADE head.
ANCHORED = ["hf_gpt2_eager", "hf_bert_eager", "splade"]
NAMES = SUITE + ANCHORED

# What the table calls each workload, and the shape it names (for the report).
TITLES = {
    "seed": "seed example `log(relu(x + b))`",
    "mlp_block": "LayerNorm→Linear→GELU→Linear→residual block",
    "hf_llama": "HF `LlamaForCausalLM`",
    "hf_gpt2": "HF `GPT2LMHeadModel`",
    "hf_bert": "HF `BertModel`",
    "timm_vit": "timm `vit_base_patch16_224`",
    "tv_resnet50": "torchvision ResNet-50, channels_last",
    "hf_gpt2_eager": "HF `GPT2LMHeadModel`, eager attention",
    "hf_bert_eager": "HF `BertModel`, eager attention",
    "splade": "SPLADE head on BERT-base (MLM head, max over the sequence)",
}

# Eager / torch.compile ms and compile s measured on the H100 (issue 7's table, /work/shared/ANCHORS.md).
# Shown beside this run's numbers for orientation only: speedups are always against this run's eager.
ANCHORS = {
    "seed": (2.524, 1.118, 2.6),
    "mlp_block": (6.809, 6.858, 5.3),
    "hf_llama": (12.525, 8.109, 16.5),
    "hf_gpt2": (21.04, 9.047, 16.0),
    "hf_bert": (8.40, 19.84, 17.7),
    "timm_vit": (12.669, 12.03, 15.2),
    "tv_resnet50": (10.41, 6.58, 17.6),
}

# Expected seconds per workload on an H100 (both child processes: start-up ~20 s, the advisor's cold and
# warm-cache runs, selection, torch.compile 3-18 s, timing). The suite's budget is shared in these
# proportions; what a workload leaves over goes to the ones after it.
WEIGHTS = {"seed": 50, "mlp_block": 110, "hf_llama": 95, "hf_gpt2": 90, "hf_bert": 90, "timm_vit": 100,
           "tv_resnet50": 100, "hf_gpt2_eager": 100, "hf_bert_eager": 100, "splade": 80}
COMPILE_S = 18.0  # torch.compile's first call where the table has no anchor (time kept for it)


class NotInstalled(RuntimeError):
    """A workload's package (timm, torchvision) is not installed here."""


@dataclass
class Workload:
    name: str
    model: nn.Module
    inputs: object  # tuple of positional args, or dict of keyword args
    shape: str
    dtype: torch.dtype
    notes: list = field(default_factory=list)

    def args_kwargs(self) -> tuple[tuple, dict]:
        if isinstance(self.inputs, dict):
            return (), dict(self.inputs)
        return tuple(self.inputs), {}


class Seed(nn.Module):
    """`torch.log(torch.relu(x + b))` (examples/seed.py)."""

    def __init__(self, n: int):
        super().__init__()
        self.b = nn.Parameter(torch.randn(n))

    def forward(self, x):
        return torch.log(torch.relu(x + self.b))


class MLPBlock(nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear -> residual add (examples/mlp_block.py)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, inter)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(inter, hidden)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class UNetBlocks(nn.Module):
    """A diffusion UNet's middle, as diffusers writes one: resnet blocks (GroupNorm -> SiLU -> conv, the
    timestep embedding added per channel, GroupNorm -> SiLU -> conv, plus the input) around a spatial
    self-attention block (GroupNorm, attention over the H x W positions, plus the input), and the output's
    GroupNorm -> SiLU. GroupNorm + SiLU is what Inductor fuses there and eager runs as two kernels.
    Used by bench/zoo.py (the GPU zoo) and tests/zoo_models.py (the CPU zoo)."""

    def __init__(self, channels: int = 64, groups: int = 32, temb: int = 128, heads: int = 1):
        super().__init__()
        self.time = nn.Linear(temb, temb)
        self.resnets = nn.ModuleList(_ResnetBlock(channels, groups, temb) for _ in range(2))
        self.attentions = nn.ModuleList([_SpatialAttention(channels, groups, heads)])
        self.norm_out = nn.GroupNorm(groups, channels)
        self.conv_out = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, sample, timestep_embedding):
        t = nn.functional.silu(self.time(timestep_embedding))
        x = self.resnets[0](sample, t)
        for attn, resnet in zip(self.attentions, self.resnets[1:]):  # as diffusers' UNetMidBlock2D
            x = resnet(attn(x), t)
        return self.conv_out(nn.functional.silu(self.norm_out(x)))


class _ResnetBlock(nn.Module):
    def __init__(self, c: int, groups: int, temb: int):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(groups, c, eps=1e-6), nn.Conv2d(c, c, 3, padding=1)
        self.time_emb_proj = nn.Linear(temb, c)
        self.norm2, self.conv2 = nn.GroupNorm(groups, c, eps=1e-6), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x, t):
        h = self.conv1(nn.functional.silu(self.norm1(x)))
        h = h + self.time_emb_proj(t)[:, :, None, None]
        h = self.conv2(nn.functional.silu(self.norm2(h)))
        return x + h


class _SpatialAttention(nn.Module):
    def __init__(self, c: int, groups: int, heads: int):
        super().__init__()
        self.group_norm, self.heads = nn.GroupNorm(groups, c, eps=1e-6), heads
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(c, c) for _ in range(4))

    def forward(self, x):
        b, c, h, w = x.shape
        y = self.group_norm(x).view(b, c, h * w).transpose(1, 2)
        q, k, v = (f(y).view(b, h * w, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        o = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, h * w, c)
        return x + self.to_out(o).transpose(1, 2).reshape(b, c, h, w)


def build(name: str, device: str, quick: bool = False, seed: int = 0) -> Workload:
    if name not in NAMES:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(NAMES)})")
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    w = globals()[f"_build_{name}"](device, quick, dtype)
    w.model.eval()
    for p in w.model.parameters():
        p.requires_grad_(False)
    return w


def _build_seed(device, quick, dtype):
    n = 1 << 16 if quick else 1 << 28
    with torch.device(device):
        model = Seed(n)  # fp32 on every device: the seed case is about fp32 vectors
        x = torch.randn(n)
    return Workload("seed", model, (x,), f"2^{n.bit_length() - 1} fp32 elements", torch.float32)


def _build_mlp_block(device, quick, dtype):
    batch, seq, hidden = (2, 32, 64) if quick else (8, 2048, 4096)
    with torch.device(device):
        model = MLPBlock(hidden, 4 * hidden).to(dtype)
        x = torch.randn(batch, seq, hidden, dtype=dtype)
    return Workload("mlp_block", model, (x,), f"batch {batch} × seq {seq} × d {hidden} (inter {4 * hidden})", dtype)


def _hf_ids(vocab: int, batch: int, seq: int) -> torch.Tensor:
    # Never all zeros; no pad token either (ids from 1 up), so no model masks anything away.
    return torch.randint(1, vocab, (batch, seq))


def _build_hf_llama(device, quick, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    if quick:
        dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=256)
        batch, seq = 2, 16
    else:
        dims = dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, intermediate_size=5632,
                    vocab_size=32000)
        batch, seq = 4, 1024
    config = LlamaConfig(max_position_embeddings=max(seq, 128), **dims)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
        ids = _hf_ids(config.vocab_size, batch, seq)
    shape = (f"hidden {dims['hidden_size']}, {dims['num_hidden_layers']} layers, {dims['num_attention_heads']} heads, "
             f"inter {dims['intermediate_size']}, vocab {dims['vocab_size']}, batch {batch} × seq {seq}")
    return Workload("hf_llama", model, {"input_ids": ids, "use_cache": False}, shape, dtype, ["SDPA attention"])


def _build_hf_gpt2(device, quick, dtype):
    from transformers import GPT2Config, GPT2LMHeadModel

    if quick:
        dims = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128, bos_token_id=255,
                    eos_token_id=255)
        batch, seq = 2, 16
    else:
        dims = dict(n_embd=1024, n_layer=12, n_head=16, vocab_size=50257, n_positions=1024)
        batch, seq = 8, 1024
    config = GPT2Config(**dims)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = GPT2LMHeadModel(config).to(dtype)
        ids = _hf_ids(config.vocab_size, batch, seq)
    shape = (f"n_embd {dims['n_embd']}, {dims['n_layer']} layers, {dims['n_head']} heads, vocab {dims['vocab_size']}, "
             f"batch {batch} × seq {seq}")
    return Workload("hf_gpt2", model, {"input_ids": ids, "use_cache": False}, shape, dtype, ["SDPA attention"])


def _build_hf_bert(device, quick, dtype):
    from transformers import BertConfig, BertModel

    if quick:
        config = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                            vocab_size=256, max_position_embeddings=128)
        batch, seq = 2, 16
    else:
        config = BertConfig()  # bert-base: hidden 768, 12 layers, 12 heads, intermediate 3072, vocab 30522
        batch, seq = 32, 512
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = BertModel(config).to(dtype)
        ids = _hf_ids(config.vocab_size, batch, seq)
        mask = torch.ones(batch, seq, dtype=torch.long)
    shape = (f"hidden {config.hidden_size}, {config.num_hidden_layers} layers, {config.num_attention_heads} heads, "
             f"batch {batch} × seq {seq}")
    return Workload("hf_bert", model, {"input_ids": ids, "attention_mask": mask}, shape, dtype, ["SDPA attention"])


def _build_hf_gpt2_eager(device, quick, dtype):
    w = _build_hf_gpt2(device, quick, dtype)
    w.model.config._attn_implementation = "eager"
    return Workload("hf_gpt2_eager", w.model, w.inputs, w.shape, dtype, ["eager attention (scores materialised)"])


def _build_hf_bert_eager(device, quick, dtype):
    w = _build_hf_bert(device, quick, dtype)
    w.model.config._attn_implementation = "eager"
    return Workload("hf_bert_eager", w.model, w.inputs, w.shape, dtype, ["eager attention (scores materialised)"])


def _build_splade(device, quick, dtype):
    import importlib.util
    from pathlib import Path

    from transformers import BertConfig

    path = Path(__file__).resolve().parents[1] / "examples" / "splade.py"
    spec = importlib.util.spec_from_file_location("fusion_advisor_example_splade", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    if quick:
        config, batch, seq = BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                        vocab_size=1000), 2, 16
    else:
        config, batch, seq = BertConfig(), 32, 256
    with torch.device(device):
        model = example.SpladeHead(config).to(dtype)
        hidden = torch.randn(batch, seq, config.hidden_size, dtype=dtype)
        mask = (torch.rand(batch, seq) > 0.2).to(dtype)
    return Workload("splade", model, (hidden, mask), f"hidden {config.hidden_size} → vocab {config.vocab_size}, "
                    f"batch {batch} × seq {seq}", dtype)


def _build_timm_vit(device, quick, dtype):
    try:
        import timm
    except ImportError as e:
        raise NotInstalled("timm is not installed") from e
    if quick:
        model = timm.create_model("vit_base_patch16_224", pretrained=False, img_size=32, depth=2, embed_dim=64,
                                  num_heads=4)
        batch, side = 2, 32
    else:
        model = timm.create_model("vit_base_patch16_224", pretrained=False)
        batch, side = 128, 224
    model = model.to(device, dtype)
    x = torch.randn(batch, 3, side, side, device=device, dtype=dtype)
    return Workload("timm_vit", model, (x,), f"batch {batch} × 3 × {side} × {side}", dtype)


def _build_tv_resnet50(device, quick, dtype):
    try:
        import torchvision
    except ImportError as e:
        raise NotInstalled("torchvision is not installed") from e
    batch, side = (2, 64) if quick else (128, 224)
    model = torchvision.models.resnet50(weights=None)
    model = model.to(device, dtype, memory_format=torch.channels_last)
    x = torch.randn(batch, 3, side, side, device=device, dtype=dtype).to(memory_format=torch.channels_last)
    return Workload("tv_resnet50", model, (x,), f"batch {batch} × 3 × {side} × {side}, channels_last", dtype)


def main_output(out) -> torch.Tensor | None:
    """The tensor a workload's error is measured on: the output itself, or a model output's first field
    (logits, last_hidden_state)."""
    if isinstance(out, torch.Tensor):
        return out
    try:
        first = out[0]
    except Exception:
        return None
    return first if isinstance(first, torch.Tensor) else main_output(first)
