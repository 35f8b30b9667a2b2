"""Kernels for the top candidates: generated and validated (or a stand-in), as `PatternSpec`s.

`replacement="kernel"` runs the generator's pipeline (`advisor.workflows.generate.generate_candidates`:
on-disk cache, validation, modules written to OUT/kernels, apply.json `patterns`), so the plan in OUT
is self-contained. `program` and `subgraph` patch in stand-ins instead (the program replayed by
PyTorch / the matched ops themselves), which tests the patcher without the generator. Returns the
specs to patch and one apply.json `patterns` record per candidate tried.
"""
from __future__ import annotations

from pathlib import Path

from advisor.workflows.generate import generate_candidates, pattern_record
from advisor.patching.plan import PatternSpec, spec_from_candidate
from advisor.status import Status


MIN_SHARE = 0.005  # of the best candidate's estimated saving


def kernel_specs(doc: dict, top: int, replacement: str, out_dir: Path,
                 device_type: str) -> tuple[list[PatternSpec], list[dict]]:
    top_candidates = doc["candidates"][:max(0, top)]
    # Estimates from a CPU trace are CPU times, noisy at tiny sizes and unrelated to what a GPU saves: the
    # cut-off (a guard against captures that cost more than they save) applies to GPU traces only.
    chosen, negligible = worth_patching(top_candidates) if device_type == "cuda" else (top_candidates, [])
    if replacement == "kernel":
        records = generate_candidates({**doc, "candidates": chosen}, Path(out_dir))["patterns"]
    else:
        records = [pattern_record(c, validated=True, errors={}, source="",
                                  reason=f"stand-in replacement ({replacement}), not a generated kernel")
                   for c in chosen]
    by_id = {c["id"]: c for c in chosen}
    specs = []
    for r in records:
        c = by_id[r["candidate"]]
        r.update(replacement=replacement, est_time_saved_us=c.get("est_time_saved_us"), occurrences=c.get("occurrences"))
        if replacement != "kernel":
            specs.append(spec_from_candidate(c, replacement))
        elif r.get("validated") and r.get("kernel_file"):
            specs.append(spec_from_candidate(c, "kernel", r["kernel_file"], r.get("device_type") or device_type))
    rank = {c["id"]: i for i, c in enumerate(top_candidates)}
    return specs, sorted(records + negligible, key=lambda r: rank[r["candidate"]])


def worth_patching(candidates: list) -> tuple[list, list]:
    """(candidates to patch, apply.json records of the rest). A pattern saving under 0.5% of the best
    one's estimate is not worth its patch: each patched module is captured by dynamo and run from a
    graph, and a tiny pattern in a model's root (a mask computation) would make the whole model one
    capture, tracing every layer, for a microsecond."""
    best = max((c.get("est_time_saved_us") or 0.0 for c in candidates), default=0.0)
    keep, rest = [], []
    for c in candidates:
        est = c.get("est_time_saved_us") or 0.0
        if best > 0 and est < MIN_SHARE * best:
            rest.append(pattern_record(c, errors={}, source="", est_time_saved_us=est, status_code=Status.NOT_WORTH,
                                       occurrences=c.get("occurrences"),
                                       reason=f"not worth patching: estimated saving {est:.2g} µs per iteration "
                                              f"is under {MIN_SHARE:.1%} of the best pattern's ({best:.3g} µs)"))
        else:
            keep.append(c)
    return keep, rest
