"""Serving-style forwards on a GPU: 200 requests at batch 1-32 and lengths 16-2,048 drawn at random (fixed seed),
each a prefill (`model(input_ids=ids, logits_to_keep=1)`), for the untouched model, `advisor.optimize` (at one
shape, its defaults: shapes past the capture budget run Inductor's dynamic-shape compile), `advisor.optimize(...,
dynamic=False)` (those shapes run the original ops) and `torch.compile(dynamic=True)`, one process. A warm-up pass
over every request (compile's recompiles, our captures), then a timed pass: per request, each way once in turn (CUDA events). Total and p99
latency per way, the advisor's calls that ran unfused (its fallbacks counted over the timed pass) and those its
dynamic-shape compile ran.

    python -m bench.serving --out reports/serving/serving
"""
from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from pathlib import Path

from bench.common import write_report
from bench.decode import build  # the decode benchmark's models and sizes


def requests(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(1, 32), rng.randint(16, 2048)) for _ in range(n)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16384, help="batch x length at most (memory)")
    p.add_argument("--out", type=Path, default=Path("reports/serving/serving"))
    a = p.parse_args(argv)
    import torch

    import advisor
    from bench.common import process_warmup

    torch.manual_seed(0)
    process_warmup("cuda")
    model, ids = build(a.model, 8, 512)
    untouched, to_compile, static = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    t0 = time.perf_counter()
    report = advisor.optimize(model, {"input_ids": ids, "logits_to_keep": 1})
    setup_s = time.perf_counter() - t0
    advisor.optimize(static, {"input_ids": ids, "logits_to_keep": 1}, dynamic=False)
    compiled = torch.compile(to_compile, dynamic=True)
    ways = {"eager": untouched, "advisor": model, "advisor_no_dynamic": static, "compile_dynamic": compiled}
    reqs = [(b, min(n, a.max_tokens // b)) for b, n in requests(a.requests)]
    inputs = [torch.randint(1, 32000, shape, device="cuda") for shape in reqs]

    def call(m, x):
        with torch.no_grad():
            return m(input_ids=x, logits_to_keep=1).logits

    warm = {}
    for name, m in ways.items():
        t0 = time.perf_counter()
        for x in inputs:
            call(m, x)
        torch.cuda.synchronize()
        warm[name] = round(time.perf_counter() - t0, 2)
    fallbacks_before, dynamic_before = report.handle.fallbacks(), report.handle.any_shape_calls()
    times = {name: [] for name in ways}
    for x in inputs:
        for name, m in ways.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call(m, x)
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    after = report.handle.fallbacks()
    unfused = {mod: {why: n - fallbacks_before.get(mod, {}).get(why, 0) for why, n in whys.items()}
               for mod, whys in after.items()}
    dynamic = {mod: n - dynamic_before.get(mod, 0) for mod, n in report.handle.any_shape_calls().items()}
    res = {"model": a.model, "requests": reqs, "optimized_at": [8, 512], "setup_s": round(setup_s, 2),
           "warm_pass_s": warm, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "per_way": {},
           "advisor_fallbacks_in_timed_pass": unfused, "advisor_dynamic_compile_calls_in_timed_pass": dynamic,
           "advisor_dynamic_compile_graphs": report.handle.any_shape_graphs(),
           "selection_route": (report.selection or {}).get("route"), "report": str(report)}
    for name, ts in times.items():
        s = sorted(ts)
        res["per_way"][name] = {"total_ms": round(sum(ts), 1), "p50_ms": round(s[len(s) // 2], 2),
                                "p99_ms": round(s[min(len(s) - 1, int(0.99 * len(s)))], 2)}
    lines = ["| way | total ms | p50 ms | p99 ms | warm-up pass s |", "|---|---|---|---|---|"]
    for name, r in res["per_way"].items():
        lines.append(f"| {name} | {r['total_ms']} | {r['p50_ms']} | {r['p99_ms']} | {warm[name]} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_report(a.out, res, "\n".join(lines) + "\n")
    print("\n".join(lines))
    print("advisor fallbacks in the timed pass:", unfused)
    print("advisor calls its dynamic-shape compile ran in the timed pass:", dynamic)
    return 0


if __name__ == "__main__":
    sys.exit(main())
