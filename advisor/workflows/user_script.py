"""`fusion-advisor apply SCRIPT`: profile -> analyse -> generate + validate -> patch -> re-run -> compare
-> benchmark, writing OUT/apply.json. Only OUT is written; the script's files are never touched.

The re-run patches the script's models as it builds them (`script.intercept_roots`) and compares the
first calls patched vs unpatched on the same inputs. Timing follows the steady state the collector
found:
- module: the recorded last call of the outermost module is replayed (warm-up, then >= `iters` calls
  with CUDA events): unpatched, patched, captured with every site on its original ops, and each
  pattern alone (its contribution = captured-only minus alone), the analyzer's estimate beside it;
- region: the script is re-run, unpatched then patched, timing each `advisor.region(NAME)` occurrence
  (the first of each run is warm-up) until `iters` samples; no per-pattern split;
- whole: whole script runs, three of each.
On the CPU kernels run in Triton's interpreter: `timing_meaningful: false`, and nothing is timed.
"""
from __future__ import annotations

import contextlib
import statistics
import textwrap
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from advisor.measure.timing import timing_meaningful
from advisor.collect.region import observe_regions
from advisor.collect.runner import profile_script, resolve_device
from advisor.documents import APPLY_FILE, SelectionState, write_apply
from advisor.patching import attention_layouts, gemm_epilogue_notes, inductor_outcomes
from advisor.patching.modules import root_class
from advisor.records import PatternResult
from advisor.workflows import pipeline
from advisor.workflows.script_session import Session, intercept_roots, run_script
from advisor.workflows.selection import Option, choose, compare_states, mark_kept, time_patterns

class Handles:
    """The patch handles of every model instance the script built, read as one."""

    def __init__(self, session: Session):
        self.session = session

    @property
    def plan(self):
        return self.session.plan

    @property
    def reached(self) -> bool:
        return bool(self.session.handles)

    def _logs(self, key=None):
        seen = {}
        for h in self.session.handles:
            for log in h._logs(key):
                seen.setdefault(id(log), log)
        return list(seen.values())

    def sites(self, key):
        return sum(log.count(key) for log in self._logs(key))

    def site_objects(self, key):
        return [s for log in self._logs(key) for s in log.sites.get(key, [])]

    def rejected(self, key):
        return [r for log in self._logs(key) for r in log.rejected.get(key, [])]

    @property
    def outer(self) -> list:
        return [f for h in self.session.handles for f in h.outer]

    @property
    def outer_on(self) -> bool:
        return any(h.outer_on for h in self.session.handles)

    def set_outer(self, on: bool) -> None:
        for h in self.session.handles:
            h.set_outer(on)

    def launches(self) -> dict:
        return {k: n for h in self.session.handles for k, n in h.launches().items()}

    def inductor_graphs(self) -> dict:
        return inductor_outcomes(self._logs())

    def attention_layouts(self) -> dict:
        return attention_layouts(self._logs())

    def gemm_epilogues(self) -> dict:
        return gemm_epilogue_notes(self._logs())

    def fallbacks(self) -> dict:
        return {k: v for h in self.session.handles for k, v in h.fallbacks().items()}

    def manifest(self):
        out, seen = [], set()
        for h in self.session.handles:
            for e in h.manifest():
                k = (e["module"], e["pattern_id"])
                if k not in seen and e["pattern_id"] + ":" + e["replacement"] not in self.session.dropped:
                    seen.add(k)
                    out.append(e)
        return out


def apply_script(script: Path, args: list, out: Path, top: int | None = 5, device: str = "auto", region: str | None = None,
                 replacement: str = "kernel", iters: int = 20, granularity: str = "layer", console=None,
                 train: bool = False, inductor: bool | str = False) -> dict:
    console = console or Console(highlight=False, soft_wrap=True)
    out = Path(out)
    dev = resolve_device(device)
    pipeline.start_workers(dev)  # while the script is profiled
    pipeline.start_triton(dev, replacement)
    meta = profile_script(script, args, out_dir=out, device=device, region=region, console=console)
    with console.status("analysing the trace …"):
        analysed = pipeline.analyse(out / "trace", out)
    with console.status("generating and validating kernels for " + (f"the top {top} candidates …" if top else
                                                                     "every candidate worth one …")):
        specs, records, plan = pipeline.make_kernels(analysed, top, replacement, out, dev, granularity,
                                                     inductor=inductor)
    session = Session(plan, train=train)
    args = list(args)
    if args and args[0] == "--":
        args = args[1:]
    try:
        with console.status(f"re-running {script.name} with {len(specs)} pattern(s) patched …"):
            with intercept_roots(session):
                run_script(script, args, dev)
        handles = Handles(session)
        records = pipeline.checked_status(records, specs, handles, session.dropped, analysed.doc)
        steady = meta.get("steady_state") or {}
        with console.status("timing the steady state before and after …"):
            # Training: what counts is the whole step (forward, backward, optimizer), so the script's own
            # runs (or its region) are timed, never a replay of the forward call alone.
            recorded = None if train or steady.get("source") != "module" else \
                session.recorded.get(root_class(steady.get("name") or ""))
            e2e, records = _benchmark(script, args, dev, steady, session, handles, records, iters, train, recorded)
            selection, records = select(records, e2e, recorded, dev, iters, session.plan, handles)
        records = pipeline.selected_status(records, specs, handles, session.dropped, analysed.doc, selection)
        # A state chosen (the captures alone included): every captured module, `enabled` saying which
        # patterns run there, as `optimize` stores it; nothing chosen: an empty manifest, which patches nothing.
        chosen = selection.get("state") is not None or bool(selection["kept"])
        errors = list(session.errors)
        if not session.handles:
            errors.append(f"no instance of {', '.join(sorted(session.roots)) or 'a planned module'} "
                          "was called while the script ran: nothing was patched")
        document = pipeline.apply_doc(
            replacement=replacement, device=dev, records=records, manifest=handles.manifest() if chosen else [],
            checks=session.checks, end_to_end=e2e, selection=selection, enabled=selection.get("enabled"),
            outer=bool(selection.get("outer")), plan=plan,
            script=str(script), args=tuple(args), errors=errors, train=train,
            inductor_graphs=handles.inductor_graphs() or None, attention_layouts=handles.attention_layouts() or None,
            gemm_epilogues=handles.gemm_epilogues() or None)
    finally:
        session.close()
    write_apply(out, document)
    doc = document.to_json()
    print_summary(console, doc, out)
    return doc


def _benchmark(script, args, dev, steady, session, handles, records: list[PatternResult], iters,
               train: bool = False, recorded=None) -> tuple:
    """(the steady state timed before and after, the results). With the steady state recorded as one
    module call (`recorded`: the script does not train), that call is timed by selection's one comparison
    (`select`), each pattern alone among its states; else the script's own runs (or its region) are timed
    before and after."""
    base = {"steady_state": {"source": steady.get("source"), "name": steady.get("name")}}
    if not timing_meaningful(dev):
        return {**base, "timing_meaningful": False, "device": dev,
                "reason": "kernels run in Triton's interpreter on the CPU; no speedup is claimed"}, records
    if recorded is not None:
        if any(r.patched for r in records):
            return {**base, "timing_meaningful": True, "device": dev, "timed_by": "selection"}, records
        timed, records = time_patterns(recorded.replay, handles, dev, iters, records)  # before and after alike
        return {**base, **timed}, records
    before = _script_timing(script, args, dev, steady, None, iters)
    after = _script_timing(script, args, dev, steady, session.plan, iters, train)
    return {**base, "timing_meaningful": True, "device": dev, "method": before["method"], "iters": before["iters"],
            "before_ms": before["median_ms"], "after_ms": after["median_ms"],
            "speedup": round(before["median_ms"] / after["median_ms"], 4) if after["median_ms"] else None,
            "note": "per-pattern contributions are measured only when the steady state is a module call"}, records


def select(records: list[PatternResult], e2e: dict, recorded, dev: str, iters: int, plan, handles=None) -> tuple:
    """What the plan keeps, as `optimize` decides it. With the script's steady state recorded as one module
    call, the same final comparison as `optimize`'s (`selection.compare_states`: every pattern, those shown
    to save time alone, the captures alone, the whole stack as one capture where the plan has it), on that
    call, and the state chosen is the one the manifest describes. Without one (a region or whole-script
    runs) the patched run is judged as a whole against the unpatched one, by the same policy (`choose`).
    Kept nothing: apply.json's manifest is empty (`advisor.patch(model, OUT)` then changes nothing).
    Returns (the decision, the results with `kept` and their verdicts)."""
    patched = [r for r in records if r.patched]
    if not patched or not e2e.get("timing_meaningful"):
        return {"decision": "every patched pattern kept (no timing here to select by)",
                "kept": [r.candidate for r in patched]}, records
    if recorded is not None and handles is not None:
        best, out, records = compare_states(recorded.replay, handles, dev, records, iters)
        e2e.update(handed_back(out.pop("timing"), out, best))
        e2e.pop("timed_by", None)
        handles.set_outer(bool(best and best.outer))
        out["before_ms"], out["after_ms"] = e2e["before_ms"], e2e["after_ms"]
        return out, records
    before = e2e["before_ms"]
    rounds = [before, before]  # whole runs: no paired rounds, the margin is the policy's 1%
    best = choose(before, rounds, [Option(SelectionState.ALL, None, e2e["after_ms"], rounds_ms=(e2e["after_ms"],) * 2)])
    key_of = {s.candidate: s.key for s in plan.patterns}
    records = mark_kept(records, key_of, frozenset(key_of.values()) if best else frozenset(), best is not None)
    kept = [r.candidate for r in records if r.kept]
    decision = (f"kept every patched pattern: {before:.3f} -> {e2e['after_ms']:.3f} ms" if best else
                f"nothing kept: the patched run is not faster beyond 1% ({before:.3f} -> {e2e['after_ms']:.3f} ms)")
    return {"decision": decision, "kept": kept, "before_ms": before, "after_ms": e2e["after_ms"]}, records


def handed_back(first: dict, decision: dict, best) -> dict:
    """apply.json's `end_to_end`: the steady state before and in the state handed back, as selection's final
    run timed them side by side (`decision["final"]`), not the every-pattern state of its first run (BERT
    on the H100 read "2.14 -> 2.25 ms, 1.05x slower" above a selection that kept the whole stack at
    2.17 -> 1.43 ms). Nothing kept: the unpatched model is what runs, 1.00x. The first run's every-pattern
    timing stays beside it (`all_patched`)."""
    final = decision["final"]
    before = final["before"]
    after = final[best.name] if best else before
    return {**{k: v for k, v in first.items() if k != "after"},
            "all_patched": {k: first.get(k) for k in ("before_ms", "after_ms", "speedup", "after")},
            "state": best.name if best else None, "before_ms": before, "after_ms": after,
            "speedup": round(before / after, 4) if after else None,
            "noise_ms": final["margin_ms"].get(best.name) if best else None}


def _script_timing(script, args, dev, steady, plan, iters: int, train: bool = False, max_runs: int = 10) -> dict:
    """Re-run the script (patched when `plan` is given, training through the fused kernels with `train`),
    timing region occurrences or whole runs."""
    name = steady.get("name") if steady.get("source") == "region" else None
    samples: list[float] = []
    for _ in range(max_runs if name else 3):
        timer = _RegionTimer(name, dev) if name else None
        session = Session(plan, compare_calls=0, train=train) if plan is not None else None
        t0 = time.perf_counter()
        with (intercept_roots(session) if session else contextlib.nullcontext()), \
                (observe_regions(timer.time_region) if timer else contextlib.nullcontext()):
            run_script(script, args, dev)
        _sync(dev)
        wall = (time.perf_counter() - t0) * 1e3
        if session:
            session.close()
        samples += timer.samples()[1:] if timer else [wall]
        if name and len(samples) >= iters:
            break
    if not samples:
        return {"median_ms": None, "iters": 0, "method": "none"}
    method = ("cuda_events" if dev == "cuda" else "perf_counter") + " per region" if name else "wall clock per script run"
    return {"median_ms": round(statistics.median(samples), 4), "iters": len(samples), "method": method}


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


class _RegionTimer:
    """Times `advisor.region(NAME)` occurrences (CUDA events on a GPU)."""

    def __init__(self, name: str, dev: str):
        self.name, self.dev, self.spans = name, dev, []

    def _mark(self):
        if self.dev == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    @contextlib.contextmanager
    def time_region(self, name: str):
        """Entered inside every `advisor.region` while the script runs (`observe_regions`)."""
        if name != self.name:
            yield
            return
        start = self._mark()
        yield
        self.spans.append((start, self._mark()))

    def samples(self) -> list[float]:
        _sync(self.dev)
        if self.dev == "cuda":
            return [s.elapsed_time(e) for s, e in self.spans]
        return [(e - s) * 1e3 for s, e in self.spans]


def check_lines(checks: list, patterns: list = ()) -> list[str]:
    """One line per module compared (the script may call it many times): match, bit-identical or MISMATCH
    over its calls, with the worst call's errors. Where the mismatching calls dropped the patterns to blame
    and the calls after them matched, the line is that final verdict: what was dropped, why, and that the
    model now matches (a "MISMATCH" line above "every patched pattern kept" read as a failure)."""
    lines = []
    for module in dict.fromkeys(c["module"] for c in checks):
        mine = [c for c in checks if c["module"] == module]
        bad = [c for c in mine if not c.get("ok")]
        if bad and mine[-1].get("ok") and all(c.get("dropped") for c in bad):
            after = mine[max(i for i, c in enumerate(mine) if not c.get("ok")) + 1:]
            worst = max(after, key=lambda c: c.get("rel_l2") or 0.0)
            dropped = {k: why for c in bad for k, why in c["dropped"].items()}
            lines.append(f"check {module}: patched vs unpatched outputs match "
                         f"(rel_l2 {worst.get('rel_l2') or 0:.2g}, max_abs {worst.get('max_abs') or 0:.2g}) once "
                         f"{', '.join(_pattern_named(k, patterns) for k in dropped)} was dropped: "
                         + "; ".join(dict.fromkeys(dropped.values())))
            continue
        calls = f" in {len(bad)} of {len(mine)} calls" if bad and len(mine) > 1 else \
            (f" over {len(mine)} calls" if len(mine) > 1 else "")
        if not bad and all(c.get("bit_identical") for c in mine):
            lines.append(f"check {module}: patched vs unpatched outputs bit-identical{calls}")
            continue
        worst = max(bad or mine, key=lambda c: c.get("rel_l2") or 0.0)
        lines.append(f"check {module}: patched vs unpatched outputs {'MISMATCH' if bad else 'match'}{calls} "
                     f"({'worst ' if len(mine) > 1 else ''}rel_l2 {worst.get('rel_l2') or 0:.2g}, "
                     f"max_abs {worst.get('max_abs') or 0:.2g})")
    return lines


def _pattern_named(key: str, patterns: list) -> str:
    """`c1 (linear epilogue)` for a plan's pattern key (`<pattern_id>:<replacement>`)."""
    found = next((p for p in patterns if p.get("pattern_id") and p["pattern_id"] == key.split(":")[0]), None)
    return f"{found['candidate']} ({(found.get('title') or '').split(':')[0]})" if found else key


def print_summary(console, doc: dict, out: Path) -> None:
    t = Table(title="fusion-advisor apply", title_justify="left")
    for col in ("cand.", "pattern", "status", "sites", "est. saved µs/iter", "measured µs/iter (alone)"):
        t.add_column(col)
    for p in map(PatternResult.from_json, doc["patterns"]):
        alone = (p.applied_alone or {}).get("saved_us_per_iter")
        est = p.est_time_saved_us
        status = p.verdict.message if p.verdict else ""
        t.add_row(p.candidate, p.title, textwrap.shorten(status, 80, placeholder=" …"), str(p.sites or 0),
                  f"{est:.1f}" if isinstance(est, (int, float)) else "-",
                  f"{alone:.1f}" if isinstance(alone, (int, float)) else "-")
    console.print(t)
    for e in doc.get("errors") or []:
        console.print(f"[yellow]warning:[/] {e}")
    e2e = doc.get("end_to_end") or {}
    if e2e.get("timing_meaningful"):
        extra = f", captured without kernels {e2e['captured_only_ms']:.3f} ms" if e2e.get("captured_only_ms") else ""
        noise = f", noise ±{e2e['noise_ms']:.3f} ms" if e2e.get("noise_ms") is not None else ""
        console.print(f"steady state: {e2e['before_ms']:.3f} ms -> {e2e['after_ms']:.3f} ms "
                      f"({e2e['speedup']:.2f}x; median of {e2e['iters']}, {e2e['method']}{noise}{extra})")
    else:
        console.print(f"timing not meaningful: {e2e.get('reason')}")
    if doc.get("selection"):
        console.print(f"selection: {doc['selection']['decision']}")
    console.print(f"apply results written to [bold]{out / APPLY_FILE}[/]")
    for line in check_lines(doc.get("checks") or [], doc.get("patterns") or []):  # the verdict, last
        console.print(line, soft_wrap=True)
