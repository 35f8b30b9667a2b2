"""The bundled demo workload for `fusion-advisor run` (no SCRIPT given).

A small model that is quick on a CPU: a pre-norm MLP block (LayerNorm -> Linear -> GELU -> Linear ->
residual add) followed by the seed chain `log(relu(x + b))`, wrapped as one nn.Module and called
`--iters` times (default 3) under `torch.inference_mode()`. Random weights; nothing is downloaded.
Device: --device, else $FUSION_ADVISOR_DEVICE, else cuda if available. bf16 on cuda, fp32 on cpu.
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

from advisor import config


class MLPBlock(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, inter)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(inter, hidden)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class Seed(nn.Module):
    """log(relu(x + b)): three elementwise kernels in eager mode, one when fused."""

    def __init__(self, hidden: int):
        super().__init__()
        self.b = nn.Parameter(torch.randn(hidden))

    def forward(self, x):
        return torch.log(torch.relu(x + self.b))


class DemoModel(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.block = MLPBlock(hidden, inter)
        self.seed = Seed(hidden)

    def forward(self, x):
        return self.seed(self.block(x))


def main(argv=None) -> None:
    default_device = config.current().device or ("cuda" if torch.cuda.is_available() else "cpu")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=default_device, choices=["cuda", "cpu"])
    ap.add_argument("--iters", type=int, default=3)
    a = ap.parse_args(argv)

    torch.manual_seed(0)
    if a.device == "cuda":
        dtype, (batch, seq, hidden, inter) = torch.bfloat16, (8, 512, 1024, 4096)
    else:
        dtype, (batch, seq, hidden, inter) = torch.float32, (4, 64, 128, 512)
    model = DemoModel(hidden, inter).to(a.device, dtype).eval()
    x = torch.randn(batch, seq, hidden, device=a.device, dtype=dtype)
    with torch.inference_mode():
        for _ in range(a.iters):
            y = model(x)
    if a.device == "cuda":
        torch.cuda.synchronize()
    print(f"demo workload: {a.iters} iterations on {a.device}, output {tuple(y.shape)}")


if __name__ == "__main__":
    main()
