"""Kernels for the top candidates: generated and validated (or a stand-in), as `PatternSpec`s.

`replacement="kernel"` asks the generator (`advisor.codegen.generate`, on-disk cache) and validation
(`advisor.validate.validate`) for each candidate and copies each validated module to
OUT/kernels/<candidate>_<pattern>.py, so the plan in OUT is self-contained. `program` and `subgraph`
patch in stand-ins instead (the program replayed by PyTorch / the matched ops themselves), which
tests the patcher without the generator. Returns the specs to patch and one apply.json `patterns`
record per candidate tried.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from advisor.patch.plan import PatternSpec, spec_from_candidate


def kernel_specs(doc: dict, top: int, replacement: str, out_dir: Path | None,
                 device_type: str) -> tuple[list[PatternSpec], list[dict]]:
    specs, records = [], []
    for c in doc["candidates"][:max(0, top)]:
        rec = {"candidate": c["id"], "pattern_id": c["pattern_id"], "title": c["title"], "kernel_file": None,
               "validated": False, "reason": None, "errors": {}, "measured": None, "source": "",
               "replacement": replacement, "est_time_saved_us": c.get("est_time_saved_us"),
               "occurrences": c.get("occurrences")}
        if replacement != "kernel":
            rec.update(validated=True, reason=f"stand-in replacement ({replacement}), not a generated kernel")
            specs.append(spec_from_candidate(c, replacement, None, None))
            records.append(rec)
            continue
        kernel_file = _generate(c, rec, out_dir)
        if kernel_file:
            specs.append(spec_from_candidate(c, "kernel", kernel_file, device_type))
        records.append(rec)
    return specs, records


def _generate(c: dict, rec: dict, out_dir: Path | None) -> str | None:
    try:
        from advisor.codegen import Unsupported, generate, load_module
        from advisor.validate import validate
    except Exception as e:  # pragma: no cover - the generator is part of the package
        rec["reason"] = f"generator not available: {type(e).__name__}: {e}"
        return None
    try:
        gen = generate(c["program"])
    except Unsupported as e:
        rec["reason"] = f"not generated: {e}"
        return None
    except Exception as e:
        rec["reason"] = f"generator failed: {type(e).__name__}: {e}"
        return None
    rec["source"] = gen.code
    path = Path(gen.path)
    if out_dir is not None:
        dst = Path(out_dir) / "kernels" / f"{c['id']}_{c['pattern_id']}.py"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dst)
        path = dst
    try:
        v = validate(gen, load_module(path))
    except Exception as e:
        rec["reason"] = f"validation failed to run: {type(e).__name__}: {e}"
        return None
    rec.update(validated=bool(v.validated), reason=v.reason, errors=v.errors, kernel_file=str(path))
    return str(path) if v.validated else None
