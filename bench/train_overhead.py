"""What the fused training path costs on the host, beyond eager's own per step (issue 19), on the CPU.

    PYTHONPATH=$PWD python3 bench/train_overhead.py [--layers 2] [--steps 20] [--profile DIR]

A tiny HF Llama (bench/workloads.py's quick config, `--layers` decoder layers) trained with AdamW, once
unpatched and once after `advisor.optimize(train=True, interpret=True, select=False)`. In the patched
model every fused kernel is replaced by its reference ops (the site's original ops for the forward, the
derived backward program replayed with torch ops for the backward: `fake_kernels`), so both runs do the
same arithmetic with the same ATen kernels and the difference is the training path's own cost: the
dynamo guard check and the captured graph run op by op from Python, each site's guard, the autograd
Function, the saved tensors, the backward's argument handling and `sum_to_size`. Steps alternate between
the two models (same inputs), median and min per step, on one thread (`--threads`). `--profile DIR`: a cProfile of the patched steps
(DIR/eager.prof, DIR/patched.prof) and torch.profiler op counts of one step of each (DIR/ops.txt).

The CPU step is a proxy only: on a GPU the same host work overlaps kernels that take longer.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


KERNEL_S = [0.0]  # seconds spent in the reference ops standing in for the kernels


def _timed(fn):
    def run(*args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            KERNEL_S[0] += time.perf_counter() - t0
    return run


def fake_kernels() -> None:
    """Sites and backwards run reference torch ops instead of interpreted Triton kernels (seconds each);
    their time is counted in KERNEL_S (a GPU runs one kernel there, whose launch is all the host pays)."""
    from advisor.patching import autograd, rewrite
    from advisor.patching.program import run_program

    rewrite.Site.launch = lambda self, xs: _timed(self.fallback)(*xs)

    class Reference:
        def __init__(self, program):
            self.program = program
            self.run = _timed(lambda *args: run_program(self.program, args))

    for bw in autograd._BACKWARDS.values():
        if bw.validated and bw.module is not None and not isinstance(bw.module, Reference):
            bw.module = Reference(bw.derived.program)


def step(model, ids, opt):
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile", type=Path)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: least sensitive to other load)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    import advisor
    from transformers import LlamaConfig, LlamaForCausalLM

    from advisor.patching import autograd, rewrite, timing

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=a.layers, num_attention_heads=4, intermediate_size=128,
                      vocab_size=256, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    eager = LlamaForCausalLM(cfg)
    patched = copy.deepcopy(eager)
    ids = torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        report = advisor.optimize(patched, {"input_ids": ids, "use_cache": False}, interpret=True, train=True,
                                  select=False, reuse=False, out=Path("/tmp/train_overhead"))
        print(f"optimize {time.perf_counter() - t0:.1f} s; patched: {[r['title'] for r in report.applied]}")
    opts = {}
    for name, m in (("eager", eager), ("patched", patched)):
        m.train().requires_grad_(True)
        opts[name] = torch.optim.AdamW(m.parameters(), lr=1e-4)
    t0 = time.perf_counter()
    step(patched, ids, opts["patched"])  # derives and validates the backwards (interpreted kernels)
    print(f"first patched step (backwards derived and validated) {time.perf_counter() - t0:.1f} s")
    fake_kernels()
    times = {"eager": [], "patched": []}
    for _ in range(3):  # warm-up
        for name, m in (("eager", eager), ("patched", patched)):
            step(m, ids, opts[name])
    runs0, phases0 = rewrite.fused_runs(), timing.snapshot()
    kernel_ms = []
    for _ in range(a.steps):
        for name, m in (("eager", eager), ("patched", patched)):
            KERNEL_S[0] = 0.0
            t0 = time.perf_counter()
            step(m, ids, opts[name])
            times[name].append((time.perf_counter() - t0) * 1e3)
        kernel_ms.append(KERNEL_S[0] * 1e3)
    fused = (rewrite.fused_runs() - runs0) / a.steps
    e, q, k = statistics.median(times["eager"]), statistics.median(times["patched"]), statistics.median(kernel_ms)
    print(f"per step (median of {a.steps}): eager {e:.2f} ms, patched {q:.2f} ms ({q - e:+.2f} ms, "
          f"{q / e:.2f}x), of which reference ops standing in for the kernels {k:.2f} ms; "
          f"fused site calls per step {fused:.0f}")
    e, q, k = min(times["eager"]), min(times["patched"]), min(kernel_ms)
    print(f"per step (min of {a.steps}): eager {e:.2f} ms, patched {q:.2f} ms ({q - e:+.2f} ms), "
          f"reference ops {k:.2f} ms")
    moved = {k: v for k, v in timing.since(phases0).items() if k in ("captures", "rewrites", "dynamo", "backend")}
    print(f"dynamo captures / rewrites during the timed steps: {moved or 'none'}")
    for b in autograd.summary():
        print(f"  {b['pattern'][:70]}: validated {b['validated']}, launches {b['launches']}"
              + (f" ({b['reason'][:100]})" if b["reason"] else ""))
    print("fallbacks", report.handle.fallbacks())
    if a.profile:
        a.profile.mkdir(parents=True, exist_ok=True)
        for name, m in (("eager", eager), ("patched", patched)):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.steps):
                step(m, ids, opts[name])
            prof.disable()
            prof.dump_stats(a.profile / f"{name}.prof")
        lines = []
        for name, m in (("eager", eager), ("patched", patched)):
            with torch.profiler.profile() as tp:
                step(m, ids, opts[name])
            counts = {}
            for ev in tp.events():
                if ev.name.startswith("aten::"):
                    counts[ev.name] = counts.get(ev.name, 0) + 1
            lines.append(f"== {name}: {sum(counts.values())} aten ops")
            lines += [f"{n:6d} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])[:40]]
        (a.profile / "ops.txt").write_text("\n".join(lines))
        print(f"profile: {a.profile}/eager.prof, patched.prof, ops.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
