"""Which patched state a workflow hands back: the selection policy (`choose`, on timings alone) and the
timings it is given (`time_patterns`: each pattern alone; `keep_faster`: the final comparison).

On a GPU a patched model is never left slower than it was: every state is timed side by side with the
unpatched model and kept only when it is faster beyond the noise. Without meaningful timing (kernels in
Triton's interpreter) nothing is timed and nothing dropped.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

from advisor.bench import timing  # read at call time: tests replace its clocks
from advisor.patching import only, patch, patches_off, whole
from advisor.patching.verify import check_outer
from advisor.status import Status


@dataclass(frozen=True)
class Option:
    """One state the model can be handed back in, and what it measured."""

    name: str  # "all" | "kept" | "captured" (captures replayed, every site on its original ops) | "whole*"
    enabled: frozenset | None  # pattern keys whose launchers run (None: every one)
    ms: float
    outer: bool = False  # the outer capture (the whole stack as one graph) instead of the layer captures


DESCRIBE = {"all": "every patched pattern", "kept": "the {n} patterns that saved time alone",
            "captured": "the captured layers replayed as CUDA graphs, every site on its original ops",
            "whole": "the whole stack captured as one graph (fusing across layers), every pattern",
            "whole_kept": "the whole stack captured as one graph, with the {n} patterns that saved time alone"}


@contextlib.contextmanager
def state(enabled, outer: bool):
    """The model runs in one selectable state inside this block."""
    with whole(outer), only(enabled):
        yield


def choose(before_ms: float, noise_ms: float, options: list[Option]) -> Option | None:
    """The selection policy, on timings alone: the fastest option, if it beats the unpatched model by more
    than the measurement's noise (and 1%); None: leave the model unpatched."""
    best = min(options, key=lambda o: o.ms, default=None)
    margin = max(noise_ms, 0.01 * before_ms)
    return best if best is not None and best.ms < before_ms - margin else None


def keep_faster(call, handle, device: str, records: list, iters: int = 20, exact=None) -> tuple:
    """On a GPU, never leave the model slower: time each patched pattern alone (`time_patterns`); then time,
    side by side with the unpatched model, every pattern on, only those that saved time alone, and the
    captures with no kernel (their CUDA-graph replay alone), the outer captures where the plan has them
    (each whole stack as one graph; checked against the unpatched outputs first, `exact` as in `check`,
    their launched sites in `outer_sites`), and hand back the fastest (`choose`) as
    timed, or the model unpatched. Marks `kept` (and why not) on the records; returns (the handle now in
    force, the decision). Without meaningful timing nothing is dropped."""
    patched = [r for r in records if r.get("patched")]
    key_of = {s.candidate: s.key for s in handle.plan.patterns}
    if not patched:
        return handle, {"decision": "nothing patched", "kept": []}
    if not timing.timing_meaningful(device):
        return handle, {"decision": "all patched patterns kept (timing not meaningful here: no selection)",
                        "kept": [r["candidate"] for r in patched]}
    e2e = time_patterns(call, handle, device, iters, records)
    out = {"all_patched": {k: e2e.get(k) for k in ("before_ms", "after_ms", "captured_only_ms", "speedup", "noise_ms")},
           "timing": e2e}  # the whole of it: `optimize(benchmark=True)` need not time the same handle again
    alone_kept = frozenset(key_of[r["candidate"]] for r in patched
                           if ((r.get("applied_alone") or {}).get("saved_us_per_iter") or 0) > 0)
    every = frozenset(key_of[r["candidate"]] for r in patched)
    states = {"all": (None, False), "captured": (frozenset(), False)}
    if alone_kept and alone_kept != every:
        states["kept"] = (alone_kept, False)
    if handle.outer:
        out["outer_sites"] = check_outer(call, handle, exact)
        out["outer_check"] = next((f.refused for f in handle.outer if f.refused), "outputs as unpatched")
    if any(not f.refused for f in handle.outer):
        states["whole"] = (None, True)
        if "kept" in states:
            states["whole_kept"] = (alone_kept, True)
    # The final comparison, in one interleaved run: what is chosen is what was timed last.
    t = timing.time_configs(call, {"before": patches_off, **{k: (lambda e, o: lambda: state(e, o))(*eo)
                                                             for k, eo in states.items()}},
                            device, iters=iters)
    before = t["before"].median_ms
    noise = max(x.spread_ms for x in t.values())
    options = [Option(k, e, t[k].median_ms, o) for k, (e, o) in states.items()]
    out["final"] = {k: round(v.median_ms, 4) for k, v in t.items()} | {"noise_ms": round(noise, 4)}
    best = choose(before, noise, options)
    if best is None:
        handle = patch(handle.model, handle.plan.only(set()))  # every forward as it was
        out["decision"] = (f"nothing kept (the model runs unpatched): no state beats it beyond noise ({before:.3f} ms; "
                           + ", ".join(f"{o.name} {o.ms:.3f}" for o in options) + f"; noise {noise:.3f} ms)")
        enabled = frozenset()
    else:
        handle.enable(best.enabled)
        handle.set_outer(best.outer)
        enabled = every if best.enabled is None else best.enabled
        what = DESCRIBE[best.name].format(n=len(enabled))
        out["decision"] = f"kept {what}: {before:.3f} -> {best.ms:.3f} ms end to end (noise {noise:.3f} ms)"
        out["state"] = best.name
        out["outer"] = best.outer
    out["enabled"] = sorted(enabled) if best is not None else None
    mark_kept(records, key_of, enabled if best is not None else frozenset(), best is not None)
    out["kept"] = [r["candidate"] for r in records if r.get("kept")]
    return handle, out


def mark_kept(records: list, key_of: dict, enabled: frozenset, anything_kept: bool) -> None:
    """`kept` and the status of each patched record once selection has chosen which patterns run."""
    for r in records:
        if not r.get("patched"):
            continue
        r["kept"] = key_of[r["candidate"]] in enabled
        r["status_code"] = Status.PATCHED if r["kept"] else Status.NOT_KEPT
        alone = (r.get("applied_alone") or {}).get("saved_us_per_iter")
        r["status"] = "patched" if r["kept"] else \
            (f"not kept: {alone:+.0f} µs per call alone" if alone is not None else "not kept") + \
            ("" if anything_kept or alone is None or alone <= 0 else ", but no patched state was faster end to end")


def time_patterns(call, handle, device: str, iters: int, records: list) -> dict:
    """Per call: unpatched, patched, captured with every site on its original ops, and each patched
    pattern alone (its saving = captured-only minus alone), timed in interleaved rounds."""
    if not timing.timing_meaningful(device):
        return {"timing_meaningful": False, "device": device,
                "reason": "kernels run in Triton's interpreter on the CPU; no speedup is claimed"}
    alone = each_alone(handle, [r["candidate"] for r in records if r.get("patched")])
    configs = {"before": patches_off, "after": None, "captured_only": lambda: only(set()), **alone}
    t = timing.time_configs(call, configs, device, iters=iters)
    cap = t["captured_only"].median_ms
    for r in records:
        if r["candidate"] in alone:
            a = t[r["candidate"]]
            r["applied_alone"] = {"ms": round(a.median_ms, 4), "captured_ms": round(cap, 4),
                                  "saved_us_per_iter": round((cap - a.median_ms) * 1e3, 2),
                                  "spread_us": round(max(a.spread_ms, t["captured_only"].spread_ms) * 1e3, 2),
                                  "est_saved_us_per_iter": estimate_for_sites(r)}
    before, after = t["before"], t["after"]
    return {"timing_meaningful": True, "device": device, "method": before.method, "iters": before.iters,
            "before_ms": round(before.median_ms, 4), "after_ms": round(after.median_ms, 4),
            "captured_only_ms": round(cap, 4),
            "speedup": round(before.median_ms / after.median_ms, 4) if after.median_ms else None,
            "noise_ms": round(max(before.spread_ms, after.spread_ms), 4),
            "before": before.as_dict(), "after": after.as_dict(), "captured_only": t["captured_only"].as_dict(),
            "note": "captured_only: the module captures with every site running its original ops; "
                    "before -> captured_only is what capturing alone changes (less Python per op)"}


def estimate_for_sites(record: dict) -> float | None:
    """The analyzer's estimate for the occurrences actually patched: it is made for every occurrence per
    iteration, and a pattern launched at fewer sites (cross-layer occurrences left to the outer capture,
    say: the suite's Llama patched 8 of its 16 residual add + norms per layer) saves that share of it."""
    est, occ, sites = record.get("est_time_saved_us"), record.get("occurrences"), record.get("sites")
    if est is None or not occ or not sites:
        return est
    return round(est * min(1.0, sites / occ), 2)


def each_alone(handle, candidates: list) -> dict:
    """{candidate: context factory inside which only that pattern runs its launchers}, per candidate the
    handle's plan has (the configurations that time each pattern alone)."""
    keys = {s.candidate: s.key for s in handle.plan.patterns}
    return {c: (lambda k: lambda: only({k}))(keys[c]) for c in candidates if c in keys}
