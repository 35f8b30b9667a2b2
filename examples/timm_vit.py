"""timm vit_base_patch16_224 with depth=2 (random weights), forward pass.

cuda: bf16, batch 32 at 224x224; cpu: fp32, batch 2. Needs `timm` (imported lazily).
Usage: python examples/timm_vit.py [--device cuda|cpu] [--iters 3] [--depth N]
"""
import argparse
import os
import sys

import torch


def main():
    default_device = os.environ.get("FUSION_ADVISOR_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    ap = argparse.ArgumentParser(description="timm ViT-B/16 forward")
    ap.add_argument("--device", default=default_device, choices=["cuda", "cpu"])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--depth", type=int, default=2)
    a = ap.parse_args()

    try:
        import timm
    except ImportError:
        sys.exit("timm_vit.py needs the `timm` package, which is not installed (pip install timm)")

    torch.manual_seed(0)
    dtype, batch = (torch.bfloat16, 32) if a.device == "cuda" else (torch.float32, 2)
    model = timm.create_model("vit_base_patch16_224", pretrained=False, depth=a.depth)
    model = model.to(a.device, dtype).eval()
    x = torch.randn(batch, 3, 224, 224, device=a.device, dtype=dtype)
    with torch.inference_mode():
        for _ in range(a.iters):
            y = model(x)
    if a.device == "cuda":
        torch.cuda.synchronize()
    print(f"timm_vit: {a.iters} iterations on {a.device}, output {tuple(y.shape)} {y.dtype}")


if __name__ == "__main__":
    main()
