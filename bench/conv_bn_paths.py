"""Eval conv + BatchNorm (+ ReLU, + residual) on the GPU: which path is fastest (issue 16, "take what Inductor takes").

For ResNet-50's conv shapes (bf16, channels_last, batch 128 by default), each path timed with
`triton.testing.do_bench` after warm-up, the paths interleaved over rounds, on random data:
  eager        conv2d -> batch_norm (eval) -> relu_ [-> add_ -> relu_]     what the model runs
  one_pass     conv2d -> one fused pointwise kernel (Inductor's default, and the advisor's BatchNorm + ReLU kernel)
  folded       BatchNorm folded into the conv's weight and bias: conv2d(x, w', b') -> relu
  cudnn_fused  folded weights, cuDNN's fused conv + bias + ReLU (+ add): torch.cudnn_convolution_relu / _add_relu
Each path's kernels per call (torch.profiler) and its max error against eager in fp32 are printed beside it.

    python3 bench/conv_bn_paths.py [--batch 128] [--out reports/conv_bn_paths.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

# (name, in channels, out channels, kernel, stride, input side, residual after): ResNet-50's distinct conv shapes
SHAPES = [
    ("layer1 1x1 reduce", 256, 64, 1, 1, 56, False),
    ("layer1 3x3", 64, 64, 3, 1, 56, False),
    ("layer1 1x1 expand + residual", 64, 256, 1, 1, 56, True),
    ("layer2 3x3", 128, 128, 3, 1, 28, False),
    ("layer3 1x1 expand + residual", 256, 1024, 1, 1, 14, True),
    ("layer4 3x3", 512, 512, 3, 1, 7, False),
]


def fold(conv_w, conv_b, bn: torch.nn.BatchNorm2d):
    """w' = w * g / sqrt(var + eps) per output channel; b' = (b - mean) * g / sqrt(var + eps) + beta."""
    scale = bn.weight.float() * torch.rsqrt(bn.running_var.float() + bn.eps)
    w = (conv_w.float() * scale.view(-1, 1, 1, 1)).to(conv_w.dtype).contiguous(memory_format=torch.channels_last)
    b = conv_b.float() if conv_b is not None else torch.zeros_like(scale)
    b = ((b - bn.running_mean.float()) * scale + bn.bias.float()).to(conv_w.dtype)
    return w, b, scale


def paths(conv: torch.nn.Conv2d, bn: torch.nn.BatchNorm2d, residual: bool):
    w, b, scale = fold(conv.weight, conv.bias, bn)
    shift = (bn.bias.float() - bn.running_mean.float() * scale)
    s4, t4 = scale.view(1, -1, 1, 1).to(w.dtype), shift.view(1, -1, 1, 1).to(w.dtype)
    st, pd, dl, gr = conv.stride, conv.padding, conv.dilation, conv.groups

    if residual:
        def eager(x, z):
            y = bn(conv(x))
            y += z
            return torch.relu_(y)
        point = torch.compile(lambda y, z: torch.relu(y * s4 + t4 + z))
        def one_pass(x, z):
            return point(conv(x), z)
        def folded(x, z):
            return torch.relu_(F.conv2d(x, w, b, st, pd, dl, gr) + z)
        def cudnn_fused(x, z):
            return torch.cudnn_convolution_add_relu(x, w, z, 1.0, b, st, pd, dl, gr)
    else:
        def eager(x, z):
            return torch.relu_(bn(conv(x)))
        point = torch.compile(lambda y: torch.relu(y * s4 + t4))
        def one_pass(x, z):
            return point(conv(x))
        def folded(x, z):
            return torch.relu_(F.conv2d(x, w, b, st, pd, dl, gr))
        def cudnn_fused(x, z):
            return torch.cudnn_convolution_relu(x, w, b, st, pd, dl, gr)
    return {"eager": eager, "one_pass": one_pass, "folded": folded, "cudnn_fused": cudnn_fused}


def kernels_per_call(fn, *args) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("conv_bn_paths: needs a CUDA GPU", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    torch.manual_seed(0)
    results = []
    for name, cin, cout, k, stride, side, residual in SHAPES:
        conv = torch.nn.Conv2d(cin, cout, k, stride, k // 2, bias=False)
        bn = torch.nn.BatchNorm2d(cout)
        with torch.no_grad():
            bn.running_mean.normal_(0, 0.1)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.normal_(1, 0.1)
            bn.bias.normal_(0, 0.1)
        row = {"shape": name, "batch": args.batch, "cin": cin, "cout": cout, "k": k, "side": side, "residual": residual}
        try:
            ref = {}
            for dtype in (torch.float32, torch.bfloat16):
                c = conv.to("cuda", dtype).to(memory_format=torch.channels_last).eval()
                b = bn.to("cuda", dtype).eval()
                x = torch.randn(args.batch, cin, side, side, device="cuda", dtype=dtype).to(
                    memory_format=torch.channels_last)
                z = torch.randn(args.batch, cout, side // stride, side // stride, device="cuda", dtype=dtype).to(
                    memory_format=torch.channels_last) if residual else None
                with torch.no_grad():
                    fns = paths(c, b, residual)
                    if dtype == torch.float32:
                        want = fns["eager"](x, z.clone() if z is not None else None)
                        for p, fn in fns.items():
                            try:
                                got = fn(x, z.clone() if z is not None else None)
                                ref[p] = float((got - want).abs().max() / want.abs().max())
                            except Exception as e:  # noqa: BLE001 - a path cuDNN cannot run is a result
                                ref[p] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                        continue
                    times = {p: [] for p in fns}
                    ok = {p: fn for p, fn in fns.items() if not isinstance(ref.get(p), str)}
                    for p, fn in ok.items():
                        fn(x, z.clone() if z is not None else None)
                    for _ in range(args.rounds):
                        for p, fn in ok.items():
                            zz = z.clone() if z is not None else None  # eager's add_ writes into z's copy
                            times[p].append(do_bench(lambda: fn(x, zz), warmup=10, rep=40))
                    row["paths"] = {p: {"ms": statistics.median(times[p]) if times[p] else None,
                                        "spread_ms": (max(times[p]) - min(times[p])) if times[p] else None,
                                        "kernels": kernels_per_call(fns[p], x, z.clone() if z is not None else None)
                                        if p in ok else None,
                                        "fp32_max_rel_err_or_error": ref.get(p)} for p in fns}
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"
        results.append(row)
        print(json.dumps(row), flush=True)
    print("\n| shape | " + " | ".join(["eager", "one_pass", "folded", "cudnn_fused"]) + " |")
    print("|---|---|---|---|---|")
    for r in results:
        cells = []
        for p in ("eager", "one_pass", "folded", "cudnn_fused"):
            d = (r.get("paths") or {}).get(p) or {}
            cells.append(f"{d['ms']:.3f} ms ({d['kernels']} k)" if d.get("ms") else str(d.get("fp32_max_rel_err_or_error")))
        print(f"| {r['shape']} | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "results": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
