"""Attention under a padding mask on a GPU: what a decoder LLM's layer runs at the sizes users run (4 x 1024 tokens, one
left-padded row, 16 heads of 128, bf16) when HF hands SDPA a 4-D mask, against the kernels that could run it.

- `sdpa_bool_mask` / `sdpa_additive_mask`: `scaled_dot_product_attention` with the mask (flash cannot take one:
  PyTorch picks another backend, which computes every block, masked or not);
- `sdpa_causal`: `is_causal=True`, no mask (flash; wrong for the padded row: the floor, not a candidate);
- `flex_block_mask`: `flex_attention` (compiled) with a block mask made from the same mask tensor on every call
  (`create_block_mask` included: the mask changes with the batch), which skips the blocks the mask removes;
- `flex_block_mask_given`: the same with the block mask made once (its cost left out).
Medians of `triton.testing.do_bench`; the backend SDPA picked for the mask is read from the profiler.

    python -m bench.attention_mask --out reports/kernels/attention-mask
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--padded", type=int, default=100, help="left padding of the first row")
    p.add_argument("--out", type=Path, default=Path("reports/kernels/attention-mask"))
    a = p.parse_args(argv)
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from triton.testing import do_bench

    B, H, S, D = a.batch, a.heads, a.seq, a.head_dim
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    keep = torch.ones(B, S, dtype=torch.bool, device="cuda")
    keep[0, :a.padded] = False
    causal = torch.ones(S, S, dtype=torch.bool, device="cuda").tril()
    mask = causal[None, None] & keep[:, None, None, :]
    mask |= ~mask.any(-1, keepdim=True)  # a padded query row sees every key (as HF's SDPA mask does: no NaN rows)
    additive = torch.zeros(mask.shape, dtype=torch.bfloat16, device="cuda").masked_fill(~mask, float("-inf"))

    def mask_mod(b, h, qi, ki):
        return mask[b, 0, qi, ki]

    flex = torch.compile(flex_attention)
    made = torch.compile(create_block_mask)

    def flex_fresh():
        bm = made(mask_mod, B, 1, S, S, device="cuda")
        return flex(q, k, v, block_mask=bm)

    given = create_block_mask(mask_mod, B, 1, S, S, device="cuda")
    ways = {
        "sdpa_bool_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "sdpa_additive_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=additive),
        "sdpa_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "flex_block_mask": flex_fresh,
        "flex_block_mask_given": lambda: flex(q, k, v, block_mask=given),
    }
    ref = ways["sdpa_bool_mask"]().float()
    res = {"shape": [B, H, S, D], "padded": a.padded, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "ms": {}, "max_abs_err_vs_sdpa_bool_mask": {}, "kernels": {}}
    for name, fn in ways.items():
        out = fn()
        torch.cuda.synchronize()
        res["max_abs_err_vs_sdpa_bool_mask"][name] = float((out.float() - ref).abs().max())
        res["ms"][name] = round(do_bench(fn, warmup=25, rep=200), 4)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        res["kernels"][name] = sorted({e.name[:100] for e in prof.events() if e.device_type.name == "CUDA"})
        print(name, res["ms"][name], "ms", res["kernels"][name][:3], flush=True)
    flops = 4 * B * H * S * S * D  # both products over every block, masked or not
    res["tflops_dense_equivalent"] = {n: round(flops / (ms * 1e-3) / 1e12, 1) for n, ms in res["ms"].items()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res["ms"]), json.dumps(res["tflops_dense_equivalent"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
