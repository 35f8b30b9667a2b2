"""Linear + cross-entropy (`advisor.kernels.linear_cross_entropy`) at several chunk sizes against eager's
linear + fp32 cross-entropy: forward + backward time (triton.testing.do_bench, interleaved by repeating the
list) and the memory the step adds, per LM-head shape (issue 19: the chunk size trades the weight
gradient's per-chunk accumulation, 4·V·D bytes a chunk, against the chunk's logits buffer).

    PYTHONPATH=$PWD python3 bench/lce_chunks.py --out reports/lce-chunks-h100.json     # GPU
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SHAPES = {"llama (suite)": (4096, 2048, 32000), "gpt2 (suite)": (8192, 1024, 50257),
          "llama-3 vocab": (4096, 2048, 128256)}
CHUNKS = (256, 512, 1024, 2048, 4096)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    import torch
    import triton.testing

    from advisor.kernels import linear_cross_entropy as lce

    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    rows = []
    original = lce.chunk_rows
    for name, (N, D, V) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        hidden = (torch.randn(N, D, device="cuda", generator=g) / 2).bfloat16().requires_grad_()
        weight = (torch.randn(V, D, device="cuda", generator=g) / D ** 0.5).bfloat16().requires_grad_()
        labels = torch.randint(0, V, (N,), device="cuda", generator=g)

        def eager():
            loss = lce.linear_cross_entropy_reference(hidden, weight, None, labels)
            loss.backward()

        def fused(c):
            def run():
                lce.chunk_rows = lambda n, v, d: min(n, c)
                try:
                    loss = lce.LinearCrossEntropyFunction.apply(hidden, weight, None, labels)
                finally:
                    lce.chunk_rows = original
                loss.backward()
            return run

        variants = {"eager": eager, **{f"chunk {c}": fused(c) for c in CHUNKS if c <= N},
                    "default": lambda: lce.LinearCrossEntropyFunction.apply(hidden, weight, None, labels).backward()}
        times: dict = {k: [] for k in variants}
        mem: dict = {}
        for _ in range(a.repeats):
            for k, fn in variants.items():
                hidden.grad = weight.grad = None
                times[k].append(triton.testing.do_bench(fn, warmup=5, rep=40))
        for k, fn in variants.items():
            hidden.grad = weight.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            mem[k] = (torch.cuda.max_memory_allocated() - base) / 2**20
        default_rows = original(N, V, D)
        for k in variants:
            rows.append({"shape": name, "N": N, "D": D, "V": V, "variant": k, "ms": round(min(times[k]), 4),
                         "ms_repeats": [round(t, 4) for t in times[k]], "extra_mb": round(mem[k], 1),
                         "default_chunk_rows": default_rows})
            print(f"{name:16s} {k:12s} {min(times[k]):8.3f} ms  {mem[k]:8.1f} MB", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                 "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
