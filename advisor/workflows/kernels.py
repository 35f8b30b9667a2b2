"""Kernels for the top candidates: generated and validated (or a stand-in), as `PatternSpec`s.

`replacement="kernel"` runs the generator's pipeline (`advisor.workflows.generate.generate_candidates`:
on-disk cache, validation, modules written to OUT/kernels, apply.json `patterns`), so the plan in OUT
is self-contained. `program` and `subgraph` patch in stand-ins instead (the program replayed by
PyTorch / the matched ops themselves), which tests the patcher without the generator. Returns the
specs to patch and one `PatternResult` per candidate tried.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from advisor.ops.registry import cublaslt_epilogue
from advisor.patching.containment import holds
from advisor.patching.plan import PatternSpec, spec_from_candidate
from advisor.records import Candidate, Kind, PatternResult, Verdict, candidates_of
from advisor.status import Status
from advisor.validate import interpreted
from advisor.workflows.generate import expected_kernels, generate_results, kernel_path, pattern_record, \
    shape_candidates, record_patterns


MIN_SHARE = 0.005  # of the best candidate's estimated saving
# Of a call's GPU time (the trace's kernels per iteration): a saving under it is below what timing the model
# resolves (the zoo's whole-stack CUDA graphs: one state's summed kernel time moved by ~1% between two profiles,
# docs/EXPERIMENTS.md: estimate_check), so selection could never show it, and each pattern costs compiles at
# `optimize` and a timed state in selection.
MIN_CALL_SHARE = 0.005


def kernel_specs(doc: dict, top: int | None, replacement: str, out_dir: Path, device_type: str,
                 gpu_free=None) -> tuple[list[PatternSpec], list[PatternResult]]:
    """(specs to patch, one result per top candidate of analysis.json document `doc`, in rank order).
    With `replacement="kernel"` OUT/apply.json is written with the generated results, as `generate` does.
    `gpu_free`: see `generate_results`."""
    top_candidates, chosen, negligible = _chosen(doc, top, device_type)
    if replacement == "kernel":
        results = generate_results(chosen, Path(out_dir), every=candidates_of(doc), gpu_free=gpu_free)
        record_patterns(out_dir, results)
    else:
        results = [pattern_record(c, validated=True, errors={}, source="",
                                  reason=f"stand-in replacement ({replacement}), not a generated kernel")
                   for c in chosen]
    by_id = {c.id: c for c in chosen}
    specs, records = [], []
    for r in results:
        c = by_id[r.candidate]
        r = dataclasses.replace(r, replacement=replacement, est_time_saved_us=c.est_time_saved_us,
                                occurrences=c.occurrences, shared=c.shared)
        records.append(r)
        # the patcher reads analysis.json's candidate entry
        if replacement != "kernel":
            specs.append(spec_from_candidate(c.to_json(), replacement))
        elif r.validated and r.kernel_file:
            specs.append(spec_from_candidate(c.to_json(), "kernel", r.kernel_file, r.device_type or device_type,
                                             r.variants))
    rank = {c.id: i for i, c in enumerate(top_candidates)}
    return substitution_order(specs), sorted(records + negligible, key=lambda r: rank[r.candidate])


def expected_specs(doc: dict, top: int | None, out_dir: Path, device_type: str) -> list[PatternSpec]:
    """The specs `kernel_specs(doc, top, "kernel", out_dir, device_type)` returns when every kernel validates,
    known before any is generated: the kernel modules' paths are fixed (`generate.kernel_path`)."""
    _, chosen, _ = _chosen(doc, top, device_type)
    validated_on = "cpu" if interpreted() else "cuda"  # as each job records it
    specs = []
    for c in expected_kernels(chosen, candidates_of(doc)):
        variants = [{"index": i, "kernel_file": str(kernel_path(out_dir, s))}
                    for i, s in enumerate(shape_candidates(c), 1)]
        specs.append(spec_from_candidate(c.to_json(), "kernel", str(kernel_path(out_dir, c)), validated_on, variants))
    return substitution_order(specs)


def _chosen(doc: dict, top: int | None, device_type: str) -> tuple[list[Candidate], list[Candidate], list[PatternResult]]:
    """(the top candidates, those worth a kernel, the results of the rest)."""
    top_candidates = candidates_of(doc)[:None if top is None else max(0, top)]
    # Estimates from a CPU trace are CPU times, noisy at tiny sizes and unrelated to what a GPU saves: the
    # cut-off (a guard against captures that cost more than they save) applies to GPU traces only.
    totals = doc.get("totals") or {}
    call_us = totals.get("time_us") if totals.get("time_kind") == "gpu" else None
    chosen, negligible = worth_patching(top_candidates, call_us) if device_type == "cuda" else (top_candidates, [])
    return top_candidates, chosen, negligible


def substitution_order(specs: list[PatternSpec]) -> list[PatternSpec]:
    """The specs in the order the patcher substitutes them (where patterns overlap, the first takes the ops):
    rank order, except that a pattern goes before the earlier ones the matcher finds inside its program
    (`containment.holds`): where both are, the trace gave those ops to the longer one, and fusing more of them
    only saves more (BART's embedding `mul` -> `add` -> `layer_norm` was found nowhere once the residual `add` ->
    `layer_norm` had taken its last two ops). Epilogues keep rank order: theirs is a trade against cuBLAS that
    selection measures. What extends a chain by the analysis's record (a window chain, a conv epilogue) is put
    before that chain by `patching.plan.patch_order`, on every path that builds a plan."""
    out = list(specs)
    for s in [s for s in out if not s.anchored]:
        i = out.index(s)
        base = next((j for j, t in enumerate(out[:i]) if holds(s, t) and not holds(t, s)), None)
        if base is not None:
            out.remove(s)
            out.insert(base, s)
    return out


def worth_patching(candidates: list[Candidate], call_us: float | None = None) -> tuple[list[Candidate], list[PatternResult]]:
    """(candidates to patch, results of the rest), in rank order. A pattern estimated to save nothing is not
    generated (a GEMM epilogue whose Triton GEMM loses more to cuBLAS than fusing saves: each costs a compile
    and a place in selection's timed states). One saving under 0.5% of the best one's estimate is not worth
    its patch: each patched module is captured by dynamo and run from a graph, and a tiny pattern in a
    model's root (a mask computation) would make the whole model one capture, tracing every layer, for a
    microsecond. A saving under `MIN_CALL_SHARE` of `call_us` (the trace's GPU time per call, when known) is
    below what timing the model can show alone; such patterns are judged together, as Inductor fuses every
    region however small: where their savings add up to that share, every one of them is patched (selection
    then times them among every pattern on, not alone), else none is."""
    best = max((c.est_time_saved_us or 0.0 for c in candidates), default=0.0)
    keep, small, rest = [], [], []

    def drop(c: Candidate, why: str, code: Status = Status.NOT_WORTH) -> None:
        rest.append(pattern_record(c, errors={}, source="", est_time_saved_us=c.est_time_saved_us or 0.0,
                                   occurrences=c.occurrences, reason=why, verdict=Verdict(code, why)))

    for c in candidates:
        est = c.est_time_saved_us or 0.0
        if c.kind is Kind.EPILOGUE and cublaslt_epilogue(c.ops):
            drop(c, "cuBLASLt's epilogue, not a kernel of ours: on CUDA a linear read only by this activation runs "
                    "as one cuBLASLt GEMM with the activation applied before its output is written, where timed "
                    "faster than the two kernels (`patching.gemm_epilogues`; apply.json's `gemm_epilogues` lists "
                    "them)", Status.CUBLASLT)
        elif c.est_time_saved_us is not None and est <= 0:
            drop(c, "not worth patching: estimated to save nothing" + (
                " (the Triton GEMM an epilogue runs is slower than cuBLAS's by more than fusing saves: "
                "analysis/cost.py's TRITON_GEMM_SLOWDOWN)" if c.kind is Kind.EPILOGUE else ""))
        elif best > 0 and est < MIN_SHARE * best:
            drop(c, f"not worth patching: estimated saving {est:.2g} µs per iteration "
                    f"is under {MIN_SHARE:.1%} of the best pattern's ({best:.3g} µs)")
        elif c.est_time_saved_us is not None and call_us and est < MIN_CALL_SHARE * call_us:
            small.append(c)
        else:
            keep.append(c)
    together = sum(c.est_time_saved_us or 0.0 for c in small)
    if small and together >= MIN_CALL_SHARE * call_us:
        keep.extend(small)
    for c in small if small and together < MIN_CALL_SHARE * call_us else []:
        drop(c, f"not worth patching: estimated saving {c.est_time_saved_us:.2g} µs per iteration, and "
                f"{together:.3g} µs together with the {len(small) - 1} other patterns each under "
                f"{MIN_CALL_SHARE:.1%} of a call's GPU time ({call_us / 1e3:.3g} ms): below what timing the "
                "model can show")
    order = {c.id: i for i, c in enumerate(candidates)}
    return sorted(keep, key=lambda c: order[c.id]), rest
