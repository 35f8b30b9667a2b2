"""Which cuBLAS path a `Linear`/`Conv1D` with a bias takes, and what each costs (issue 16: GPT-2's gap).

GPT-2's Conv1D computes `addmm(bias, x, W)` with W stored [in, out]; in eager bf16 on the H100 its
GEMMs ran a `cutlass_75` kernel (8.7 of 20 ms). This times, per GPT-2 shape, the ways of computing the
same product: addmm with the bias (cuBLASLt's bias epilogue), mm then a bias add, mm alone (the floor
for an epilogue fused into the GEMM), and the same with W stored [out, in] (nn.Linear's layout), and
names the kernel each launches. Data is random, not zeros; CUDA events through triton's do_bench.

    python3 bench/addmm_paths.py --out OUT.json      # on a GPU
"""
from __future__ import annotations

import argparse
import json

import torch


SHAPES = {"c_attn": (8192, 1024, 3072), "attn.c_proj": (8192, 1024, 1024), "c_fc": (8192, 1024, 4096),
          "mlp.c_proj": (8192, 4096, 1024)}  # (tokens, in, out) for the suite's GPT-2: batch 8 x 1024


def kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name[:80] for e in prof.events() if e.device_type.name == "CUDA"]


def main() -> None:
    from triton.testing import do_bench

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dt = torch.bfloat16
    rows = []
    for name, (m, k, n) in SHAPES.items():
        x = torch.randn(m, k, device="cuda", dtype=dt)
        w_kn = torch.randn(k, n, device="cuda", dtype=dt) / k ** 0.5  # Conv1D: [in, out]
        w_nk = w_kn.t().contiguous()  # nn.Linear: [out, in]
        b = torch.randn(n, device="cuda", dtype=dt)
        ways = {
            "addmm(b, x, W[in,out])": lambda: torch.addmm(b, x, w_kn),
            "mm(x, W[in,out]) + b": lambda: torch.mm(x, w_kn) + b,
            "mm(x, W[in,out])": lambda: torch.mm(x, w_kn),
            "linear(x, W[out,in], b)": lambda: torch.nn.functional.linear(x, w_nk, b),
            "mm(x, W[out,in].t()) + b": lambda: torch.mm(x, w_nk.t()) + b,
            "mm(x, W[out,in].t())": lambda: torch.mm(x, w_nk.t()),
        }
        ref = torch.addmm(b.float(), x.float(), w_kn.float())
        floor_us = 2 * m * k * n / 700e12 * 1e6  # at ~700 TFLOP/s dense bf16
        for way, fn in ways.items():
            out = fn()
            err = ((out.float() - ref).norm() / ref.norm()).item() if "+ b" in way or "b)" in way else None
            us = do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
            rows.append({"shape": name, "m": m, "k": k, "n": n, "way": way, "us": round(us, 1),
                         "floor_us": round(floor_us, 1), "rel_l2": err, "kernels": kernel_names(fn)})
            print(f"{name:12s} {way:28s} {us:8.1f} us  (floor {floor_us:6.1f})  {rows[-1]['kernels']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
