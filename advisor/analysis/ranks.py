"""A distributed run's analysis: each rank's trace (OUT/trace/rank-K) analysed as one process's is, each written to
OUT/rank-K/analysis.json, then merged into one document, OUT/analysis.json, that the reports and `generate` read.

Merging: one candidate per pattern id across ranks, in the lowest rank's order (its ids kept), then the patterns
only other ranks have (new ids where theirs are taken). Each merged candidate's `est_time_saved_us` is the median
over the ranks that have it, and `ranks` holds the spread: `seen_on`, `missing_on`, `est_time_saved_us` per rank
(keys are ranks as strings), `min`, `median`, `max`. The rest of a candidate (program, graph, modules, bytes) is the
lowest such rank's. The document's `distributed` (`advisor.documents.DistributedSummary`) says per rank what was
analysed: backend, time and communication per iteration (with how much of it is exposed: `advisor.analysis.overlap`),
candidates, the steady-state calls every rank shares (advisor.collect.distributed.align), and the straggler.

The straggler is the rank the others wait on. Synchronous collectives make every rank's wall time per iteration
the same, up to the last collective's: the slow rank shows in its own time, the iteration less its exposed
communication, the time the others spend waiting for it. A rank is named when its own time is more than
`STRAGGLER_MARGIN` above the median of the other ranks' (the others', not all ranks': at two ranks the median of
all would hold the straggler itself and halve its excess); 5% is above the step-to-step noise of equal ranks.
Without communication measured (a trace without collectives), the ranks' op or kernel time per iteration is
compared instead.
"""
from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from advisor import codec
from advisor.collect.distributed import align
from advisor.documents import (ANALYSIS_FILE, AnalysisDoc, CommunicationTime, DistributedSummary, RankSummary,
                               Straggler, write_analysis)
from advisor.layout import rank_dir, rank_dirs

STRAGGLER_MARGIN = 0.05


def analyze_ranks(trace_root: Path, out: Path) -> AnalysisDoc:
    """Analyse each rank under TRACE_ROOT (writing OUT/rank-K/analysis.json) and return the merged document."""
    from advisor.analysis.api import analyze

    summary = align(trace_root)
    docs: List[Tuple[int, dict, dict]] = []
    for d in rank_dirs(trace_root):
        meta = json.loads((d / "meta.json").read_text())
        rank = int(d.name.split("-", 1)[1])
        analysis = analyze(d)
        write_analysis(rank_dir(out, rank), analysis.document)
        docs.append((rank, analysis.doc, meta))
    return AnalysisDoc.from_json(merge(docs, summary, out))


def _spread(values: Dict[int, float]) -> dict:
    vals = list(values.values())
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals)}


def merge(docs: List[Tuple[int, dict, dict]], summary: dict, out: Path = Path(".")) -> dict:
    """One analysis document from (rank, analysis doc, meta) per rank; see the module's docstring."""
    ranks = [r for r, _, _ in docs]
    base = copy.deepcopy(docs[0][1])
    per_pattern: Dict[str, Dict[int, dict]] = {}
    for rank, doc, _ in docs:
        for c in doc.get("candidates") or []:
            per_pattern.setdefault(c["pattern_id"], {})[rank] = c
    # ids: the lowest rank's kept; a pattern first seen on another rank keeps its id unless that one is taken
    taken, merged_id = set(), {}
    for pid, per in per_pattern.items():
        own = per[min(per)]["id"]
        if own in taken:
            continue
        taken.add(own)
        merged_id[pid] = own
    n = max([int(i[1:]) for i in taken if i[1:].isdigit()] or [0])
    for pid in per_pattern:
        if pid not in merged_id:
            n += 1
            merged_id[pid] = f"c{n}"
    id_maps = {rank: {c["id"]: merged_id[c["pattern_id"]] for c in doc.get("candidates") or []} for rank, doc, _ in docs}

    candidates, warnings = [], []
    for pid, per in per_pattern.items():  # dicts keep insertion order: the lowest rank's ranking first
        first = min(per)
        c = copy.deepcopy(per[first])
        ests = {r: float(per[r]["est_time_saved_us"]) for r in sorted(per)}
        spread = _spread(ests)
        c["id"] = merged_id[pid]
        c["est_time_saved_us"] = spread["median"]
        c["ranks"] = {"seen_on": sorted(per), "missing_on": [r for r in ranks if r not in per],
                      "est_time_saved_us": {str(r): v for r, v in ests.items()}, **spread}
        if c.get("extends"):
            c["extends"] = id_maps[first].get(c["extends"])
        if c.get("shared"):
            c["shared"] = {id_maps[first][k]: v for k, v in c["shared"].items() if k in id_maps[first]}
        if c["ranks"]["missing_on"]:
            warnings.append(f"{c['id']} ({c.get('title', pid)}) found on rank(s) {c['ranks']['seen_on']} only")
        candidates.append(c)
    # The lowest rank's order, then the others'; negligible ones after all that are not (as one rank's analysis)
    candidates.sort(key=lambda c: bool(c.get("negligible")))
    for k, c in enumerate(candidates, 1):
        c["rank"] = k
    base["candidates"] = candidates
    base["warnings"] = list(base.get("warnings") or []) + list(summary.get("warnings") or []) + warnings
    backends = sorted({str(m.get("backend")) for _, _, m in docs if m.get("backend")})
    world_size = max([int(m.get("world_size") or 0) for _, _, m in docs] + [len(docs)])
    per_rank = tuple(_rank_summary(r, doc, m, out) for r, doc, m in docs)
    found, rule = straggler(per_rank)
    base["distributed"] = DistributedSummary(
        world_size=world_size,
        backend=backends[0] if len(backends) == 1 else backends or None,
        ranks_analysed=tuple(ranks),
        steady_state_calls=tuple(summary.get("calls") or []),
        merged_from=f"rank {ranks[0]}: its timeline, totals and each candidate's program; estimates median over ranks",
        ranks=per_rank, straggler=found, straggler_rule=rule).to_json()
    missing = [r for r in range(world_size) if r not in ranks]
    if missing:
        base["warnings"].append(f"no trace for rank(s) {missing} of {world_size}")
    return base


def _rank_summary(rank: int, doc: dict, meta: dict, out: Path) -> RankSummary:
    comm_time = doc.get("communication_time")
    if isinstance(comm_time, dict):
        comm_time = codec.from_json(CommunicationTime, comm_time, "communication_time")
    return RankSummary(rank=rank, local_rank=meta.get("local_rank"), backend=meta.get("backend"),
                       analysis=str(rank_dir(out, rank) / ANALYSIS_FILE),
                       iterations=doc["steady_state"]["iterations"], time_us=doc["totals"]["time_us"],
                       communication_us=doc["totals"].get("communication_us", 0.0),
                       communication=tuple(doc.get("communication") or ()), communication_time=comm_time,
                       candidates=len(doc.get("candidates") or []),
                       est_time_saved_us=doc["totals"].get("est_time_saved_us"))


def straggler(per_rank: Sequence[RankSummary], margin: float = STRAGGLER_MARGIN) -> Tuple[Straggler | None, str]:
    """The rank whose own time per iteration is more than MARGIN above the median of the other ranks' (see the
    module's docstring), or None where the ranks agree; and the sentence saying what was compared."""
    measured = all(r.communication_time is not None for r in per_rank)
    if measured:
        own = {r.rank: r.communication_time.own_time_us for r in per_rank}
        rule = "own time per iteration (wall time less exposed communication)"
    else:
        own = {r.rank: float(r.time_us) for r in per_rank}
        rule = "op or kernel time per iteration (no communication measured)"
    rule += f" more than {margin:.0%} above the median of the other ranks'"
    if len(own) < 2:
        return None, rule
    slowest = max(own, key=lambda r: (own[r], -r))
    others = {r: v for r, v in own.items() if r != slowest}
    median = statistics.median(others.values())
    excess = own[slowest] / median - 1 if median > 0 else 0.0
    if excess <= margin:
        return None, rule
    return Straggler(rank=slowest, own_time_us=own[slowest], others_median_us=median, excess=excess, margin=margin,
                     others_us={str(r): v for r, v in sorted(others.items())}), rule
