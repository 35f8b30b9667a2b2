"""Forwards at shapes never profiled, on a GPU: `advisor.optimize` at one batch and length, then the user's
loop (`with torch.no_grad(): model(input_ids=ids)`) at others, against the untouched model and
`torch.compile` (default mode, which turns a recompiled dimension dynamic), each timed in the same process,
interleaved, after warm-up (CUDA events). Fused launches are counted per call at every shape.

    python -m bench.new_shapes --models llama,qwen2 --out reports/new-shapes/new_shapes
"""
from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.common import child_command, child_env, git_rev, load_results, write_report
from bench.decode import build  # same models and sizes as the decode benchmark

PROFILED = (4, 1024)
OTHERS = ((1, 512), (2, 1500))  # two new shapes: what a patched forward may capture after optimize


def child(name: str, result: Path, iters: int) -> int:
    import torch

    import advisor
    from bench.common import interleaved, process_warmup

    torch.manual_seed(0)
    process_warmup("cuda")
    model, ids = build(name, *PROFILED)
    untouched, to_compile = copy.deepcopy(model), copy.deepcopy(model)
    compiled = torch.compile(to_compile)
    report = advisor.optimize(model, {"input_ids": ids})
    res = {"model": name, "profiled": PROFILED, "report": str(report), "shapes": {}}
    for shape in (PROFILED, *OTHERS):
        x = torch.randint(1, 32000, shape, device="cuda")

        def loop(m, x=x):
            def call():
                with torch.no_grad():
                    return m(input_ids=x).logits
            return call
        t0 = time.perf_counter()
        got = loop(model)()  # at a new shape: a new capture of each patched forward (the recompile a user pays)
        torch.cuda.synchronize()
        first_s = round(time.perf_counter() - t0, 3)
        want = loop(untouched)()
        before = report.handle.launches()
        loop(model)()
        after = report.handle.launches()
        row = {"fused_launches": sum(n - before.get(k, 0) for k, n in after.items()), "first_call_s": first_s,
               "max_abs_vs_eager": float((got.float() - want.float()).abs().max())}
        t = interleaved({"eager": loop(untouched), "advisor": loop(model), "compile": loop(compiled)}, "cuda",
                        iters=iters, rounds=5, warmup_s=1.0)
        row["timing"] = t
        row["graphs"] = _graph_states(report.handle)
        row["speedup"] = {k: round(t["eager"]["median_ms"] / t[k]["median_ms"], 3) for k in ("advisor", "compile")}
        res["shapes"][f"{shape[0]}x{shape[1]}"] = row
        print(f"{name} {shape}: advisor {row['speedup']['advisor']:.2f}x, compile {row['speedup']['compile']:.2f}x, "
              f"{row['fused_launches']} fused launches", flush=True)
    res["fallbacks"] = report.handle.fallbacks()
    result.write_text(json.dumps(res, indent=1, default=str))
    return 0


def _graph_states(handle) -> dict:
    """Per patched forward: its captured functions' recordings, failures and calls run op by op (and why)."""
    out = {}
    for q, f in handle.forwards.items():
        backend = f._backend
        graphs = list(getattr(backend, "inference_graphs", ()))
        out[q or "model"] = {"on": f.on(), "captures": getattr(backend, "captures", None),
                             "recordings": sum(len(g.recordings) for g in graphs),
                             "failed": [g.failed for g in graphs if g.failed],
                             "op_by_op": [dict(g.not_replayed) for g in graphs if g.not_replayed]}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="llama")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", type=Path, default=Path("reports/new-shapes/new_shapes"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return child(a.child, a.result, a.iters)
    doc = load_results(a.out)
    rev = git_rev()
    for name in a.models.split(","):
        result = a.out.parent / f".new-shapes-{name}.json"
        proc = subprocess.run(child_command("bench.new_shapes", "--child", name, "--result", result, "--iters", a.iters),
                              capture_output=True, text=True, timeout=400, env=child_env())
        print((proc.stdout + proc.stderr).strip()[-1500:], flush=True)
        res = json.loads(result.read_text()) if result.exists() else {"error": (proc.stdout + proc.stderr)[-3000:]}
        result.unlink(missing_ok=True)
        res["commit"] = rev
        doc["results"][name] = res
        write_report(a.out, doc)
    lines = ["| model | shape | advisor | compile | fused launches |", "|---|---|---|---|---|"]
    for name, r in doc["results"].items():
        for shape, row in (r.get("shapes") or {}).items():
            lines.append(f"| {name} | {shape} | {row['speedup']['advisor']:.2f}x | {row['speedup']['compile']:.2f}x | "
                         f"{row['fused_launches']} |")
    write_report(a.out, doc, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
