"""Read-side helpers over analysis.json / apply.json, shared by the terminal and HTML views.

Candidates and pattern results are read as `advisor.records` (`Candidate`, `PatternResult`): a kind or
status outside the vocabulary is refused there. Everything else tolerates missing keys and renders what
is present instead of failing on what is not.
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional

from advisor.documents import DistributedSummary
from advisor.records import Candidate, Kind, PatternResult
from advisor.status import Status
from advisor.units import fmt_int, fmt_time

TRAINING_STEP = " (training steps: forward, backward and optimizer)"  # after "N iterations, found by SOURCE"


def num(x, default=None):
    try:
        v = float(x)
    except (TypeError, ValueError):
        return default
    return default if v != v else v


def work_noun(analysis: dict) -> str:
    """CPU traces have ops, not kernels; saying "kernels" there would misdescribe what was counted."""
    return "ops" if (analysis.get("totals") or {}).get("time_kind") == "cpu" else "kernels"


def saved_label(analysis: dict) -> str:
    """What a fused pattern saves in count: launches on a GPU trace; on a CPU trace, which launched no kernel,
    the ops fused away."""
    return "Ops" if work_noun(analysis) == "ops" else "Launches"


def candidates(analysis: dict) -> List[Candidate]:
    cs = [Candidate.from_json(c) for c in analysis.get("candidates") or [] if isinstance(c, dict)]
    return sorted(cs, key=lambda c: (num(c.rank, 1e9), c.id))


def distributed(analysis: dict) -> Optional[DistributedSummary]:
    """A merged analysis's per-rank summary (`distributed`) as its record; None for one process's analysis."""
    d = analysis.get("distributed")
    return DistributedSummary.from_json(d) if isinstance(d, dict) else None


def straggler_words(dist: DistributedSummary) -> str:
    """One sentence for the straggler, its own time against the others'; or that the ranks agree."""
    s = dist.straggler
    if s is None:
        return f"No straggler: no rank's {dist.straggler_rule or 'time'}."
    others = ", ".join(f"rank {r} {fmt_time(v)}" for r, v in s.others_us.items())
    return (f"Straggler: rank {s.rank}, {fmt_time(s.own_time_us)} of its own per iteration, {s.excess:.0%} above the "
            f"other ranks' median {fmt_time(s.others_median_us)} ({others}): the others wait on it.")


def listed(analysis: dict) -> List[Candidate]:
    """The candidates the reports list: all but the negligible ones (in analysis.json, ranked last)."""
    return [c for c in candidates(analysis) if not c.negligible]


def negligible(analysis: dict) -> List[Candidate]:
    return [c for c in candidates(analysis) if c.negligible]


def negligible_words(small: List[Candidate]) -> str:
    ids = ", ".join(c.id for c in small[:6]) + (", …" if len(small) > 6 else "")
    return (f"{ids}, negligible: each saves under 1% of the best candidate's estimated time, or little more than "
            "launches (under 1 KiB per occurrence, or under 0.1% of the most bytes any saves) with under 10% of that "
            "time (in analysis.json, ranked last).")


def gpu_estimate(analysis: dict) -> bool:
    """A CPU trace's estimates state what a GPU would save by the bytes model, not a share of the CPU time."""
    return (analysis.get("estimate") or {}).get("basis") == "gpu_bytes_model"


def total_time_us(analysis: dict) -> Optional[float]:
    return num((analysis.get("totals") or {}).get("time_us"))


def iteration_spread(analysis: dict) -> Optional[dict]:
    """{median, min, max, iterations} of the time per recorded iteration, when more than one was recorded."""
    spread = (analysis.get("totals") or {}).get("time_us_per_iteration")
    if not isinstance(spread, dict) or (num(spread.get("iterations"), 0) or 0) < 2:
        return None
    return spread


def share(c: Candidate, analysis: dict) -> Optional[float]:
    if gpu_estimate(analysis):
        return None
    s = num(c.share_of_iteration)
    if s is None:
        t, est = total_time_us(analysis), num(c.est_time_saved_us)
        s = est / t if t and est is not None else None
    return s


def title_parts(c: Candidate):
    """`"RMSNorm: to_fp32 → pow"` -> (`"RMSNorm"`, `"to_fp32 → pow"`); the name reads first, the chain after."""
    title = str(c.title or c.pattern or c.id or "?")
    head, sep, chain = title.partition(": ")
    return (head, chain) if sep else (title, "")


def patterns_by_candidate(apply: Optional[dict]) -> Dict[str, PatternResult]:
    if not isinstance(apply, dict):
        return {}
    return {str(p.get("candidate")): PatternResult.from_json(p) for p in apply.get("patterns") or [] if isinstance(p, dict)}


def status(p: Optional[PatternResult]) -> str:
    """One of: patched, unpatched (validated, but apply/optimize did not patch it in or dropped it), valid
    (validated; the patcher has not run), failed, skipped (no kernel produced), absent (not attempted)."""
    if not p:
        return "absent"
    if p.validated:
        if p.verdict:  # written by apply/optimize: the code to trust
            return "patched" if p.code == Status.PATCHED else "unpatched"
        if p.patched is None:  # `generate` validates, only apply/optimize patch
            return "valid"
        return "patched" if p.in_use else "unpatched"
    return "failed" if (p.source or p.measured) else "skipped"


def status_reason(p: Optional[PatternResult]) -> str:
    """Why a pattern is not in use, in the patcher's or the generator's words ("" when it is, or unknown)."""
    st = status(p)
    if st == "unpatched":
        why = p.verdict.message if p.verdict else ""
        if p.patched and p.kept is False:
            why = why if why and why != "patched" else "patched, then dropped: it did not make the model faster"
        return _NOT_PATCHED_PREFIX.sub("", why) or "not patched"
    return str(p.reason or "") if st in ("failed", "skipped") else ""


# The reports label a pattern not in use themselves ("– not patched"): the reason after the label drops its own
# copy of that word ("not patched: not patched: its ops…").
_NOT_PATCHED_PREFIX = re.compile(r"^(validated, )?(not patched|unpatched): ")


def speed_words(sp: float) -> str:
    """1.25 -> "1.25× faster", 0.8 -> "1.25× slower": a slowdown is not called a speedup."""
    return f"{sp:.2f}× faster" if sp >= 1 else f"{1 / sp:.2f}× slower"


# apply.json's rewrites of the captured graphs besides our kernels: (its field, what the reports call each entry)
GRAPH_REWRITES = (("gemm_epilogues", "cuBLASLt epilogue"), ("attention_layouts", "attention input laid out"))


def graph_rewrites(apply: Optional[dict]) -> List[str]:
    """One line per rewrite apply.json records (`GRAPH_REWRITES`): what, why, and at how many sites (graphs)."""
    out = []
    for field, label in GRAPH_REWRITES:
        entries = (apply or {}).get(field) if isinstance(apply, dict) else None
        for what, n in (entries.items() if isinstance(entries, dict) else ()):
            out.append(f"{label}: {what} (×{fmt_int(n)})")
    return out


def speedup(apply: Optional[dict]) -> Optional[float]:
    """The end-to-end speedup apply measured, when the timing means something (not a CPU run)."""
    e2e = (apply or {}).get("end_to_end") if isinstance(apply, dict) else None
    if not isinstance(e2e, dict) or not e2e.get("timing_meaningful", True):
        return None
    return num(e2e.get("speedup"))


def measured_saved_per_iter(p: Optional[PatternResult], c: Candidate) -> Optional[float]:
    """apply's timings are per call of the fused kernel; scale by occurrences to compare with the estimate."""
    m = (p.measured if p else None) or {}
    saved = num(m.get("saved_us"))
    if saved is None:
        f, u = num(m.get("fused_us")), num(m.get("unfused_us"))
        saved = u - f if f is not None and u is not None else None
    occ = num(c.occurrences, 1) or 1
    return None if saved is None else saved * occ


def potential_saving(analysis: dict) -> float:
    """What fusion could save per iteration, each op counted once: candidates that share ops are alternatives
    (the analyzer's `totals.est_time_saved_us`). For an analysis.json without it: an epilogue adds its estimate
    to its base group's (it is counted on top of it), and of the epilogues of one base only the best counts."""
    total = num((analysis.get("totals") or {}).get("est_time_saved_us"))
    if total is not None:
        return total
    cs = candidates(analysis)
    extra: Dict[str, float] = {}
    out = 0.0
    for c in cs:
        est = num(c.est_time_saved_us, 0.0)
        base = c.extends
        if base and c.kind == Kind.EPILOGUE:
            extra[base] = max(extra.get(base, 0.0), est)
        elif base:  # attention over its softmax group: one or the other
            extra[base] = max(extra.get(base, 0.0), est - next((num(b.est_time_saved_us, 0.0) for b in cs
                                                               if b.id == base), 0.0))
        else:
            out += est
    return out + sum(max(v, 0.0) for v in extra.values())


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
