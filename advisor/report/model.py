"""Read-side helpers over analysis.json / apply.json, shared by the terminal and HTML views.

The JSON comes from stages that are still evolving, so everything here tolerates missing keys
and renders what is present instead of failing on what is not.
"""
from __future__ import annotations

from typing import Dict, List, Optional


def num(x, default=None):
    try:
        v = float(x)
    except (TypeError, ValueError):
        return default
    return default if v != v else v


def work_noun(analysis: dict) -> str:
    """CPU traces have ops, not kernels; saying "kernels" there would misdescribe what was counted."""
    return "ops" if (analysis.get("totals") or {}).get("time_kind") == "cpu" else "kernels"


def candidates(analysis: dict) -> List[dict]:
    cs = [c for c in analysis.get("candidates") or [] if isinstance(c, dict)]
    return sorted(cs, key=lambda c: (num(c.get("rank"), 1e9), str(c.get("id", ""))))


def total_time_us(analysis: dict) -> Optional[float]:
    return num((analysis.get("totals") or {}).get("time_us"))


def share(c: dict, analysis: dict) -> Optional[float]:
    s = num(c.get("share_of_iteration"))
    if s is None:
        t, est = total_time_us(analysis), num(c.get("est_time_saved_us"))
        s = est / t if t and est is not None else None
    return s


def title_parts(c: dict):
    """`"RMSNorm: to_fp32 → pow"` -> (`"RMSNorm"`, `"to_fp32 → pow"`); the name reads first, the chain after."""
    title = str(c.get("title") or c.get("pattern") or c.get("id") or "?")
    head, sep, chain = title.partition(": ")
    return (head, chain) if sep else (title, "")


def patterns_by_candidate(apply: Optional[dict]) -> Dict[str, dict]:
    if not isinstance(apply, dict):
        return {}
    return {str(p.get("candidate")): p for p in apply.get("patterns") or [] if isinstance(p, dict)}


def status(p: Optional[dict]) -> str:
    """One of: patched, unpatched (validated, but apply/optimize did not patch it in or dropped it), valid
    (validated; the patcher has not run), failed, skipped (no kernel produced), absent (not attempted)."""
    if not p:
        return "absent"
    if p.get("validated"):
        if p.get("status_code"):  # advisor.status.Status, written by apply/optimize: the word to trust
            return "patched" if p["status_code"] == "patched" else "unpatched"
        if "patched" not in p:  # `generate` validates, only apply/optimize patch
            return "valid"
        return "patched" if p.get("patched") and p.get("kept", True) else "unpatched"
    return "failed" if (p.get("source") or p.get("measured")) else "skipped"


def status_reason(p: Optional[dict]) -> str:
    """Why a pattern is not in use, in the patcher's or the generator's words ("" when it is, or unknown)."""
    st = status(p)
    if st == "unpatched":
        why = str(p.get("status") or "")
        if p.get("patched") and not p.get("kept", True):
            why = why if why and why != "patched" else "patched, then dropped: it did not make the model faster"
        return why or "not patched"
    return str(p.get("reason") or "") if st in ("failed", "skipped") else ""


def speed_words(sp: float) -> str:
    """1.25 -> "1.25× faster", 0.8 -> "1.25× slower": a slowdown is not called a speedup."""
    return f"{sp:.2f}× faster" if sp >= 1 else f"{1 / sp:.2f}× slower"


def speedup(apply: Optional[dict]) -> Optional[float]:
    """The end-to-end speedup apply measured, when the timing means something (not a CPU run)."""
    e2e = (apply or {}).get("end_to_end") if isinstance(apply, dict) else None
    if not isinstance(e2e, dict) or not e2e.get("timing_meaningful", True):
        return None
    return num(e2e.get("speedup"))


def measured_saved_per_iter(p: Optional[dict], c: dict) -> Optional[float]:
    """apply's timings are per call of the fused kernel; scale by occurrences to compare with the estimate."""
    m = (p or {}).get("measured") or {}
    saved = num(m.get("saved_us"))
    if saved is None:
        f, u = num(m.get("fused_us")), num(m.get("unfused_us"))
        saved = u - f if f is not None and u is not None else None
    occ = num(c.get("occurrences"), 1) or 1
    return None if saved is None else saved * occ


def potential_saving(analysis: dict) -> float:
    return sum(num(c.get("est_time_saved_us"), 0.0) for c in candidates(analysis))


def low_confidence_reasons(analysis: dict) -> List[str]:
    """Why the analysis flags itself: derived from fields, since the flag alone does not say."""
    why = []
    src, dev, tot = analysis.get("source") or {}, analysis.get("device") or {}, analysis.get("totals") or {}
    if not src.get("et"):
        why.append("no execution trace (shapes and dataflow inferred from the profiler alone)")
    if tot.get("time_kind") == "cpu" or dev.get("type") == "cpu":
        why.append("times are CPU op times, not GPU kernel times")
    if dev.get("bandwidth_source") == "table":
        why.append("bandwidth taken from a table, not measured")
    unknown = sum(num(u.get("time_us"), 0.0) for u in analysis.get("unknown_ops") or [] if isinstance(u, dict))
    t = num(tot.get("time_us"))
    if t and unknown / t > 0.05:
        why.append(f"{unknown / t:.0%} of the time is in ops the advisor does not model")
    ss = analysis.get("steady_state") or {}
    if ss.get("source") == "whole":
        why.append("no steady-state iteration found; the whole trace was used")
    return why
