"""The steps after the profile that `optimize` (a live model, `live_model`) and `apply` (a user's script,
`user_script`) share, each written once; the two drivers call them in this order:

    start_workers / start_triton    on a GPU, while the profile runs
    analyse                         the trace -> OUT/analysis.json (rank 0's in a distributed job)
    make_kernels                    kernels for the top candidates, and the plan that patches them in
    checked_status                  each result's status once the patched outputs were compared
    selected_status                 ... once selection chose between the layer and the outer captures
    apply_doc                       apply.json's record, the fields both drivers fill

What stays in a driver is what differs between a live model and a script: how the profile is taken, how the
model is patched (a handle, or the script re-run under a session), how outputs are checked and which states
selection can time. Plan reuse, the early capture, training, counting and decode only exist for a live model.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from advisor import agreement
from advisor.analysis.api import analyze
from advisor.documents import AnalysisDoc, ApplyDoc, Selection, write_analysis
from advisor.patching import build_plan, occurrence_modules, triton_setup
from advisor.records import PatternResult
from advisor.workflows.bundle import loaded_host_modules
from advisor.workflows.generate import warm_worker
from advisor.workflows.kernels import kernel_specs
from advisor.workflows.outcome import pattern_status
from advisor.workflows.selection import final_status
from advisor.workflows.workers import start_soon


@dataclass(frozen=True)
class Analysed:
    """What the plan is built from: analysis.json's document and each occurrence's modules."""

    doc: dict
    occurrences: dict


def start_workers(device: str) -> None:
    """On a GPU the kernel workers start (3-4 s of imports on the H100) while the profile and the analysis run, so
    that they are up when the kernels are generated; on the CPU kernels are generated in process."""
    if device == "cuda":
        start_soon(warm_worker)


def start_triton(device: str, replacement: str) -> None:
    """Triton's setup hashed in the background where Triton kernels will be launched (a GPU, `kernel`)."""
    if device == "cuda" and replacement == "kernel":
        triton_setup.start()


def analyse(trace_dir: Path, out_dir: Path) -> Analysed:
    """The trace analysed, written to OUT/analysis.json. In a distributed job rank 0's analysis is every rank's
    plan: a rank's profile may group its ops otherwise."""
    analysis = analyze(trace_dir)
    doc, occurrences = agreement.agreed((analysis.doc, occurrence_modules(analysis)), "plan")
    write_analysis(out_dir, AnalysisDoc.from_json(doc))
    return Analysed(doc, occurrences)


def make_kernels(analysed: Analysed, top: int | None, replacement: str, out_dir: Path, device: str,
                 granularity: str, phases=None, inductor: bool | str = False) -> tuple[list, list[PatternResult], object]:
    """(specs, results, plan): the kernels generated and validated for the top candidates, and the plan that
    patches them in. `phases`: the caller's `Stopwatch` (`generate`, then `patch` for the plan)."""
    phase = phases or (lambda name: contextlib.nullcontext())
    with phase("generate"):
        specs, records = kernel_specs(analysed.doc, top, replacement, out_dir, device)
    with phase("patch"):
        plan = build_plan(specs, analysed.doc, analysed.occurrences, granularity, inductor)
    return specs, records, plan


def checked_status(records: list[PatternResult], specs: list, handle, dropped: dict, doc: dict,
                   launched: dict | None = None) -> list[PatternResult]:
    """Each result's status once the patched outputs were compared: patched where its sites ran and its
    pattern was not dropped by the check. `launched`: the sites whose launchers ran (None: those substituted)."""
    return pattern_status(records, specs, handle, dropped, doc, launched)


def selected_status(records: list[PatternResult], specs: list, handle, dropped: dict, doc: dict, selection: dict,
                    launched: dict | None = None) -> list[PatternResult]:
    """Each result's status as selection left it, where selection chose a state with the outer captures on the
    table: patterns fused only across layers are then patched, or not kept, by that choice, and their sites are
    those of the state chosen. Elsewhere the results stand as selection marked them."""
    if selection.get("outer_sites") is None or not selection.get("state"):
        return records
    return final_status(records, specs, handle, dropped, doc,
                        selection["outer_sites"] if selection.get("outer") else launched, selection)


def apply_doc(*, replacement: str, device: str, records: list[PatternResult], manifest: list, checks: list,
              end_to_end: dict | None, selection: dict | None, enabled, outer: bool, plan,
              **driver_fields) -> ApplyDoc:
    """apply.json's record: the fields both drivers fill, and those only one of them has (`driver_fields`:
    the script and its arguments, plan reuse, training, ...). `enabled`: the pattern keys selection left running
    (None: every one)."""
    return ApplyDoc(
        replacement=replacement, device=device, patterns=tuple(records), manifest=manifest, checks=checks,
        end_to_end=end_to_end, selection=Selection.from_json(selection) if selection is not None else None,
        enabled=None if enabled is None else tuple(enabled), outer=outer, inductor=getattr(plan, "inductor", False) or None,
        skipped_targets=getattr(plan, "skipped", {}), host_modules=loaded_host_modules() if device == "cuda" else [],
        **driver_fields)
