"""Where a patched state loses time: the GPU kernels of eager and of each patched state, side by side.

    python bench/kernel_diff.py --model mistral --out OUT   # a bench/zoo.py model, on a GPU

Builds the zoo model, runs `advisor.optimize(..., select=False)` (every state stays available), then
profiles a few calls of the untouched copy and of each state (`captured`: the layer captures with
every site on its original ops; `all`: every pattern; `whole`: the outer capture, every pattern) and
writes, per state, the kernels by total device time, and which kernel names gained or lost the most.
A captured state slower than eager with the same kernels means host time; different kernels mean
the capture changed what runs (a decomposed attention, a materialised mask).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def kernels(call, calls: int = 5, width: int | None = 90) -> dict:
    """{kernel name (its first `width` characters; None: whole): {"us": device time per call, "n": launches per
    call}} over `calls` calls under torch.profiler, after three unprofiled ones."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    by: dict = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            name = e.name[:width]
            by[name][0] += e.device_time / calls
            by[name][1] += 1 / calls
    return {k: {"us": round(v[0], 1), "n": round(v[1], 2)} for k, v in sorted(by.items(), key=lambda kv: -kv[1][0])}


def output_errors(states: dict, eager, eager_model, model, args, kwargs, handle, run) -> dict:
    """Each state's output, and each pattern's alone, against eager and against a float32 copy of the model
    (the reference optimize's check judges by): what a rounding difference costs over the whole network."""
    from advisor.patching.verify import float32_reference
    from advisor.workflows.selection import state

    def first(x):
        while isinstance(x, (tuple, list)) or hasattr(x, "logits"):
            x = x.logits if hasattr(x, "logits") else x[0]
        return x.float()

    def err(o, r):
        return [round(float((o - r).norm() / r.norm().clamp_min(1e-30)), 5), round(float((o - r).abs().max()), 4)]

    exact_fn = float32_reference(model, args, kwargs)
    exact, ref = first(exact_fn()) if exact_fn else None, first(eager())
    runs = dict(states)
    for s in handle.plan.patterns if handle is not None else []:
        if handle.sites(s.key):
            runs[f"alone {s.candidate}"] = run(model, lambda k=s.key: state({k}, False))
        if handle.outer:
            runs[f"whole, alone {s.candidate}"] = run(model, lambda k=s.key: state({k}, True))
    from advisor.patching import patch
    from advisor.patching.capture import launched_sites

    key_to_candidate = {s.key: s.candidate for s in handle.plan.patterns} if handle is not None else {}
    twin = copy.deepcopy(eager_model)
    twin_handle = patch(twin, handle.plan) if handle is not None else None
    for k in ("first call", "second call"):  # a fresh patch of a copy: what optimize's check saw
        runs[f"fresh patch, {k}"] = (run(twin), twin_handle)
    out = {}
    for name, f in runs.items():
        f, h = f if isinstance(f, tuple) else (f, handle)
        before = h.launches() if h is not None else {}
        o = first(f())
        ran = launched_sites(before, h.launches()) if h is not None else {}
        out[name] = {"vs_eager": err(o, ref), "vs_fp32": err(o, exact) if exact is not None else None,
                     "sites launched": {key_to_candidate.get(k, k): n for k, n in sorted(ran.items())}}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--compile", action="store_true", help="also torch.compile's kernels")
    p.add_argument("--keep-all", action="store_true",
                   help="patch every validated pattern even where optimize's output check would drop one "
                        "(to measure the errors that made it drop them)")
    a = p.parse_args()
    import torch

    import advisor
    from advisor.patching import patches_off
    from advisor.workflows.selection import state
    from zoo import MODELS

    torch.manual_seed(0)
    model, inputs, shape = MODELS[a.model]("cuda", torch.bfloat16)
    untouched = copy.deepcopy(model)
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    if a.keep_all:
        from advisor.workflows import live_model
        from advisor.patching.verify import Check, check

        def check_only(call, handle, exact=None):  # the check's verdict is recorded, nothing dropped
            c = check(call, handle, exact)
            return Check(c.comparison, {}, handle, c.output, c.seconds) if c.dropped else c
        live_model.check = check_only
    report = advisor.optimize(model, inputs, select=False)

    def run(m, ctx=None):
        def call():
            with torch.no_grad():
                if ctx is None:
                    return m(*args, **kwargs)
                with ctx():
                    return m(*args, **kwargs)
        return call

    states = {"eager": run(untouched), "patches_off": run(model, patches_off),
              "captured": run(model, lambda: state(frozenset(), False)), "all": run(model, lambda: state(None, False))}
    if report.handle.outer:
        states["whole"] = run(model, lambda: state(None, True))
    if a.compile:  # what Inductor launches instead: the kernels to reach
        states["compile"] = run(torch.compile(copy.deepcopy(untouched)))
    import time

    from advisor.patching import graphs

    walls = {}
    for k, f in states.items():
        f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            f()
        torch.cuda.synchronize()
        walls[k] = round((time.perf_counter() - t0) * 100, 3)  # ms per call
    doc = {"model": a.model, "shape": shape, "wall_ms": walls, "states": {k: kernels(f) for k, f in states.items()},
           "graphs": [{"ops": g.ops, "recordings": len(g.recordings), "failed": g.failed, "not_replayed": g.not_replayed,
                       "trace": g.failed_trace}
                      for g in list(graphs._LIVE)],
           "fallbacks": report.handle.fallbacks()}
    doc["check"] = report.check
    doc["patterns"] = [{"candidate": r.candidate, "title": r.title, "status": r.to_json()["status"]} for r in report.results]
    doc["errors"] = output_errors(states, run(untouched), untouched, model, args, kwargs, report.handle, run)
    from torch._dynamo.utils import counters
    doc["dynamo"] = {k: {str(kk): vv for kk, vv in list(v.items())[:10]} for k, v in counters.items()
                     if k in ("graph_break", "unimplemented")}
    eager = doc["states"]["eager"]
    lines = [f"# {a.model}: {shape}", "", f"wall ms per call: {walls}", f"graphs: {doc['graphs']}",
             f"fallbacks: {doc['fallbacks']}", f"dynamo: {doc['dynamo']}", f"check: {doc['check']}",
             "", "output error (rel_l2, max_abs) vs eager and vs a float32 copy:"]
    lines += [f"- {k}: {v}" for k, v in doc["errors"].items()] + [""]
    for name, ks in doc["states"].items():
        total = sum(v["us"] for v in ks.values())
        lines.append(f"## {name}: {total:.0f} µs of kernels per call, {sum(v['n'] for v in ks.values()):.0f} launches")
        for k, v in list(ks.items())[:12]:
            lines.append(f"- {v['us']:8.1f} µs  x{v['n']:<5} {k}")
        if name != "eager":
            diff = {k: ks.get(k, {"us": 0})["us"] - eager.get(k, {"us": 0})["us"] for k in set(ks) | set(eager)}
            lines.append("  most changed vs eager: " + "; ".join(f"{k[:60]} {d:+.0f} µs"
                                                              for k, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:6]))
        lines.append("")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"kernels-{a.model}.json").write_text(json.dumps(doc, indent=1))
    (a.out / f"kernels-{a.model}.md").write_text("\n".join(lines))
    import shutil
    shutil.copytree(report.out_dir / "kernels", a.out / f"kernels-{a.model}", dirs_exist_ok=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
