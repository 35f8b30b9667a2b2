"""`advisor.analyze(path) -> Analysis`, run by the `analyze` command: trace -> graph -> candidates -> analysis.json."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from operator import itemgetter
from pathlib import Path

import json
import logging
import textwrap

import numpy as np
import pandas as pd

from advisor.analysis.attention_backends import math_attention
from advisor.analysis.cost import (DeviceModel, GroupCost, bytes_model_saved_us, est_time_saved_us, gpu_model,
                                 group_costs, padding_pays)
from advisor.analysis.fusion import Group, find_groups, not_generated
from advisor.analysis.patterns import NORMS, family, group_family, op_label, pattern_id, signature, signatures, title
from advisor.graph.dataflow import build_graph, steady_windows
from advisor.graph.dtypes import torch_dtype_name
from advisor.graph.nodes import Graph
from advisor import codec
from advisor.analysis.overlap import communication_time
from advisor.documents import AnalysisDoc, CommunicationTime, Refusal
from advisor.jsonio import ANALYSIS_SCHEMA_VERSION, write_json
from advisor.ops.registry import CONV_EPILOGUE, MEMORY_BOUND, OpClass
from advisor.records import Kind
from advisor.trace.load import gc_paused, load_trace
from advisor.units import fmt_time

log = logging.getLogger(__name__)

# A candidate is negligible when it saves under 1% of the best one's estimated time; or, its time under 10% of the
# best's, when what it saves is launches alone: under 1 KiB of traffic per occurrence (a mask's `eq -> all` on 4
# bytes) or under 0.1% of the most bytes any candidate saves. It stays in analysis.json, ranked after all the
# others, and the reports leave it out of their lists (and say so). The best candidate by time never is.
NEGLIGIBLE_SHARE = 0.01
NEGLIGIBLE_LAUNCHES_SHARE = 0.10
NEGLIGIBLE_BYTES_SHARE = 0.001
NEGLIGIBLE_BYTES = 1024

REFUSALS_KEPT = 50  # analysis.json's `refused`: the most frequent; a large model's rarer ones are in the debug log

CLASS_ORDER = ["matmul", "attention", "pointwise", "reduction", "norm", "data_movement", "view", "other"]


@dataclass(repr=False)
class Analysis:
    """What the analyzer found. DataFrames for notebooks; `doc` is exactly what analysis.json holds.

    `print(a.summary())` says what was found; `a.candidates` ranks the patterns, `a.ops` has one row per
    op with the candidate it belongs to (group by it), `a.kernels` the trace's GPU activity.
    """

    graph: Graph
    device: DeviceModel
    kernels: pd.DataFrame  # the trace's GPU activity (empty for CPU traces)
    candidates: pd.DataFrame  # one row per pattern, ranked
    groups: dict  # candidate id -> [Group] (every occurrence)
    doc: dict

    @cached_property
    def ops(self) -> pd.DataFrame:
        """One row per graph node (op that did work), with `candidate`: the id (c1, c2, ...) of the highest-ranked
        candidate whose pattern the op is part of, or None. Made when first asked for: analysis.json does not need it,
        and at a million nodes it costs seconds."""
        frame = self.graph.node_frame()
        owner: dict = {}
        for cid, groups in self.groups.items():  # in rank order: an op two candidates share goes to the higher
            for g in groups:
                for m in g.members:
                    owner.setdefault(m, cid)
        frame["candidate"] = pd.Categorical([owner.get(n) for n in frame["node"]])
        return frame

    def __repr__(self) -> str:
        d, tot, cands = self.doc["device"], self.doc["totals"], self.doc["candidates"]
        noun = "kernels" if tot["time_kind"] == "gpu" else "ops"
        gpu = " on a GPU" if self.doc["estimate"]["basis"] == "gpu_bytes_model" else ""
        best = f"; best: {cands[0]['title'].split(':')[0]}, est. {fmt_time(cands[0]['est_time_saved_us'])}{gpu}" if cands else ""
        return (f"<Analysis {d['name']} ({d['type']}): {self.doc['steady_state']['iterations']} iterations, "
                f"{tot['kernels']} {noun} and {fmt_time(tot['time_us'])} per iteration; {len(cands)} candidates{best}>")

    def summary(self, top: int = 5) -> str:
        """A few lines for a notebook or a log: where the time goes and the `top` candidates."""
        d, tot, cands = self.doc["device"], self.doc["totals"], self.doc["candidates"]
        lines = [f"{d['name']} ({d['type']}), {self.doc['steady_state']['iterations']} steady-state iterations",
                 f"per iteration: {tot['kernels']} {'kernels' if tot['time_kind'] == 'gpu' else 'ops'}, "
                 f"{fmt_time(tot['time_us'])} {tot['time_kind'].upper()} time{_spread(tot)}, "
                 f"{tot['memory_bound_share']:.0%} of it memory-bound"]
        if self.doc["low_confidence"]:
            lines.append("low confidence: no execution trace joined, dataflow guessed from shapes and order")
        listed = [c for c in cands if not c["negligible"]]
        lines.append(f"{len(cands)} fusion candidates" + (f", the top {min(top, len(listed))}:" if listed else ""))
        gpu = self.doc["estimate"]["basis"] == "gpu_bytes_model"
        for c in listed[:top]:
            share = "on a GPU, bytes model" if gpu else f"{c['share_of_iteration']:.1%}"
            lines.append(f"  {c['id']:>4}  {textwrap.shorten(c['title'], 70, placeholder='…'):<70}  x{c['occurrences']:<4} "
                         f"est. {fmt_time(c['est_time_saved_us']):>9} ({share})")
        if len(listed) < len(cands):
            lines.append(f"  and {len(cands) - len(listed)} negligible (in `doc['candidates']`, ranked last)")
        return "\n".join(lines)

    @cached_property
    def document(self) -> AnalysisDoc:
        """`doc` as the typed record the run folder's writer takes (`advisor.documents.write_analysis`)."""
        return AnalysisDoc.from_json(self.doc)

    def to_json(self, path: Path) -> Path:
        """The analysis as JSON at `path` (a notebook's copy; a run folder's analysis.json is written by
        `advisor.documents.write_analysis`)."""
        return write_json(Path(path), self.document.to_json())


def analyze(path, et=None) -> Analysis:
    """Analyse a trace: a `fusion-advisor profile` directory (OUT or OUT/trace), a Kineto .json(.gz), or a
    TensorBoard trace directory (what `torch.profiler.tensorboard_trace_handler` writes: the newest
    *.pt.trace.json(.gz) in it is read). `et`: an execution trace file, when `path` is a bare Kineto file."""
    trace = load_trace(_tensorboard_trace(Path(path)), Path(et) if et else None)
    graph = build_graph(trace)
    device = DeviceModel.from_meta(trace.meta, graph.device_type)
    comm_time = communication_time(trace, steady_windows(trace))  # from the trace: every thread and stream
    files, meta, kernels = trace.files, trace.meta, trace.kernels
    del trace  # the graph has what the rest needs: let the op and ET frames go before it runs
    with gc_paused():  # millions of small objects, no cycles: see gc_paused
        return _analysis(graph, device, files, meta, kernels, comm_time)


def _tensorboard_trace(path: Path) -> Path:
    """The newest *.pt.trace.json(.gz) of a TensorBoard trace directory; any other path as it is."""
    if not path.is_dir() or (path / "trace").is_dir() or any(path.glob("kineto.json*")):
        return path
    traces = sorted(chain(path.glob("*.pt.trace.json"), path.glob("*.pt.trace.json.gz")),
                    key=lambda p: p.stat().st_mtime)
    return traces[-1] if traces else path


@dataclass
class _Pattern:
    """One pattern's occurrences, their costs summed in group order as they come (sums start at int 0,
    as sum() does, so the floats come out as they always did) and then dropped."""

    first: Group
    sig: str
    groups: list
    kernels_saved: int = 0
    bytes_unfused: int = 0
    bytes_fused: int = 0
    bytes_saved: int = 0
    est_time_saved_us: float = 0
    measured_us: float = 0
    intermediate_bytes: int = 0
    est_cpu_time_saved_us: float = 0  # CPU traces: the CPU-time estimate, for reference

    def add(self, g: Group, c: GroupCost, device: DeviceModel, gpu: DeviceModel | None, ests: dict) -> None:
        """`gpu`: on a CPU trace, the GPU whose bytes model states the saving. `ests`: id(group) -> its estimate."""
        self.groups.append(g)
        self.kernels_saved += c.kernels - 1
        self.bytes_unfused += c.bytes_unfused
        self.bytes_fused += c.bytes_fused
        self.bytes_saved += c.bytes_saved
        est = est_time_saved_us(c, g, device)
        if gpu is not None:
            self.est_cpu_time_saved_us += est
            est = bytes_model_saved_us(c, gpu)
        ests[id(g)] = est
        self.est_time_saved_us += est
        self.measured_us += c.measured_us
        self.intermediate_bytes += c.intermediate_bytes


def _analysis(graph: Graph, device: DeviceModel, files, meta: dict, kernels: pd.DataFrame,
              comm_time: CommunicationTime | None = None) -> Analysis:
    not_fused: list = []  # what the fusion rules refused (`fusion.Refused`)
    groups = find_groups(graph, not_fused)
    sigs = list(signatures(graph, groups))
    groups, sigs, iters, odd = _whole_iterations(graph, groups, sigs)
    if odd:
        graph.warnings.append(f"steady-state iteration(s) {', '.join(map(str, odd))} grouped their ops differently "
                              f"from the other {iters} (a stale dataflow binding, a window edge): left out of the "
                              "candidates, which are counted over whole iterations that agree")
    pid_of: dict[str, str] = {}  # family of a signature -> pattern id (its first signature's)
    pattern_of: dict[int, str] = {}  # id(group) -> pattern id
    by_pattern: dict[str, _Pattern] = {}
    gpu = gpu_model() if device.type == "cpu" else None
    ests: dict[int, float] = {}
    whole: set[int] = set()  # id(group) of epilogues whose estimate is not an increment on their base's (conv)
    for g, sig, cost in zip(groups, sigs, group_costs(graph, groups, device)):
        if g.kind == "padded_matmul" and not padding_pays(cost, device):
            continue
        if cost.in_anchor_kernel_us is not None and gpu is None:
            whole.add(id(g))
        phase = graph.nodes[g.members[0]].phase  # one per group (fusion rule 6)
        if phase != "forward":  # the same ops in the backward are another candidate
            sig = f"{sig} @{phase}"
        fam = family(sig)
        pid = pid_of.get(fam) or pid_of.setdefault(fam, pattern_id(sig))
        pattern_of[id(g)] = pid
        if pid not in by_pattern:
            by_pattern[pid] = _Pattern(g, sig, [])
        by_pattern[pid].add(g, cost, device, gpu, ests)
    records, group_map = [], {}
    totals = _totals(graph)
    totals["est_time_saved_us"] = _potential([g for g in groups if id(g) in ests], ests, whole) / iters
    for pid, pat in by_pattern.items():
        first, extends = pat.first, pat.first.extends
        name = title(graph, first, pat.groups)
        rec = {
            "pattern_id": pid, "pattern": pat.sig, "title": name,
            "kind": _kind(graph, first),
            "ops": [graph.nodes[m].op for m in first.members],
            "kernels": _uniq(k for m in first.members for k in graph.nodes[m].kernels),
            "modules": _uniq(module for g in pat.groups for m in g.members if (module := graph.nodes[m].module)),
            "occurrences": _per_iter(len(pat.groups), iters),
            "kernels_saved": _per_iter(pat.kernels_saved, iters),
            "bytes_unfused": _per_iter(pat.bytes_unfused, iters),
            "bytes_fused": _per_iter(pat.bytes_fused, iters),
            "bytes_saved": _per_iter(pat.bytes_saved, iters),
            "est_time_saved_us": pat.est_time_saved_us / iters,
            **({"est_cpu_time_saved_us": pat.est_cpu_time_saved_us / iters} if gpu else {}),
            "measured_time_us": pat.measured_us / iters,
            "intermediate_bytes": _per_iter(pat.intermediate_bytes, iters),
            "confidence": graph.confidence,
            "extends_pattern": _pattern_of(graph, extends, pattern_of, pid_of) if extends else None,
            "graph": _graph_view(graph, first),
            "program": program_of(graph, first),
        }
        # (a conv epilogue's module is cuDNN's fused conv: no Triton compile, one module per shape as a fusion's;
        # unfused attention's kernel fixes the heads where q, k and v are views of one projection, so Swin's four
        # stages (3, 6, 12, 24 heads) were reached at the first stage's one block of seven)
        conv = first.kind == "epilogue" and CONV_EPILOGUE.get(graph.nodes[first.anchor].op) == "conv"
        shaped = first.kind in ("fusion", "attention") or conv
        variants = shape_variants(graph, pat.groups, rec["program"]) if shaped else []
        if variants:  # absent otherwise: analysis.json of a model whose occurrences share one shape is unchanged
            rec["variants"] = variants
        phase = graph.nodes[first.members[0]].phase
        if phase != "forward":  # absent for the forward: analysis.json of an inference trace is unchanged
            rec["phase"] = phase
        refused = not_generated(graph, first)
        if refused:  # a pattern the generator must refuse says so (absent otherwise: the schema is unchanged)
            rec["not_generated"] = refused
        records.append(rec)
        group_map[pid] = pat.groups
    best_us = max((r["est_time_saved_us"] for r in records), default=0.0)
    best_bytes = max((r["bytes_saved"] for r in records), default=0)
    for r in records:
        us, saved = r["est_time_saved_us"], r["bytes_saved"]
        launches_only = saved < NEGLIGIBLE_BYTES_SHARE * best_bytes or saved < NEGLIGIBLE_BYTES * r["occurrences"]
        r["negligible"] = bool(us < NEGLIGIBLE_SHARE * best_us or (launches_only and us < NEGLIGIBLE_LAUNCHES_SHARE * best_us))
    # Ids do not depend on timings, so a candidate keeps its id between `analyze` and `apply` (which profiles
    # again): numbered by what the shapes alone decide, the bytes saved first. The rank is by estimated time.
    for n, r in enumerate(sorted(records, key=_stable_key), 1):
        r["id"] = f"c{n}"
    records.sort(key=lambda r: (r["negligible"], -r["est_time_saved_us"], _stable_key(r)))
    for rank, r in enumerate(records, 1):
        r["rank"] = rank
        # A CPU trace's estimate is what a GPU would save: no share of the CPU time is promised.
        r["share_of_iteration"] = None if gpu else r["est_time_saved_us"] / totals["time_us"] if totals["time_us"] else 0.0
    id_of = {r["pattern_id"]: r["id"] for r in records}
    shared = _shared(by_pattern, ests, iters)
    for r in records:
        r["extends"] = id_of.get(r["extends_pattern"])
        if shared.get(r["pattern_id"]):  # absent otherwise: analysis.json of a model without overlaps is unchanged
            # in id order: the overlaps are found in a set's order, which varies by process (hash seeds)
            r["shared"] = dict(sorted(((id_of[q], v) for q, v in shared[r["pattern_id"]].items()),
                                      key=lambda kv: int(kv[0][1:])))
    groups_by_id = {r["id"]: group_map[r["pattern_id"]] for r in records}
    doc = {
        "schema_version": ANALYSIS_SCHEMA_VERSION,
        "source": {"kineto": str(files.kineto), "et": str(files.et) if files.et else None,
                   "meta": str(files.meta) if files.meta else None},
        "device": {"type": device.type, "name": device.name, "bandwidth_Bps": device.bandwidth_Bps,
                   "launch_us": device.launch_us, "bandwidth_source": device.source},
        "steady_state": {"iterations": graph.iterations,
                         **({"left_out_of_candidates": odd} if odd else {}),
                         "source": (meta.get("steady_state") or {}).get("source", "whole"),
                         **({"training_step": True} if (meta.get("steady_state") or {}).get("training_step") else {})},
        "totals": totals,
        "estimate": _estimate_basis(device, gpu),
        "unknown_ops": graph.unknown_ops.assign(count=lambda d: d["count"] / graph.iterations,
                                                time_us=lambda d: d["time_us"] / graph.iterations).to_dict("records"),
        **({"communication": comm} if (comm := _communication(graph)) else {}),
        **({"communication_time": codec.to_json(comm_time)} if comm_time else {}),
        "low_confidence": graph.confidence == "low",
        "warnings": list(graph.warnings),  # e.g. an ET that cannot be joined
        "timeline": _timeline(graph, groups_by_id),
        "candidates": [{k: v for k, v in r.items() if k != "extends_pattern"} for r in records],
        **({"refused": refusals} if (refusals := _refusals(graph, not_fused, iters)) else {}),
        **({"math_attention": slow} if (slow := math_attention(graph, iters)) else {}),
    }
    cand_df = pd.DataFrame([{k: v for k, v in r.items() if k not in ("graph", "program")} for r in records])
    return Analysis(graph, device, kernels, cand_df, groups_by_id, doc)


# ------------------------------------------------------------------------------------------ pieces
def _refusals(graph: Graph, refused: list, iters: int, keep: int = REFUSALS_KEPT) -> list[dict]:
    """analysis.json's `refused`: what the fusion rules found and refused, one entry per rule, reason and ops,
    the most frequent first (the first `keep`; every one is logged at debug level)."""
    counts: dict[tuple, list] = {}
    for r in refused:
        key = (r.rule, r.why, tuple(graph.nodes[m].op for m in r.members))
        counts.setdefault(key, [0, r.members[0]])[0] += 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1][0], kv[0]))
    for (rule, why, ops), (n, _) in ranked:
        log.debug("not fused (%s, %dx): %s: %s", rule, n, " -> ".join(ops), why)
    return [codec.to_json(Refusal(rule=rule, why=why, ops=ops, occurrences=_per_iter(n, iters),
                    module=graph.nodes[first].module or None))
            for (rule, why, ops), (n, first) in ranked[:keep]]


def _communication(graph: Graph) -> list:
    """Communication between ranks (class COMMUNICATION, a barrier): `name`, `count` and `time_us` per iteration,
    most time first; absent from analysis.json when there is none (a one-process trace is unchanged)."""
    acc: dict = {}
    for n in graph.nodes:
        if n.cls == OpClass.COMMUNICATION:
            c = acc.setdefault(n.op, [0, 0.0])
            c[0] += 1
            c[1] += n.time_us
    iters = max(graph.iterations, 1)
    return sorted(({"name": k, "count": c / iters, "time_us": t / iters} for k, (c, t) in acc.items()),
                  key=lambda r: -r["time_us"])


def _shared(by_pattern: dict, ests: dict, iters: int) -> dict:
    """{pattern id: {other pattern id: {occurrences, est_time_saved_us}}}: of each pattern's occurrences, those
    whose ops another pattern's occurrences also hold (a conv epilogue over a BatchNorm + ReLU, a window chain over
    a conv epilogue's last ops), per iteration, with their estimate. Where the other pattern is patched it takes
    them: the sites left are not an even share of the estimate (MobileNetV3's BatchNorm + ReLU kept its 6 cheaper
    occurrences of 11, the conv epilogue the 5 wide ones: docs/EXPERIMENTS.md: estimate_check)."""
    owners: dict[int, set] = {}
    for pid, pat in by_pattern.items():
        for g in pat.groups:
            for m in g.members:
                owners.setdefault(m, set()).add(pid)
    out: dict = {}
    for pid, pat in by_pattern.items():
        acc: dict = {}
        for g in pat.groups:
            for q in set().union(*(owners[m] for m in g.members)) - {pid}:
                n, e = acc.get(q, (0, 0.0))
                acc[q] = (n + 1, e + ests.get(id(g), 0.0))
        out[pid] = {q: {"occurrences": _per_iter(n, iters), "est_time_saved_us": e / iters} for q, (n, e) in acc.items()}
    return out


def _spread(totals: dict) -> str:
    sp = totals.get("time_us_per_iteration") or {}
    if sp.get("iterations", 0) < 2:
        return ""
    return (f" (median {fmt_time(sp['median'])}, range {fmt_time(sp['min'])} – {fmt_time(sp['max'])} "
            f"over {sp['iterations']} iterations)")


def _pattern_of(graph: Graph, g: Group, pattern_of: dict, pid_of: dict) -> str:
    """The pattern id of group `g`: its own when it is a candidate, else its family's, else its signature's hash."""
    if id(g) in pattern_of:
        return pattern_of[id(g)]
    sig = signature(graph, g)
    return pid_of.get(family(sig)) or pattern_id(sig)


def _census(graph: Graph, g: Group, sig: str) -> tuple:
    """What makes two occurrences one candidate: the signature's family and the part of the step it ran in."""
    return family(sig), graph.nodes[g.members[0]].phase


def _whole_iterations(graph: Graph, groups: list, sigs: list) -> tuple[list, list, int, list]:
    """(groups, signatures, iterations, left-out iterations): the groups of the steady iterations whose census
    (how many occurrences of each candidate) the majority of iterations share, when more than half share one
    and some do not. A steady state repeats: a deterministic model's iterations run the same ops, and an
    iteration grouped otherwise is an artefact of the trace, not of the model (on a CPU, a tensor read at an
    address another tensor had freed binds to that stale writer, which makes a value look shared by two
    layers; a window's edge). Counted over all iterations, such a run gave 2.6 occurrences a call, and
    candidates and ids that changed from one profile of the model to the next. Without a majority (a workload
    that varies from call to call) every iteration counts, as before."""
    iters = graph.iterations
    if iters < 3:
        return groups, sigs, iters, []
    per_iteration: dict[int, Counter] = {k: Counter() for k in range(iters)}
    iteration_of = [graph.nodes[g.members[0]].iteration for g in groups]
    for g, sig, k in zip(groups, sigs, iteration_of):
        if k in per_iteration:
            per_iteration[k][_census(graph, g, sig)] += 1
    shapes = Counter(frozenset(c.items()) for c in per_iteration.values())
    common, agree = shapes.most_common(1)[0]
    if agree == iters or 2 * agree <= iters:
        return groups, sigs, iters, []
    odd = sorted(k for k, c in per_iteration.items() if frozenset(c.items()) != common)
    keep = [k not in odd for k in iteration_of]
    return ([g for g, ok in zip(groups, keep) if ok], [s for s, ok in zip(sigs, keep) if ok], agree, odd)


def _stable_key(r: dict) -> tuple:
    return (-r["bytes_saved"], -r["kernels_saved"], -r["occurrences"], r["pattern_id"])


def _estimate_basis(device: DeviceModel, gpu: DeviceModel | None) -> dict:
    """What `est_time_saved_us` means, for the reports to say."""
    if gpu is None:
        return {"basis": "measured", "device": device.type, "bandwidth_Bps": device.bandwidth_Bps,
                "launch_us": device.launch_us,
                "l2_bytes": device.l2_bytes,
                "note": "the unfused kernels' measured time minus a roofline estimate of the fused kernel (inputs "
                        "still in L2 from the kernel that wrote them not counted as HBM traffic)"}
    return {"basis": "gpu_bytes_model", "device": gpu.type, "bandwidth_Bps": gpu.bandwidth_Bps,
            "launch_us": gpu.launch_us,
            "note": "what a GPU would save by the bytes model (bytes saved at its bandwidth plus the launches saved); "
                    "the fused kernels are Triton kernels, which on the CPU run in the interpreter"}


def _potential(groups: list[Group], ests: dict[int, float], whole: set[int] = frozenset()) -> float:
    """What fusing every candidate could save, each op counted once. Candidates that share ops are alternatives
    (an epilogue and the pointwise group it extends, the gate and the up projection's epilogue of one SwiGLU,
    attention and its softmax): of each set of groups linked by shared ops, the best alone counts. An epilogue's
    estimate is on top of its base group's (see cost.est_time_saved_us), so alone it is worth both; a conv
    epilogue's (`whole`) is all it saves already."""
    parent = list(range(len(groups)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for i, g in enumerate(groups):
        for m in g.members:
            j = owner.setdefault(m, i)
            if j != i:
                parent[root(i)] = root(j)
    best: dict[int, float] = {}
    for i, g in enumerate(groups):
        incremental = g.kind == "epilogue" and g.extends is not None and id(g) not in whole
        alone = ests[id(g)] + (ests.get(id(g.extends), 0.0) if incremental else 0.0)
        r = root(i)
        best[r] = max(best.get(r, 0.0), alone)
    return sum(best.values())


def _per_iter(total: float, iters: int):
    v = total / iters
    return int(round(v)) if abs(v - round(v)) < 1e-9 else round(v, 3)


def _uniq(items) -> list:
    return list(dict.fromkeys(items))


def _kind(graph: Graph, g: Group) -> str:
    """analysis.json's `kind`: a value of `advisor.records.Kind` (the vocabulary every later stage reads)."""
    if g.kind != "fusion":  # the rules that anchor a group on a matmul name it
        return Kind(g.kind).value
    if group_family(graph, g) in NORMS:
        return Kind.NORM.value  # LayerNorm, RMSNorm (however it is spelled in ops), BatchNorm
    return (Kind.REDUCTION if g.rows else Kind.POINTWISE).value


def _totals(graph: Graph) -> dict:
    iters = graph.iterations
    by_class = {c: 0.0 for c in CLASS_ORDER}
    key = {c: c.value if c.value in by_class else "other" for c in OpClass}  # (Enum .value is slow)
    kernels, mem, cuda = 0, 0, graph.device_type == "cuda"
    per_iter = [0.0] * max(iters, 1)
    comm = 0.0
    for n in graph.nodes:  # one pass; each sum in node order, as ever
        t = n.time_us
        if n.cls is OpClass.COMMUNICATION:  # another stream's or thread's time, overlapping compute: apart
            comm += t
            continue
        by_class[key[n.cls]] += t
        kernels += len(n.kernels) if cuda else 1
        if n.cls in MEMORY_BOUND:
            mem += t
        if 0 <= n.iteration < len(per_iter):
            per_iter[n.iteration] += t
    total = sum(by_class.values())
    return {"kernels": _per_iter(kernels, iters), "time_us": total / iters,
            "time_kind": "gpu" if cuda else "cpu",
            # The spread over the recorded iterations: one figure hides a noisy run (CPU times swing).
            "time_us_per_iteration": {"median": float(np.median(per_iter)), "min": min(per_iter),
                                      "max": max(per_iter), "iterations": len(per_iter)},
            "by_class": {k: v / iters for k, v in by_class.items()},
            "memory_bound_share": mem / total if total else 0.0,
            **({"communication_us": comm / iters} if comm else {})}


def _timeline(graph: Graph, groups_by_id: dict, keep: int = 5000) -> list:
    """The first iteration's kernels (ops, on CPU traces) in time order, the first `keep` of them. Rows are
    made only for those: at a million kernels, sorting start times is cheap, a dict per kernel is not."""
    first = [n for n in graph.nodes if n.iteration == 0] or graph.nodes
    spans = [n.kernel_spans or ((n.op, n.ts, n.dur),) for n in first]  # an op without kernels: its own span
    owner = np.repeat(np.arange(len(first)), np.fromiter(map(len, spans), np.int64, len(spans)))
    flat = list(chain.from_iterable(spans))
    if not flat:
        return []
    ts = np.fromiter(map(itemgetter(1), flat), np.float64, len(flat))
    ts -= ts.min()
    kept = np.argsort(ts, kind="stable")[:keep].tolist()  # stable: ties stay in node order, as a list sort keeps them
    cand_of = {}
    for cid, groups in groups_by_id.items():
        for g in groups:
            for m in g.members:
                cand_of.setdefault(m, cid)
    rows = []
    for k in kept:
        n = first[owner[k]]
        name, _, dur = flat[k]
        rows.append({"name": name, "ts_us": float(ts[k]), "dur_us": dur, "op": n.op, "class": n.cls.value,
                     "module": n.module, "candidate": cand_of.get(n.idx)})
    return rows


def _graph_view(graph: Graph, g: Group) -> dict:
    """The candidate's subgraph for dataflow diagrams: inputs -> op nodes -> outputs, sizes on edges."""
    from advisor.analysis.cost import external_io

    local = {m: f"n{i}" for i, m in enumerate(g.members)}
    reads, escapes = external_io(graph, g.members)
    ins = {v: f"in{i}" for i, v in enumerate(reads)}
    outs = {v: f"out{i}" for i, v in enumerate(escapes)}
    val = graph.values

    def desc(vid, nbytes):
        v = val[vid]
        return {"shape": list(v.shape), "dtype": torch_dtype_name(v.dtype), "bytes": int(nbytes)}

    nodes = [{"id": local[m], "op": graph.nodes[m].op, "label": op_label(graph.nodes[m]),
              "class": graph.nodes[m].cls.value, "module": graph.nodes[m].module,
              "kernel": graph.nodes[m].kernels[0] if graph.nodes[m].kernels else None,
              "time_us": graph.nodes[m].time_us} for m in g.members]
    edges = []
    for m in g.members:
        for u in graph.nodes[m].reads:
            p = val[u.value].producer
            src = local.get(p) or ins.get(u.value)
            if src:
                edges.append({"src": src, "dst": local[m], **desc(u.value, u.bytes), "shape": list(u.shape)})
    for vid, nbytes in escapes.items():
        edges.append({"src": local[val[vid].producer], "dst": outs[vid], **desc(vid, nbytes)})
    return {"nodes": nodes, "inputs": [{"id": ins[v], **desc(v, b)} for v, b in reads.items()],
            "outputs": [{"id": outs[v], **desc(v, b)} for v, b in escapes.items()], "edges": edges}


MAX_SHAPE_VARIANTS = 7  # programs beyond the first: each is one more kernel to compile and validate


def shape_variants(graph: Graph, groups: list, first: dict) -> list[dict]:
    """The programs of a pattern's occurrences at shapes other than its first's, most frequent first.
    A convnet's BatchNorm + ReLU occurs at each stage's channels and resolution: a kernel is compiled for
    sizes, so the first occurrence's program alone reached one stage (ResNet-50: 2 of 33 sites)."""
    by_layout: dict[tuple, list] = {}  # the layouts a group reads and writes -> [group, count]
    for g in groups:
        by_layout.setdefault(_layouts(graph, g), [g, 0])[1] += 1  # a program per layout, not per occurrence
    seen: dict[str, list] = {json.dumps(first, sort_keys=True): [first, 0]}
    for g, count in by_layout.values():
        program = program_of(graph, g)
        seen.setdefault(json.dumps(program, sort_keys=True), [program, 0])[1] += count
    others = list(seen.values())[1:]
    others.sort(key=lambda e: -e[1])  # stable: ties keep the order the occurrences came in
    return [program for program, _ in others[:MAX_SHAPE_VARIANTS]]


def _layouts(graph: Graph, g: Group) -> tuple:
    return tuple((tuple(u.shape), tuple(u.strides), u.offset) for m in g.members
                 for u in (*graph.nodes[m].reads, *graph.nodes[m].writes))


def program_of(graph: Graph, g: Group) -> dict:
    """The candidate as a self-contained op program: what the generator lowers and validation replays."""
    from advisor.analysis.cost import external_io

    reads, escapes = external_io(graph, g.members)
    names: dict[int, str] = {}
    inputs = []
    for vid in reads:
        # The widest view through which the group reads this tensor is what the kernel gets.
        use = max((u for m in g.members for u in graph.nodes[m].reads if u.value == vid), key=lambda u: u.bytes)
        names[vid] = f"in{len(inputs)}"
        inputs.append({"id": names[vid], "shape": list(use.shape), "strides": list(use.strides),
                       "dtype": torch_dtype_name(use.dtype), "storage_offset": use.offset})
    nodes = []
    for i, m in enumerate(g.members):
        n = graph.nodes[m]
        outs = []
        for j, u in enumerate(n.writes):
            names[u.value] = f"v{i}_{j}" if len(n.writes) > 1 else f"v{i}"
            outs.append({"id": names[u.value], "shape": list(u.shape), "strides": list(u.strides),
                         "dtype": torch_dtype_name(u.dtype)})
        args = []
        read_iter = iter(n.reads)

        def ref(u):
            return {"ref": names.get(u.value, "?"), "shape": list(u.shape), "strides": list(u.strides),
                    "storage_offset": u.offset}

        for kind, value in n.args:
            if kind == "t":
                args.append(ref(next(read_iter)))
            elif kind == "tl":
                args.append({"list": [ref(next(read_iter)) for _ in value]})
            else:
                args.append({"value": value})
        nodes.append({"id": f"n{i}", "op": n.op, "schema": n.schema, "args": args, "outputs": outs,
                      "inplace": n.inplace})
    return {"inputs": inputs, "nodes": nodes, "outputs": [names[v] for v in escapes]}
