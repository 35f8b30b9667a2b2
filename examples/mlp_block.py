"""MLP block: LayerNorm -> Linear -> GELU -> Linear -> residual add, as an nn.Module.

cuda: bf16, batch 8 x seq 512 x hidden 4096 (intermediate 4x); cpu: fp32, 2 x 32 x 64.
Usage: python examples/mlp_block.py [--device cuda|cpu] [--iters 3]
"""
import argparse
import os

import torch
from torch import nn


class MLPBlock(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, inter)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(inter, hidden)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def main():
    default_device = os.environ.get("FUSION_ADVISOR_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    ap = argparse.ArgumentParser(description="LayerNorm -> Linear -> GELU -> Linear -> residual")
    ap.add_argument("--device", default=default_device, choices=["cuda", "cpu"])
    ap.add_argument("--iters", type=int, default=3)
    a = ap.parse_args()

    torch.manual_seed(0)
    if a.device == "cuda":
        dtype, (batch, seq, hidden) = torch.bfloat16, (8, 512, 4096)
    else:
        dtype, (batch, seq, hidden) = torch.float32, (2, 32, 64)
    with torch.device(a.device):
        model = MLPBlock(hidden, 4 * hidden).to(dtype).eval()
        x = torch.randn(batch, seq, hidden, dtype=dtype)
    with torch.inference_mode():
        for _ in range(a.iters):
            y = model(x)
    if a.device == "cuda":
        torch.cuda.synchronize()
    print(f"mlp_block: {a.iters} iterations on {a.device}, output {tuple(y.shape)} {y.dtype}")


if __name__ == "__main__":
    main()
