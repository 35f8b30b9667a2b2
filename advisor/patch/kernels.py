"""Kernels for the top candidates: generated and validated (or a stand-in), as `PatternSpec`s.

`replacement="kernel"` runs the generator's pipeline (`advisor.codegen.pipeline.generate_candidates`:
on-disk cache, validation, modules written to OUT/kernels, apply.json `patterns`), so the plan in OUT
is self-contained. `program` and `subgraph` patch in stand-ins instead (the program replayed by
PyTorch / the matched ops themselves), which tests the patcher without the generator. Returns the
specs to patch and one apply.json `patterns` record per candidate tried.
"""
from __future__ import annotations

from pathlib import Path

from advisor.patch.plan import PatternSpec, spec_from_candidate


def kernel_specs(doc: dict, top: int, replacement: str, out_dir: Path,
                 device_type: str) -> tuple[list[PatternSpec], list[dict]]:
    chosen = doc["candidates"][:max(0, top)]
    if replacement == "kernel":
        from advisor.codegen.pipeline import generate_candidates

        records = generate_candidates(doc, Path(out_dir), top=max(0, top))["patterns"]
    else:
        records = [{"candidate": c["id"], "pattern_id": c["pattern_id"], "title": c["title"], "kernel_file": None,
                    "validated": True, "reason": f"stand-in replacement ({replacement}), not a generated kernel",
                    "errors": {}, "measured": None, "source": ""} for c in chosen]
    by_id = {c["id"]: c for c in chosen}
    specs = []
    for r in records:
        c = by_id[r["candidate"]]
        r.update(replacement=replacement, est_time_saved_us=c.get("est_time_saved_us"), occurrences=c.get("occurrences"))
        if replacement != "kernel":
            specs.append(spec_from_candidate(c, replacement))
        elif r.get("validated") and r.get("kernel_file"):
            specs.append(spec_from_candidate(c, "kernel", r["kernel_file"], r.get("device_type") or device_type))
    return specs, records
