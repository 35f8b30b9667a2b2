"""Row kernels' index width on the GPU: 32-bit against 64-bit row decomposition (the `BIG_INDEX` switch).

    python bench/row_index_math.py --out reports/row-index-h100      # writes row_index.json and row_index.md

A row kernel splits each row's index into its dims by division to address inputs broadcast over some of them
(Swin's shifted-window softmax: scores + a per-head bias + a per-window mask). Until this benchmark the row
kernels always did it in 64 bits, which the GPU emulates; the packed softmax of Swin-T ran 2x eager's softmax
(reports/estimates-h100-session20). Per case: eager, the generated kernel with 64-bit and with 32-bit index math
(the launcher's `_int64_needed` forced each way), all in rounds interleaved, `triton.testing.do_bench` medians
(L2 cleared before each call), random data; the bytes the fused kernel must move (the scores read once, the
probabilities written once; the bias and mask are small) against the copy bandwidth measured in this run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.codegen import generate, load_module  # noqa: E402
from advisor.codegen.record import record_program  # noqa: E402
from advisor.validate import validate  # noqa: E402
from kernels import copy_bandwidth  # noqa: E402


def window_softmax(windows: int, heads: int, n: int):
    """timm's WindowAttention after q @ k^T: + relative position bias (per head), + shift mask (per window)."""
    def fn(s, b, m):
        s = (s + b.unsqueeze(0)).view(-1, windows, heads, n, n) + m.unsqueeze(1).unsqueeze(0)
        return torch.softmax(s.view(-1, heads, n, n), -1)
    return fn


# Swin-T at batch 32, bf16: stage 1 (64 windows of 49, 3 heads), stage 2 (16, 6), stage 3 (4, 12).
CASES = {"swin_t_stage1": (32, 64, 3, 49), "swin_t_stage2": (32, 16, 6, 49), "swin_t_stage3": (32, 4, 12, 49)}


def run_case(name: str, batch: int, windows: int, heads: int, n: int, bw: float, rounds: int) -> dict:
    from triton.testing import do_bench

    fn = window_softmax(windows, heads, n)
    dt, dev = torch.bfloat16, "cuda"
    scores = torch.randn(batch * windows, heads, n, n, device=dev, dtype=dt)
    bias = torch.randn(heads, n, n, device=dev, dtype=dt)
    mask = torch.randn(windows, n, n, device=dev, dtype=dt)
    args = (scores, bias, mask)
    gen = generate(record_program(fn, *args))
    mod = load_module(gen.path)
    v = validate(gen, mod)
    want = fn(*args)
    paths = {"eager": lambda: fn(*args)}
    for label, big in (("int64", True), ("int32", False)):
        mod._int64_needed = (lambda b: lambda *t: b)(big)
        torch.testing.assert_close(mod.run(*args)[0].float(), want.float(), atol=2e-2, rtol=2e-2)
        paths[label] = (lambda b: lambda: (setattr(mod, "_int64_needed", lambda *t: b), mod.run(*args)))(big)
    times = {k: [] for k in paths}
    for _ in range(rounds):
        for k, f in paths.items():
            times[k].append(do_bench(f, warmup=10, rep=50, return_mode="median") * 1e3)
    nbytes = 2 * scores.numel() * scores.element_size()
    med = {k: statistics.median(t) for k, t in times.items()}
    return {"case": name, "shape": [batch * windows, heads, n, n], "validated": v.validated, "rows": scores.numel() // n,
            "bytes": nbytes, "roofline_us": nbytes / bw * 1e6, "median_us": med,
            "rounds_us": times, "int32_speedup": med["int64"] / med["int32"], "vs_eager": med["eager"] / med["int32"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="reports/row-index-h100")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/row_index_math.py: needs a GPU (CUDA)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth()
    rows = [run_case(k, *v, bw=bw, rounds=a.rounds) for k, v in CASES.items()]
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth_Bps": bw, "cases": rows}
    (out / "row_index.json").write_text(json.dumps(doc, indent=1))
    lines = [f"# Row kernels: 32- vs 64-bit index math ({doc['device']}, torch {doc['torch']})", "",
             f"Copy bandwidth {bw / 1e12:.2f} TB/s (read + write). Medians of {a.rounds} interleaved rounds of "
             "`do_bench` (µs).", "",
             "| case | rows | roofline µs | eager µs | 64-bit µs | 32-bit µs | 64/32 | eager/32-bit |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["median_us"]
        lines.append(f"| {r['case']} | {r['rows']} | {r['roofline_us']:.1f} | {m['eager']:.1f} | {m['int64']:.1f} | "
                     f"{m['int32']:.1f} | {r['int32_speedup']:.2f} | {r['vs_eager']:.2f} |")
    (out / "row_index.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
