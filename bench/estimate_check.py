"""Where a kept pattern's estimate and its measured saving part (issue 16's estimate target), on the GPU.

    PYTHONPATH=$PWD python3 bench/estimate_check.py --models mistral,gemma --out $OUT/estimates

Per zoo model (bench/zoo.py's builders, one process each): `advisor.optimize` with its defaults, then every
kept pattern is profiled in the state selection timed it in (inside the whole-stack capture where the model
runs one, else the layer captures): the captures with no pattern on, and with that pattern alone, 10 calls
each under torch.profiler. Per pattern it writes the analyzer's figures (the unfused kernels' measured time
and bytes in optimize's own trace, the estimate), selection's measured saving alone (wall time between
kernels included) and the profiled one: the kernels that left the timeline and the fused kernel that joined
it, their summed durations per call. The estimate is the unfused kernels' trace time less a roofline of the
fused kernel; this says which side is off: the fused kernel against its roofline, or the unfused kernels in
the graph against their times in the trace, or the gaps between kernels.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CALLS = 10


def kernel_times(call, calls: int = CALLS) -> dict:
    """{kernel name: µs per call} (`kernel_diff.kernels`, whole names: two elementwise kernels differ only in
    their template arguments' tail)."""
    from kernel_diff import kernels

    return {name: k["us"] for name, k in kernels(call, calls, width=None).items()}


def diff(before: dict, after: dict, floor_us: float = 0.5) -> tuple[dict, dict]:
    """(kernels that took less time after: µs less, kernels that took more: µs more), each over `floor_us`."""
    names = set(before) | set(after)
    less = {n: round(before.get(n, 0) - after.get(n, 0), 2) for n in names if before.get(n, 0) - after.get(n, 0) > floor_us}
    more = {n: round(after.get(n, 0) - before.get(n, 0), 2) for n in names if after.get(n, 0) - before.get(n, 0) > floor_us}
    return less, more


def child(name: str, out: Path) -> int:
    import torch

    import advisor
    from advisor.workflows.selection import state
    from suite import process_warmup
    from zoo import MODELS

    torch.manual_seed(0)
    process_warmup("cuda")
    model, inputs, shape = MODELS[name]("cuda", torch.bfloat16)
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)

    def call():
        with torch.no_grad():
            return model(*args, **kwargs)

    report = advisor.optimize(model, inputs, out=out / name)
    doc = json.loads((report.out_dir / "apply.json").read_text())
    analysis = json.loads((report.out_dir / "analysis.json").read_text())
    cands = {c["id"]: c for c in analysis["candidates"]}
    handle = report.handle
    sel = doc.get("selection") or {}
    outer = bool(sel.get("outer"))
    key_of = {s.candidate: s.key for s in handle.plan.patterns}
    res = {"model": name, "shape": shape, "selection": {k: sel.get(k) for k in ("decision", "state", "outer")},
           "steady_state": analysis.get("steady_state"), "device": analysis.get("device"), "patterns": []}
    with state(frozenset(), outer):
        base = kernel_times(call)
    res["captured_kernel_us"] = round(sum(base.values()), 2)
    for p in doc["patterns"]:
        if p.get("status_code") != "patched" or p["candidate"] not in key_of:
            continue
        with state(frozenset({key_of[p["candidate"]]}), outer):
            alone = kernel_times(call)
        less, more = diff(base, alone)
        c = cands.get(p["candidate"], {})
        res["patterns"].append({
            "candidate": p["candidate"], "title": p["title"], "sites": p.get("sites"),
            "analysis": {k: c.get(k) for k in ("occurrences", "kernels", "kernels_saved", "bytes_unfused", "bytes_fused",
                                               "bytes_saved", "est_time_saved_us", "measured_time_us")},
            "applied_alone": p.get("applied_alone"),
            "profiled_saving_us": round(sum(base.values()) - sum(alone.values()), 2),
            "kernels_less_us": less, "kernels_more_us": more})
        print(f"{name} {p['candidate']} {p['title'][:40]}: est {(p.get('applied_alone') or {}).get('est_saved_us_per_iter')}"
              f" measured {(p.get('applied_alone') or {}).get('saved_us_per_iter')} profiled "
              f"{res['patterns'][-1]['profiled_saving_us']}", flush=True)
    (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


def per_model_main(argv, doc: str, script: str, child, models: str, timeout: int) -> int:
    """The parent of a per-model benchmark: `child(name, out)` run for each of --models in a process of its own
    (`script --child NAME`), so that one model's memory, caches and dynamo state never reach the next."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--models", default=models)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--timeout", type=int, default=timeout)
    p.add_argument("--child")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.child:
        return child(a.child, a.out)
    for name in a.models.split(","):
        try:
            rc = subprocess.run([sys.executable, script, "--child", name, "--out", str(a.out)], timeout=a.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(f"{name}: rc {rc}", flush=True)
    return 0


def main(argv=None) -> int:
    return per_model_main(argv, __doc__, __file__, child, "mistral,gemma", 150)


if __name__ == "__main__":
    sys.exit(main())
