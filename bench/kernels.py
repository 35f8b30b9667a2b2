"""GPU benchmark of generated kernels against eager and torch.compile (issue 4's performance targets).

    python -m bench.kernels --out reports/kernels/kernels      # writes kernels_h100.md and kernels_h100.json

Every kernel is built by the generator from a recorded program (nothing here is hand-written Triton),
validated (advisor.validate) and checked against eager at the benchmark size before it is timed. Times
are `triton.testing.do_bench` medians (it clears the L2 before each call); bandwidth counts the bytes a
fused kernel must move (each input read once, each output written once) against the device-to-device
copy bandwidth measured in the same run. About 2-3 minutes on an H100, most of it torch.compile.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import triton  # noqa: E402
import triton.testing  # noqa: E402

from advisor.codegen import generate, load_module  # noqa: E402
from advisor.codegen.record import record_program  # noqa: E402
from advisor.validate import validate  # noqa: E402

F = torch.nn.functional
BF16 = torch.bfloat16


def rmsnorm(x, w):  # HF LlamaRMSNorm
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * h.to(x.dtype)


def bias_gelu_residual(x, b, r):
    return F.gelu(x + b, approximate="tanh") + r


# name, function, input shapes, dtype, target ("ms" absolute, or fraction of copy bandwidth)
CASES = [
    ("seed log(relu(x + b))", lambda x, b: torch.log(torch.relu(x + b)), [(1 << 28,), (1 << 28,)], torch.float32, ("ms", 1.15)),
    ("bias + GELU(tanh) + residual", bias_gelu_residual, [(8192, 8192), (8192,), (8192, 8192)], torch.float32, ("bw", 0.90)),
    ("SwiGLU silu(g) * u", lambda g, u: F.silu(g) * u, [(16384, 8192), (16384, 8192)], BF16, ("bw", 0.90)),
    ("row sum", lambda x: x.sum(-1), [(32768, 2048)], torch.float32, ("bw", 0.90)),
    ("row var", lambda x: x.var(-1), [(32768, 2048)], torch.float32, ("bw", 0.90)),
    ("RMSNorm rows of 4096", rmsnorm, [(32768, 4096), (4096,)], BF16, ("bw", 0.85)),
    ("softmax rows of 4096", lambda x: torch.softmax(x, -1), [(32768, 4096)], BF16, ("bw", 0.85)),
    ("LayerNorm rows of 4096", lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b), [(32768, 4096), (4096,), (4096,)], BF16, ("bw", 0.85)),
]
# Where the cost model's roofline is calibrated (no target: what fraction of copy bandwidth each shape reaches):
# short rows (Swin's 49-wide window softmax), wide rows over few programs (a UNet's GroupNorm: 128 rows of 40960),
# the zoo's LayerNorm widths, and pointwise kernels from 1 to 64 MB.
CALIBRATION = [
    *[(f"calibrate softmax rows of {n}", lambda x: torch.softmax(x, -1), [(rows, n)], BF16, ("bw", 0.0))
      for n, rows in [(49, 301056), (64, 262144), (128, 131072), (256, 65536), (1024, 16384)]],
    ("calibrate GroupNorm + SiLU 4x320x64x64 (32 groups)",
     lambda x, w, b: F.silu(F.group_norm(x, 32, w, b)), [(4, 320, 64, 64), (320,), (320,)], BF16, ("bw", 0.0)),
    ("calibrate GroupNorm + SiLU 4x640x32x32 (32 groups)",
     lambda x, w, b: F.silu(F.group_norm(x, 32, w, b)), [(4, 640, 32, 32), (640,), (640,)], BF16, ("bw", 0.0)),
    *[(f"calibrate LayerNorm rows of {n}", lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b),
       [(rows, n), (n,), (n,)], BF16, ("bw", 0.0)) for n, rows in [(384, 12608), (768, 8192), (1024, 2048)]],
    *[(f"calibrate SwiGLU silu(g) * u, {mb} MB", lambda g, u: F.silu(g) * u, [(mb * 256, 2048)] * 2, BF16, ("bw", 0.0))
      for mb in (1, 4, 16, 64)],
]


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * reps / (start.elapsed_time(end) / 1e3)


def fused_bytes(inputs, outputs) -> int:
    """Bytes a fused kernel must move: each input once (broadcast dims once), each output once."""
    def true(t):
        n = 1
        for size, stride in zip(t.shape, t.stride()):
            n *= size if stride else 1
        return n * t.element_size()
    return sum(true(t) for t in inputs) + sum(t.numel() * t.element_size() for t in outputs)


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def run_case(name, fn, shapes, dtype, target, copy_bw, compile_too=True):
    small = [torch.randn([min(s, 64) for s in sh], device="cuda").to(dtype) for sh in shapes]
    gen = generate(record_program(fn, *small))  # recorded at small sizes: kernels are size-generic
    mod = load_module(gen.path)
    check = validate(gen, mod)
    if not check.validated:
        return {"case": name, "error": f"did not validate: {check.reason}"}
    xs = [torch.randn(sh, device="cuda").to(dtype) for sh in shapes]
    fused_out = mod.run(*xs)
    eager_out = fn(*xs)
    eager_out = eager_out if isinstance(eager_out, tuple) else (eager_out,)
    for a, b in zip(fused_out, eager_out):
        tol = 2e-2 if dtype == BF16 else 1e-4
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol, equal_nan=True)
    t0 = time.time()
    compiled = torch.compile(fn) if compile_too else fn
    compiled(*xs)
    compile_s = time.time() - t0
    nbytes = fused_bytes(xs, fused_out)
    ms = {"fused": bench(lambda: mod.run(*xs)), "eager": bench(lambda: fn(*xs)),
          "compile": bench(lambda: compiled(*xs)) if compile_too else float("nan")}
    bw = nbytes / (ms["fused"] / 1e3)
    kind, goal = target
    met = ms["fused"] <= goal if kind == "ms" else bw / copy_bw >= goal
    return {"case": name, "shapes": [list(s) for s in shapes], "dtype": str(dtype)[6:], "bytes": nbytes,
            "fused_ms": ms["fused"], "eager_ms": ms["eager"], "compile_ms": ms["compile"], "compile_s": compile_s,
            "fused_Bps": bw, "copy_fraction": bw / copy_bw, "target": f"<= {goal} ms" if kind == "ms" else f">= {goal:.0%} of copy",
            "met": met, "kernel": gen.key, "validation": check.errors.get("rel_l2")}


def markdown(result) -> str:
    head = (f"# Generated kernels vs eager vs torch.compile\n\n{result['device']}, torch {result['torch']}, "
            f"triton {result['triton']}; device-to-device copy {result['copy_Bps'] / 1e12:.2f} TB/s "
            f"(read + write, 1 GiB, measured in this run). Median of `triton.testing.do_bench` (L2 cleared).\n\n"
            "| case | shape | dtype | fused ms | eager ms | compile ms | fused TB/s | of copy BW | target | met |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for r in result["cases"]:
        if "error" in r:
            rows.append(f"| {r['case']} | | | | | | | | | error: {r['error']} |")
            continue
        rows.append(f"| {r['case']} | {' '.join('x'.join(map(str, s)) for s in r['shapes'])} | {r['dtype']} | "
                    f"{r['fused_ms']:.3f} | {r['eager_ms']:.3f} | {r['compile_ms']:.3f} | {r['fused_Bps'] / 1e12:.2f} | "
                    f"{r['copy_fraction']:.1%} | {r['target']} | {'yes' if r['met'] else 'NO'} |")
    return head + "\n".join(rows) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="path stem: writes STEM.md and STEM.json")
    ap.add_argument("--only", default=None, help="run only cases whose name contains this")
    ap.add_argument("--calibrate", action="store_true", help="the cost model's calibration shapes instead")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile's column")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)
    results = []
    for case in CALIBRATION if a.calibrate else CASES:
        if a.only and a.only not in case[0]:
            continue
        try:
            r = run_case(*case, copy_bw, compile_too=not a.no_compile)
        except Exception as e:  # one broken case must not lose the others
            r = {"case": case[0], "error": f"{type(e).__name__}: {e}"[:300]}
        print(json.dumps({k: v for k, v in r.items() if k != "shapes"}), flush=True)
        results.append(r)
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "copy_Bps": copy_bw, "cases": results}
    stem = Path(a.out)
    stem = stem.with_suffix("") if stem.suffix in (".md", ".json") else stem
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
