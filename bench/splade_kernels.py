"""The SPLADE head's training kernels alone (advisor/kernels/splade_head.py) on a GPU, against eager and
torch.compile of the same head, and a sweep of each kernel's tiles (to set the launch heuristics).

    PYTHONPATH=$PWD python3 bench/splade_kernels.py --out $OUT/splade-kernels      # ~1-2 min on an H100
    PYTHONPATH=$PWD python3 bench/splade_kernels.py --smoke --out /tmp/sk   # CPU: interpreter, tiny shape, no compile

The head: logits = hidden (B x L x D) @ W^T + bias, out = amax_L(log1p(relu(logits)) * mask); one
step = forward + backward of out.float().mean(0).pow(2).sum() (SPLADE's FLOPS regulariser), gradients of
hidden, W and bias. Times: median of CUDA-event timings after warm-up; peak extra MB: the peak allocated
during a step minus what was allocated when it began. Writes OUT.json and OUT.md, printing the table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn, warmup=3, reps=10):
    import torch

    if not torch.cuda.is_available():  # --smoke: checks the script runs, the times mean nothing
        t0 = time.perf_counter()
        fn()
        return round((time.perf_counter() - t0) * 1e3, 3)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return round(statistics.median(times), 3)


def peak_extra_mb(fn):
    import torch

    if not torch.cuda.is_available():
        return None
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("reports/splade-kernels-h100"))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--smoke", action="store_true", help="CPU smoke run: Triton's interpreter, B=2 L=19 D=24 V=37")
    a = p.parse_args(argv)

    import torch

    import advisor  # noqa: F401  (sets the interpreter up where there is no GPU: this bench needs one)
    from advisor.kernels import splade_head as sh

    if not torch.cuda.is_available() and not a.smoke:
        print("splade_kernels: needs a GPU (--smoke runs it on the CPU, tiny)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    B, L, D, V = (2, 19, 24, 37) if a.smoke else (a.batch, a.seq, a.hidden, a.vocab)
    dt, dev = torch.bfloat16, "cpu" if a.smoke else "cuda"
    hidden = torch.randn(B, L, D, device=dev, dtype=dt, requires_grad=True)
    weight = (torch.randn(V, D, device=dev) / D ** 0.5).to(dt).requires_grad_()
    bias = torch.zeros(V, device=dev, dtype=dt, requires_grad=True)
    mask = (torch.rand(B, L, device=dev) > 0.2).to(dt)[..., None]
    params = [hidden, weight, bias]

    def step(head):
        def run():
            loss = head(hidden, weight, bias, mask).float().mean(0).pow(2).sum()
            loss.backward()
            for t in params:
                t.grad = None
        return run

    rows = []
    compiled = sh.splade_head_reference if a.smoke else torch.compile(sh.splade_head_reference)
    for name, head in (("eager", sh.splade_head_reference), ("torch.compile", compiled),
                       ("SpladeHeadFunction", sh.SpladeHeadFunction.apply)):
        rows.append({"what": name, "step_ms": timed(step(head)), "peak_extra_mb": peak_extra_mb(step(head))})
        print(rows[-1], flush=True)

    # the kernels alone, and their tiles
    out, winner, slope = sh.splade_head_forward(hidden.detach(), weight.detach(), bias.detach(), mask)
    g = torch.randn(B, V, device=dev, dtype=dt)
    parts = {"forward": lambda: sh.splade_head_forward(hidden.detach(), weight.detach(), bias.detach(), mask),
             "dweight+dbias": lambda: sh.splade_head_backward(g, hidden, weight, winner, slope, (False, True, True)),
             "dhidden": lambda: sh.splade_head_backward(g, hidden, weight, winner, slope, (True, False, False))}
    for name, fn in parts.items():
        rows.append({"what": f"kernel: {name}", "step_ms": timed(fn)})
        print(rows[-1], flush=True)
    sweeps = {
        "forward_config": [dict(BLOCK_L=bl, BLOCK_V=bv, BLOCK_D=bd, num_warps=w, num_stages=s)
                           for bl, bv, bd, w, s in [(64, 128, 64, 8, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3),
                                                    (64, 256, 64, 8, 3), (128, 64, 64, 4, 3), (64, 128, 32, 4, 4),
                                                    (32, 128, 64, 4, 4)]],
        # BUCKETED False: every column for every sequence tile (L / BLOCK_L times the multiply-adds), for comparison
        "dhidden_config": [dict(BLOCK_L=bl, BLOCK_V=bv, BLOCK_D=bd, num_warps=w, num_stages=s, BUCKETED=k)
                           for bl, bv, bd, w, s, k in [(64, 64, 128, 4, 3, True), (64, 64, 128, 4, 3, False),
                                                       (64, 64, 128, 8, 3, True), (128, 64, 128, 8, 3, True),
                                                       (64, 128, 128, 8, 3, True), (128, 128, 64, 8, 3, True),
                                                       (64, 32, 256, 8, 3, True), (32, 64, 128, 4, 3, True)]],
        "dweight_config": [dict(BLOCK_V=bv, BLOCK_D=bd, num_warps=w, num_stages=s)
                           for bv, bd, w, s in [(64, 128, 8, 2), (32, 128, 4, 2), (64, 64, 4, 2), (128, 128, 8, 2),
                                                (32, 256, 8, 2)]],
    }
    part_of = {"forward_config": "forward", "dhidden_config": "dhidden", "dweight_config": "dweight+dbias"}
    for attr, configs in sweeps.items():
        default = getattr(sh, attr)
        for cfg in configs:
            setattr(sh, attr, lambda *_, cfg=cfg: cfg)
            try:
                ms = timed(parts[part_of[attr]])
            except Exception as e:  # a tile that does not fit (shared memory, registers) is reported, not fatal
                ms = f"failed: {type(e).__name__}"
            rows.append({"what": f"{attr} {cfg}", "step_ms": ms})
            print(rows[-1], flush=True)
        setattr(sh, attr, default)

    doc = {"device": torch.cuda.get_device_name() if not a.smoke else "cpu (smoke)", "torch": torch.__version__,
           "shape": [B, L, D, V], "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    table = ["| what | ms | peak extra MB |", "|---|---|---|"] + \
        [f"| {r['what']} | {r['step_ms']} | {r.get('peak_extra_mb', '')} |" for r in rows]
    md = [f"# SPLADE head training kernels ({doc['device']}, B={B} L={L} D={D} V={V}, bf16)", "", *table, ""]
    a.out.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
