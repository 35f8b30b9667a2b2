"""Which patched state a workflow hands back: the selection policy (`choose`, on timings alone) and the
timings it is given (`compare_states`: the states and each pattern alone, in one interleaved run;
`keep_faster` hands back what it chose; `time_patterns` times without choosing).

On a GPU a patched model is never left slower than it was: every state is timed side by side with the
unpatched model and kept only when it is faster beyond the noise. Without meaningful timing (kernels in
Triton's interpreter) nothing is timed and nothing dropped.
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
from dataclasses import dataclass

import torch

from advisor.measure import timing  # read at call time: tests replace its clocks
from advisor.patching import only, patch, patches_off, whole
from advisor.patching import timing as timing_phases  # where a cold start's seconds go (bench/cold_start.py)
from advisor.patching.verify import check_outer
from advisor.documents import SelectionState as S
from advisor.records import PatternResult
from advisor.workflows.outcome import pattern_status
from advisor.status import Status

ROUNDS = 5  # interleaved rounds of the final comparison: pairs enough for `margin_ms` to mean something


@dataclass(frozen=True)
class Option:
    """One state the model can be handed back in, and what it measured."""

    name: str  # a model's state (`SelectionState`), or a check's own label ("fused", "eager")
    enabled: frozenset | None  # pattern keys whose launchers run (None: every one)
    ms: float  # median over every timed call
    outer: bool = False  # the outer capture (the whole stack as one graph) instead of the layer captures
    rounds_ms: tuple = ()  # the median of each interleaved round, paired with the unpatched model's rounds


DESCRIBE = {S.ALL: "every patched pattern", S.KEPT: "the {n} patterns shown to save time alone",
            S.CAPTURED: "the captured layers replayed as CUDA graphs, every site on its original ops",
            S.WHOLE: "the whole stack captured as one graph (fusing across layers), every pattern",
            S.WHOLE_KEPT: "the whole stack captured as one graph, with the {n} patterns shown to save time alone",
            S.WHOLE_CAPTURED: "the whole stack captured as one graph and replayed as one CUDA graph, every site on "
                              "its original ops"}


@contextlib.contextmanager
def state(enabled, outer: bool):
    """The model runs in one selectable state inside this block."""
    with whole(outer), only(enabled):
        yield


def margin_ms(before_ms: float, before_rounds, option: Option) -> float:
    """How much faster than the unpatched model an option must measure to be shown faster: 1% of the call,
    and half the spread of the paired round differences (round r: unpatched minus option). Rounds are
    interleaved, so a stall or clock change that slows both in one round cancels in the difference; a
    host-bound model whose rounds moved 50% is still shown 2x faster when every round says so."""
    diffs = [b - o for b, o in zip(before_rounds, option.rounds_ms)]
    spread = (max(diffs) - min(diffs)) / 2 if len(diffs) > 1 else 0.0
    return max(0.01 * before_ms, spread)


def shown_faster(before_ms: float, before_rounds, option: Option) -> bool:
    """Whether the timings show `option` faster than the unpatched model: faster by more than 1% in every
    interleaved round (a host stall that slows the unpatched model in one round only widens the gap), or
    faster in the median by more than its margin (`margin_ms`: one round may disagree if the rest say
    much more)."""
    diffs = [b - o for b, o in zip(before_rounds, option.rounds_ms)]
    every_round = len(diffs) > 1 and min(diffs) > 0.01 * before_ms
    return every_round or before_ms - option.ms > margin_ms(before_ms, before_rounds, option)


def choose(before_ms: float, before_rounds, options: list[Option], shown: frozenset = frozenset()) -> Option | None:
    """The selection policy, on timings alone: of the options the timings show faster than the unpatched
    model (`shown_faster`), the fastest, unless one running fewer patterns (a subset of its patterns, the
    same captures, still every pattern in `shown`: those shown to save time alone) is not shown slower than
    it: then the one of those running fewest. A kernel is patched into the user's model for a saving the
    timings show, not for one inside their noise (the zoo's single-site chains of 3-25 µs measured 4-46 µs
    "saved" on 4 ms calls whose kernels' summed time moved by 30-45 µs between two timings of one state:
    docs/EXPERIMENTS.md: estimate_check); a pattern shown alone is not dropped because two whole states'
    rounds moved more than it saves (T5's 0.6 ms residual add + RMSNorm, its rounds moving by 5 ms). None:
    leave the model unpatched."""
    faster = [o for o in options if shown_faster(before_ms, before_rounds, o)]
    if not faster:
        return None
    best = min(faster, key=lambda o: o.ms)
    simpler = [o for o in faster if o.outer == best.outer and _fewer(o.enabled, best.enabled)
               and shown <= o.enabled and not shown_faster(o.ms, o.rounds_ms, best)]
    return min(simpler, key=lambda o: (len(o.enabled), o.ms), default=best)


def _fewer(enabled, than) -> bool:
    """Whether pattern set `enabled` is a proper subset of `than` (None: every pattern)."""
    return enabled is not None and (than is None or enabled < than)


def keep_faster(call, handle, device: str, records: list[PatternResult], iters: int = 20, exact=None) -> tuple:
    """On a GPU, never leave the model slower: compare the states side by side with the unpatched model,
    each patched pattern alone among them (`compare_states`), and hand back the one chosen, as timed, or
    the model unpatched. Returns (the handle now in force, the decision, the results with `kept` and why
    not). Without meaningful timing nothing is dropped."""
    patched = [r for r in records if r.patched]
    # Inductor's captures (`inductor=True`) are timed against the unpatched model even with no kernel of ours
    if not patched and not getattr(getattr(handle, "plan", None), "inductor", False):
        return handle, {"decision": "nothing patched", "kept": []}, records
    if not timing.timing_meaningful(device):
        return handle, {"decision": "all patched patterns kept (timing not meaningful here: no selection)",
                        "kept": [r.candidate for r in patched]}, records
    best, out, records = compare_states(call, handle, device, records, iters, exact)
    e2e = out["timing"]  # the whole of it: `optimize(benchmark=True)` need not time the same handle again
    out = {"all_patched": {k: e2e.get(k) for k in ("before_ms", "after_ms", "captured_only_ms", "speedup", "noise_ms")},
           **out}
    if best is None:
        handle = patch(handle.model, handle.plan.only(set()))  # every forward as it was
    else:
        handle.enable(best.enabled)
        handle.set_outer(best.outer)
    return handle, out, records


def compare_states(call, handle, device: str, records: list[PatternResult], iters: int = 20, exact=None) -> tuple:
    """The comparison shared by `optimize` and `apply`: side by side with the unpatched model, in one
    interleaved run, every pattern on, the captures with no kernel (their CUDA-graph replay alone), the
    outer captures where the plan has them (each whole stack as one graph; checked against the unpatched
    outputs first, `exact` as in `check`, their launched sites in `outer_sites`), and each patched pattern
    alone. A pattern's saving alone is measured in the state it would be handed back in: inside the whole
    stack where that runs (one CUDA graph: the host's noise, which hid savings of a tenth of a millisecond
    behind rounds that moved by several, is gone, and patterns fused only across layers launch there),
    else in the layer captures. Where some patterns were shown to save time alone and others not, a second, shorter
    run times those that did (`kept`, and `whole_kept`) against the first run's leader. Chooses (`choose`)
    and returns (the option chosen or None, the decision as a dict with the timing of the first run as
    `timing`, the results with `applied_alone` and `kept`); `handle` is left in whatever state was timed
    last: the caller puts it in the chosen one.

    One run instead of two (each pattern alone, then the states): the unpatched model, every pattern and
    the captures were timed twice, with a warm-up floor each time (a tiny 4-layer Llama on the CPU: 436
    model calls then, 317 now), and a pattern's alone state recorded a CUDA graph per layer where the whole
    stack's records one. Those whole-stack recordings keep their static outputs until selection ends: where
    they would not fit in half the GPU's free memory (measured by the first one's growth), the patterns
    are timed alone in the layer captures instead (`alone_in_layers` says so)."""
    patched = [r for r in records if r.patched]
    key_of = {s.candidate: s.key for s in handle.plan.patterns}
    every = frozenset(key_of[r.candidate] for r in patched)
    out: dict = {}
    grown = 0
    if handle.outer:
        reserved = _reserved(device)
        with timing_phases.timed("outer check"):  # its first call captures and records the whole stack
            out["outer_sites"] = check_outer(call, handle, exact)
        grown = _reserved(device) - reserved
        out["outer_check"] = next((f.refused for f in handle.outer if f.refused), "outputs as unpatched")
    outer = any(not f.refused for f in handle.outer)
    states = {S.ALL: (None, False), S.CAPTURED: (frozenset(), False)}
    if outer:
        states |= {S.WHOLE: (None, True), S.WHOLE_CAPTURED: (frozenset(), True)}
    in_whole = outer and _fits(device, (len(patched) + 2) * grown)
    if outer and not in_whole:
        out["alone_in_layers"] = (f"each pattern alone timed in the layer captures: a whole-stack recording took "
                                  f"{grown / 2**20:.0f} MB, too many for the GPU's free memory")
    alone = alone_states(records, key_of, in_whole)
    t = _time_states(call, device, iters, {**states, **alone})
    base = t[S.WHOLE_CAPTURED if in_whole else S.CAPTURED]
    whole_sites = out.get("outer_sites") if in_whole else None
    taking = launching(records, key_of, whole_sites)
    records = [_timed_alone(r, t[r.candidate], base,
                            None if whole_sites is None else whole_sites.get(key_of[r.candidate], 0), taking)
               if r.candidate in alone else r for r in records]
    out["timing"] = _summary(t, device)
    options = [Option(k, e, t[k].median_ms, o, tuple(t[k].rounds_ms)) for k, (e, o) in states.items()]
    before = t["before"]
    out["states"] = {k: round(v.median_ms, 4) for k, v in t.items() if k in states or k == "before"}
    shown = frozenset(key_of[r.candidate] for r in records
                      if r.candidate in alone and (r.applied_alone or {}).get("shown"))
    if shown and shown != every:  # the patterns shown to save time alone, against the first run's leader
        lead = choose(before.median_ms, before.rounds_ms, options, shown) or options[0]
        # Patterns not timed alone (those only the whole stack fuses, across layers) stay in: nothing says
        # they do not save time, and leaving them out made the kept state lose to every pattern on, the
        # ones measured slower alone included (Swin-T's padded GEMM, ConvNeXt-T's GELU epilogue).
        kept = shown | (frozenset(key_of.values()) - every)
        second = {lead.name: (lead.enabled, lead.outer), S.KEPT: (kept, False)}
        if outer:
            second[S.WHOLE_KEPT] = (kept, True)
        t = _time_states(call, device, iters, second)
        before = t["before"]
        options = [Option(k, e, t[k].median_ms, o, tuple(t[k].rounds_ms)) for k, (e, o) in second.items()]
    margins = {o.name: margin_ms(before.median_ms, before.rounds_ms, o) for o in options}
    out["final"] = {k: round(t[k].median_ms, 4) for k in ["before", *(o.name for o in options)]} | \
        {"margin_ms": {k: round(m, 4) for k, m in margins.items()}}
    best = choose(before.median_ms, before.rounds_ms, options, shown)
    if best is None:
        out["decision"] = (f"nothing kept (the model runs unpatched): no state beats it beyond noise ({before.median_ms:.3f} ms; "
                           + ", ".join(f"{o.name} {o.ms:.3f} (needs < {before.median_ms - margins[o.name]:.3f}, "
                                       "or faster by 1% in every round)" for o in options) + ")")
        enabled = frozenset()
    else:
        enabled = every if best.enabled is None else best.enabled
        what = DESCRIBE[best.name].format(n=len(enabled & shown) if best.name in (S.KEPT, S.WHOLE_KEPT)
                                          else len(enabled))
        out["decision"] = (f"kept {what}: {before.median_ms:.3f} -> {best.ms:.3f} ms end to end "
                           f"(noise {margins[best.name]:.3f} ms)")
        out["state"] = best.name
        out["outer"] = best.outer
    # None: every pattern, those only an outer capture launches included
    out["enabled"] = [] if best is None else None if best.enabled is None else sorted(best.enabled)
    records = mark_kept(records, key_of, enabled, best is not None)
    out["kept"] = [r.candidate for r in records if r.kept]
    return best, out, records


def launching(records: list[PatternResult], key_of: dict, whole_sites: dict | None) -> frozenset:
    """The candidates that launch in the state a pattern alone is measured against: those patched, and inside
    the whole stack (`whole_sites`: its launched sites) those only it fuses (a window chain over the stem's
    conv epilogue, reported patched only once the whole stack is chosen)."""
    return frozenset(r.candidate for r in records if r.patched) | \
        frozenset(c for c, k in key_of.items() if (whole_sites or {}).get(k))


def _reserved(device: str) -> int:
    return torch.cuda.memory_reserved() if device == "cuda" and torch.cuda.is_available() else 0


def _fits(device: str, nbytes: int) -> bool:
    """Whether recordings of `nbytes` in all fit in half the GPU's free memory (each state timed inside the
    whole stack keeps its own recording, static outputs included, until selection ends)."""
    if device != "cuda" or not torch.cuda.is_available():
        return True
    free, _ = torch.cuda.mem_get_info()
    return nbytes <= 0.5 * (free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated())


def alone_states(records: list[PatternResult], key_of: dict, outer: bool) -> dict:
    """{candidate: (enabled, outer)}: each patched pattern alone, in the whole stack (`outer`) or the layer
    captures."""
    return {r.candidate: (frozenset({key_of[r.candidate]}), outer) for r in records
            if r.patched and r.candidate in key_of}


def _time_states(call, device: str, iters: int, states: dict) -> dict:
    """{name: Timing} of the unpatched model ("before") and each state {name: (enabled, outer)}, in one
    interleaved run of `ROUNDS` rounds."""
    configs = {"before": patches_off, **{k: (lambda e, o: lambda: state(e, o))(*eo) for k, eo in states.items()}}
    with timing_phases.timed("timed runs"):
        return timing.time_configs(call, configs, device, iters=iters, rounds=ROUNDS)


def _timed_alone(r: PatternResult, a, base, whole_sites: int | None, patched: frozenset = frozenset()) -> PatternResult:
    """The result with its saving alone: the state with no kernel (`base`) minus the state with only it.
    `whole_sites`: measured inside the whole stack, which launched it at that many sites (None: in the
    layer captures). `patched`: the candidates launching beside it (`launching`, for `estimate_for_sites`)."""
    # Paired by round (interleaved: a clock change or host stall in one round slows both states alike): the
    # saving is the median of the rounds' differences and its spread theirs, not the spread of either state's
    # rounds (on a 2 ms host-bound model that was wider than the savings: 450 us on a 380 us saving). Each
    # round is its fastest call: a kernel's saving is device time, and a host stall only ever adds to a call;
    # a round's median of four calls moved with the stalls in it (T5's and BART's rounds in sessions 15-18:
    # spreads of 0.6-2.4 ms on savings of 0.02-0.6 ms).
    medians = [b - o for b, o in zip(base.rounds_ms, a.rounds_ms)]
    lows = len(base.rounds_low_ms) == len(a.rounds_low_ms) > 1
    diffs = [b - o for b, o in zip(base.rounds_low_ms, a.rounds_low_ms)] if lows else medians
    if len(diffs) > 1:
        saved_ms, spread_ms = statistics.median(diffs), max(diffs) - min(diffs)
    else:
        saved_ms, spread_ms = base.median_ms - a.median_ms, max(a.spread_ms, base.spread_ms)
    # Shown to save time alone: faster in every round, or in the median by more than half the rounds' spread.
    shown = saved_ms > 0 and ((len(diffs) > 1 and min(diffs) > 0) or saved_ms > spread_ms / 2)
    return dataclasses.replace(r, applied_alone={
        "ms": round(a.median_ms, 4), "captured_ms": round(base.median_ms, 4),
        "saved_us_per_iter": round(saved_ms * 1e3, 2),
        "spread_us": round(spread_ms * 1e3, 2), "shown": shown,
        **({"saved_us_round_medians": round(statistics.median(medians) * 1e3, 2)} if lows else {}),
        "est_saved_us_per_iter": estimate_for_sites(r, whole_sites, patched),
        "in": "layer captures" if whole_sites is None else "whole stack"})


def _summary(t: dict, device: str) -> dict:
    """The end-to-end timing (`end_to_end` in apply.json): unpatched, every pattern on, the captures alone."""
    before, after, cap = t["before"], t[S.ALL], t[S.CAPTURED]
    return {"timing_meaningful": True, "device": device, "method": before.method, "iters": before.iters,
            "before_ms": round(before.median_ms, 4), "after_ms": round(after.median_ms, 4),
            "captured_only_ms": round(cap.median_ms, 4),
            "speedup": round(before.median_ms / after.median_ms, 4) if after.median_ms else None,
            "noise_ms": round(max(before.spread_ms, after.spread_ms), 4),
            "before": before.as_dict(), "after": after.as_dict(), "captured_only": cap.as_dict(),
            "note": "captured_only: the module captures with every site running its original ops; "
                    "before -> captured_only is what capturing alone changes (less Python per op)"}


def final_status(records, specs, handle, dropped, doc, launched, selection) -> list:
    """Statuses once selection chose between the layer captures and the outer ones (patterns fused only
    across layers are patched, or not kept, by that choice), for `optimize` and `apply` alike. `launched`:
    the chosen state's launched sites (the outer capture's `outer_sites` where it was chosen); the patterns
    kept running are the selection's `enabled` (None: every one). Sets `selection["kept"]`."""
    records = pattern_status(records, specs, handle, dropped, doc, launched, selected=True)
    key_of = {s.candidate: s.key for s in specs}
    enabled = selection.get("enabled")
    records = mark_kept(records, key_of, frozenset(key_of.values() if enabled is None else enabled), True)
    selection["kept"] = [r.candidate for r in records if r.kept]
    return records


def mark_kept(records: list[PatternResult], key_of: dict, enabled: frozenset,
              anything_kept: bool) -> list[PatternResult]:
    """The results with `kept` and the verdict of each patched one, once selection has chosen which
    patterns run."""
    return [_kept(r, key_of[r.candidate] in enabled, anything_kept) if r.patched else r for r in records]


def _kept(r: PatternResult, kept: bool, anything_kept: bool) -> PatternResult:
    if kept:
        return dataclasses.replace(r, kept=True).with_verdict(Status.PATCHED, "patched")
    a = r.applied_alone or {}
    alone = a.get("saved_us_per_iter")
    why = (f"not kept: {alone:+.0f} µs per call alone" if alone is not None else "not kept") + \
        (f", within its rounds' spread ({a.get('spread_us', 0):.0f} µs)" if alone is not None and alone > 0
         and not a.get("shown", True) else "") + \
        ("" if anything_kept or alone is None or alone <= 0 else ", but no patched state was faster end to end")
    return dataclasses.replace(r, kept=False).with_verdict(Status.NOT_KEPT, why)


def time_patterns(call, handle, device: str, iters: int, records: list[PatternResult]) -> tuple:
    """Per call, without selecting: unpatched, every pattern on, the captures with every site on its
    original ops, and each patched pattern alone in the layer captures (its saving = captures alone minus
    it alone), timed in one interleaved run (`optimize(select=False, benchmark=True)`, `apply` on a script
    without a recorded steady-state call). Returns (the timings, the results with `applied_alone`)."""
    if not timing.timing_meaningful(device):
        return {"timing_meaningful": False, "device": device,
                "reason": "kernels run in Triton's interpreter on the CPU; no speedup is claimed"}, records
    key_of = {s.candidate: s.key for s in handle.plan.patterns}
    alone = alone_states(records, key_of, False)
    t = _time_states(call, device, iters, {S.ALL: (None, False), S.CAPTURED: (frozenset(), False), **alone})
    taking = launching(records, key_of, None)
    records = [_timed_alone(r, t[r.candidate], t[S.CAPTURED], None, taking) if r.candidate in alone else r
               for r in records]
    return _summary(t, device), records


def estimate_for_sites(record: PatternResult, sites: int | None = None, patched: frozenset = frozenset()) -> float | None:
    """The analyzer's estimate for the occurrences actually patched: it is made for every occurrence per
    iteration, and a pattern launched at fewer sites saves less. Where the occurrences missing are exactly
    those whose ops patterns patched beside it (`patched`) also hold (`record.shared`: a conv epilogue took
    the BatchNorm + ReLU after its conv, a window chain the stem's), their own estimates come off; else
    the sites' share of it (cross-layer occurrences left to the outer capture, say: the suite's Llama
    patched 8 of its 16 residual add + norms per layer). `sites`: those launched in the state measured (the
    whole stack's), else the record's."""
    est, occ, measured = record.est_time_saved_us, record.occurrences, sites is not None
    sites = sites if measured else record.sites
    if est is None or not occ:
        return est
    if not sites:  # not launched in the state measured: it saves nothing there
        return 0.0 if measured else est
    taken = [v for q, v in (record.shared or {}).items() if q in patched]
    if sites < occ and taken and abs(occ - sites - sum(v["occurrences"] for v in taken)) < 1e-6:
        return round(max(est - sum(v["est_time_saved_us"] for v in taken), 0.0), 2)
    return round(est * min(1.0, sites / occ), 2)


def each_alone(handle, candidates: list) -> dict:
    """{candidate: context factory inside which only that pattern runs its launchers}, per candidate the
    handle's plan has (the configurations that time each pattern alone)."""
    keys = {s.candidate: s.key for s in handle.plan.patterns}
    return {c: (lambda k: lambda: only({k}))(keys[c]) for c in candidates if c in keys}
