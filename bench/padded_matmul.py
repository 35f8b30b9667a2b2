"""An LM head whose vocabulary is not a multiple of 8 (bf16): eager's unaligned cuBLAS kernel against the
padded launcher `advisor.optimize` patches in (`padded_matmul` candidates, advisor/codegen/padded.py).

GPT-2's head (tokens 8192 = batch 8 x 1024, K = 1024, N = 50257) ran cuBLAS's
`cutlass_75_..._align1` kernel for 8.7 ms on the H100; Inductor pads the weight (68 µs) and runs
`nvjet_sm90` (1.14 ms), returning a strided slice of the padded logits. Per head shape this times:
eager `linear`; the generated launcher (pad, GEMM, the first N columns as a strided view, as Inductor);
the same slice written by hand; the launcher's result copied out into eager's layout (what that layout
costs); the generator's Triton GEMM writing eager's layout directly (masked stores at the odd row
stride); and torch.compile. Each names its kernels and its error against an fp32 reference; the
launcher is validated as `optimize` does.

    python3 bench/padded_matmul.py --out OUT.json      # on a GPU, about a minute
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from addmm_paths import kernel_names  # noqa: E402  (bench/ beside it)

HEADS = {  # name: (tokens, K, N, bias)
    "gpt2 lm_head (suite)": (8192, 1024, 50257, False),
    "bert mlm decoder": (8192, 768, 30522, True),
    "roberta lm_head": (8192, 768, 50265, True),
}

def linear_program(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> dict:
    """The analyzer's program of one `aten::linear` (what analysis.json holds for an LM head)."""
    from advisor.ops.args import NONE  # how a trace writes an absent optional argument

    def spec(i, t):
        return {"id": f"in{i}", "shape": list(t.shape), "strides": list(t.stride()), "dtype": str(t.dtype)[6:],
                "storage_offset": 0}

    ts = [x, w] + ([b] if b is not None else [])
    inputs = [spec(i, t) for i, t in enumerate(ts)]
    args = [{"ref": s["id"], "shape": s["shape"], "strides": s["strides"], "storage_offset": 0} for s in inputs]
    out_shape = list(x.shape[:-1]) + [w.shape[0]]
    out_strides = [int(torch.tensor(out_shape[d + 1:]).prod()) for d in range(len(out_shape))]
    node = {"id": "n0", "op": "aten::linear", "schema": "aten::linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor",
            "args": args + ([] if b is not None else [{"value": NONE}]),
            "outputs": [{"id": "v0", "shape": out_shape, "strides": out_strides, "dtype": str(x.dtype)[6:]}],
            "inplace": False}
    return {"inputs": inputs, "nodes": [node], "outputs": ["v0"]}


def main() -> None:
    from triton.testing import do_bench

    from advisor.codegen import load_module
    from advisor.codegen.anchored import generate_anchored
    from advisor.validate import validate

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dt = torch.bfloat16
    rows = []
    for head, (m, k, n, has_bias) in HEADS.items():
        torch.manual_seed(0)
        x = torch.randn(8, m // 8, k, device="cuda", dtype=dt)
        w = torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
        b = torch.randn(n, device="cuda", dtype=dt) if has_bias else None
        gen = generate_anchored(linear_program(x, w, b), "padded_matmul", use_cache=False)
        mod = load_module(gen.path)
        check = validate(gen, mod, memo=False)
        n_p = -(-n // 8) * 8
        operands = (x, w) + ((b,) if b is not None else ())

        def strided_slice():  # Inductor's result: the padded logits' first N columns, row stride N_padded
            w_p = F.pad(w, (0, 0, 0, n_p - n))
            return F.linear(x, w_p, None if b is None else F.pad(b, (0, n_p - n)))[..., :n]

        direct = load_module(generate_anchored(linear_program(x, w, b), "epilogue", use_cache=False).path)
        compiled = torch.compile(lambda x, w, b: F.linear(x, w, b), dynamic=False)
        ways = {"eager linear": lambda: F.linear(x, w, b), "padded launcher (strided view)": lambda: mod.run(*operands)[0],
                "padded, strided slice (no copy)": strided_slice,
                "padded, copied out in eager's layout": lambda: mod.run(*operands)[0].contiguous(),
                "Triton GEMM into eager's layout (generated, tuned)": lambda: direct.run(*operands)[0],
                "torch.compile": lambda: compiled(x, w, b)}
        ref = F.linear(x.float(), w.float(), None if b is None else b.float())
        for way, fn in ways.items():
            out = fn()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            ms = do_bench(fn, warmup=10, rep=50, return_mode="median")
            row = {"head": head, "tokens": m, "k": k, "n": n, "bias": has_bias, "way": way, "ms": round(ms, 4),
                   "rel_err": err, "stride": list(out.stride()), "kernels": kernel_names(fn),
                   "launcher_validated": check.validated, "validation_reason": check.reason}
            rows.append(row)
            print(f"{head:22s} {way:34s} {ms:8.3f} ms  err {err:.1e}  {' | '.join(row['kernels'])[:150]}", flush=True)
        x = w = b = ref = None  # not `del`: the lambdas above close over them; rebound, the tensors go all the same
        torch.cuda.empty_cache()
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
