"""torchvision resnet50 (weights=None), channels_last, forward pass.

cuda: bf16, batch 32 at 224x224; cpu: fp32, batch 2 at 64x64. Needs `torchvision` (imported lazily).
Usage: python examples/tv_resnet50.py [--device cuda|cpu] [--iters 3] [--size PX]
"""
import argparse
import os
import sys

import torch


def main():
    default_device = os.environ.get("FUSION_ADVISOR_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    ap = argparse.ArgumentParser(description="torchvision ResNet-50 forward")
    ap.add_argument("--device", default=default_device, choices=["cuda", "cpu"])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--size", type=int, default=None, help="image side (default 224 on cuda, 64 on cpu)")
    a = ap.parse_args()

    try:
        import torchvision
    except ImportError:
        sys.exit("tv_resnet50.py needs the `torchvision` package, which is not installed (pip install torchvision)")

    torch.manual_seed(0)
    dtype, batch = (torch.bfloat16, 32) if a.device == "cuda" else (torch.float32, 2)
    size = a.size or (224 if a.device == "cuda" else 64)
    model = torchvision.models.resnet50(weights=None)
    model = model.to(a.device, dtype, memory_format=torch.channels_last).eval()
    x = torch.randn(batch, 3, size, size, device=a.device, dtype=dtype).to(memory_format=torch.channels_last)
    with torch.inference_mode():
        for _ in range(a.iters):
            y = model(x)
    if a.device == "cuda":
        torch.cuda.synchronize()
    print(f"tv_resnet50: {a.iters} iterations on {a.device}, output {tuple(y.shape)} {y.dtype}")


if __name__ == "__main__":
    main()
