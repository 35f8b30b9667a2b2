"""Seed workload: `torch.log(torch.relu(x + b))` on fp32 vectors, as an nn.Module.

Three elementwise kernels in eager mode (28 bytes moved per element) where one fused kernel needs 12.
cuda: N = 2^24; cpu: N = 2^16. Usage: python examples/seed.py [--device cuda|cpu] [--iters 3] [--n N]
"""
import argparse
import os

import torch
from torch import nn


class Seed(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.b = nn.Parameter(torch.randn(n))

    def forward(self, x):
        return torch.log(torch.relu(x + self.b))


def main():
    default_device = os.environ.get("FUSION_ADVISOR_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    ap = argparse.ArgumentParser(description="log(relu(x + b)) on fp32 vectors")
    ap.add_argument("--device", default=default_device, choices=["cuda", "cpu"])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--n", type=int, default=None, help="vector length (default 2^24 on cuda, 2^16 on cpu)")
    a = ap.parse_args()

    torch.manual_seed(0)
    n = a.n or (1 << 24 if a.device == "cuda" else 1 << 16)
    model = Seed(n).to(a.device).eval()  # fp32 on both devices: the seed case is about fp32 vectors
    x = torch.randn(n, device=a.device)
    with torch.inference_mode():
        for _ in range(a.iters):
            y = model(x)
    if a.device == "cuda":
        torch.cuda.synchronize()
    print(f"seed: {a.iters} iterations on {a.device}, n={n}")


if __name__ == "__main__":
    main()
