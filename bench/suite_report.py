"""The suite's report: its numbers summarised against the targets (`summarise`), rendered as OUT.md (`markdown`)
and as the lines a run prints (`one_line`, `tail_table`), from the results bench/suite.py's children wrote."""
from __future__ import annotations

import math
from pathlib import Path


def _workloads():
    """bench/workloads.py, imported when first needed."""
    from bench import workloads

    return workloads


NOT_MEANINGFUL = "CPU run: generated kernels run in Triton's interpreter, times say nothing about fusion"


def within_quarter(est: float, meas: float) -> bool:
    """The measured saving within ±25% of the (non-zero) estimate."""
    return abs(meas / est - 1) <= 0.25


def resolves_quarter(est, spread) -> bool:
    """Whether a measured saving can say if it lies within ±25% of the estimate: its spread (round to
    round) under a quarter of the estimate. A host-bound model's rounds moved by more than a small
    pattern's whole estimate (the zoo: ±3.5 ms against 0.25 ms), where within or off is the noise's call."""
    return isinstance(est, (int, float)) and isinstance(spread, (int, float)) and spread < 0.25 * abs(est)


def estimate_resolution(resolved: int, within: int) -> str:
    return (f"the measurement resolves ±25% (its spread under a quarter of the estimate) for {resolved} of them, "
            f"{within} of those within")


# ------------------------------------------------------------------------------------ measuring
def _time(fn, device: str, warmup: int, iters: int) -> dict:
    from advisor.measure.timing import time_call

    t = time_call(fn, device, warmup=warmup, iters=iters)
    return {"median_ms": round(t.median_ms, 4), "iters": t.iters, "method": t.method,
            "min_ms": round(min(t.samples_ms), 4), "max_ms": round(max(t.samples_ms), 4)}


def count_files(d: Path) -> int:
    return sum(1 for p in d.rglob("*") if p.is_file()) if d.exists() else 0


# ===================================================================================== summary
def geomean(xs):
    xs = [x for x in xs if isinstance(x, (int, float)) and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summarise(results: list, meaningful: bool) -> dict:
    """Geometric means over the workloads where eager, the advisor and torch.compile were all measured,
    and the issue's targets, each with the numbers behind it."""
    measured = [r for r in results if (r.get("advisor") or {}).get("speedup") and (r.get("compile") or {}).get("speedup")]
    # Issue 7's seven are the suite's mean; issue 10's matmul-anchored workloads get a mean of their own.
    anchored = [r for r in measured if r["workload"] in _workloads().ANCHORED]
    both = [r for r in measured if r not in anchored] or anchored
    s = {"timing_meaningful": meaningful, **_means(both), "missing": [r["workload"] for r in results if r not in measured]}
    if anchored and both is not anchored:
        s["anchored"] = _means(anchored)
    if not meaningful:
        s["note"] = NOT_MEANINGFUL
        return s
    targets = []
    ga, gc_ = s["geomean_advisor"], s["geomean_compile"]
    targets.append({"target": "geomean speedup of fusion-advisor >= torch.compile's",
                    "met": (ga >= gc_) if ga and gc_ else None,
                    "detail": f"{_x(ga)} vs {_x(gc_)} over {len(both)} workload(s)"})
    slower = [r for r in results if ((r.get("advisor") or {}).get("speedup") or 1) < 1]
    beyond = [r for r in slower if _beyond_noise(r)]
    targets.append({"target": "no workload slower than eager", "met": not beyond if results else None,
                    "detail": "; ".join(f"{r['workload']} {_x(r['advisor']['speedup'])} "
                                        f"({'beyond' if r in beyond else 'within'} the noise: "
                                        f"{r['advisor']['median_ms'] - r['eager']['median_ms']:+.3f} ms, spreads "
                                        f"{_ms(r['advisor'].get('spread_ms'))}/{_ms(r['eager'].get('spread_ms'))} ms)"
                                        for r in slower) or "none slower"})
    llama = next((r for r in results if r["workload"] == "hf_llama"), None)
    ls = ((llama or {}).get("advisor") or {}).get("speedup")
    targets.append({"target": "Llama >= 1.5x over eager", "met": (ls >= 1.5) if ls else None,
                    "detail": _x(ls) if ls else "not measured"})
    warm = [(r["workload"], (r.get("advisor") or {}).get("cold_warm_s")) for r in results
            if r.get("status") not in ("not installed", "skipped")]
    over = [f"{w} {v:.1f} s" for w, v in warm if isinstance(v, (int, float)) and v > 2]
    unmeasured = [w for w, v in warm if not isinstance(v, (int, float))]
    targets.append({"target": "cold start with a warm kernel cache <= 2 s per workload",
                    "met": (not over) if warm and not unmeasured else (False if over else None),
                    "detail": ("over: " + ", ".join(over) if over else "all within")
                              + (f"; not measured: {', '.join(unmeasured)}" if unmeasured else "")})
    epi = [(r["workload"], p) for r in results for p in (r.get("advisor") or {}).get("patterns", [])
           if p.get("matmul_epilogue") and p.get("patched")]
    bad = [f"{w} {p['candidate']}" for w, p in epi if p.get("kept") and not ((p.get("measured_us") or 0) > 0)]
    targets.append({"target": "a matmul-epilogue pattern is kept only if it beats cuBLAS + the separate epilogue",
                    "met": not bad, "detail": f"{sum(1 for _, p in epi if p.get('kept'))} kept of {len(epi)} patched"
                    + (f"; kept without a measured win: {', '.join(bad)}" if bad else "")})
    # Issue 16's target counts the kept patterns (what the user runs); every measured pattern is said beside it.
    applied = [(r["workload"], p) for r in results for p in (r.get("advisor") or {}).get("patterns", [])
               if p.get("measured_over_est") is not None]
    meas = [(w, p) for w, p in applied if p.get("kept")]
    off = [f"{w} {p['candidate']} {p['measured_over_est']:.2f}x" for w, p in meas if not p.get("within_25pct")]
    sharp = [p for _, p in meas if resolves_quarter(p.get("est_us"), p.get("measured_spread_us"))]
    applied_within = sum(bool(p.get("within_25pct")) for _, p in applied)
    targets.append({"target": "analyzer estimate within ±25% of the measured saving for 80% of kept patterns",
                    "met": (len(meas) - len(off) >= 0.8 * len(meas)) if meas else None,
                    "detail": f"{len(meas) - len(off)} of {len(meas)} kept within" + (f"; off: {', '.join(off)}" if off else "")
                    + f"; {estimate_resolution(len(sharp), sum(bool(p.get('within_25pct')) for p in sharp))}"
                    + (f"; {retimed} timed again by the benchmark (bench/retime.py: selection's rounds had not "
                       "resolved them; its figures are kept beside)" if (retimed := sum(
                           p.get("measured_by") == "retimed" for _, p in meas)) else "")
                    + f"; every measured pattern (kept or not): {applied_within} of {len(applied)} within"})
    s["targets"] = targets
    return s


def _means(rows: list) -> dict:
    return {"geomean_over": [r["workload"] for r in rows],
            "geomean_advisor": geomean([r["advisor"]["speedup"] for r in rows]),
            "geomean_compile": geomean([r["compile"]["speedup"] for r in rows])}


def _rev_of(res: list, run: str) -> str:
    revs = {r.get("rev") for r in res if r.get("run") == run and r.get("rev")}
    return f" (fusion-advisor {', '.join(sorted(revs))})" if revs else ""


def _beyond_noise(r: dict) -> bool:
    """Advisor slower than eager by more than the larger of the two spreads (max - min of round medians)."""
    a, e = r.get("advisor") or {}, r.get("eager") or {}
    noise = max(a.get("spread_ms") or 0.0, e.get("spread_ms") or 0.0)
    return (a.get("median_ms") or 0.0) - (e.get("median_ms") or 0.0) > noise


def _x(v):
    return f"{v:.2f}×" if isinstance(v, (int, float)) else "—"


def _ms(v, nd=3):
    return f"{v:.{nd}f}" if isinstance(v, (int, float)) else "—"


def _s(v):
    return f"{v:.1f}" if isinstance(v, (int, float)) else "—"


def _err(v):
    return f"{v:.1e}" if isinstance(v, (int, float)) else "—"


def _kern(d):
    return str(d["kernels"]) if isinstance(d, dict) and d.get("kernels") is not None else "—"


def _time_cell(part: dict | None, meaningful: bool) -> str:
    part = part or {}
    m, sp = part.get("median_ms"), part.get("spread_ms")
    if m is None:
        return "—"
    cell = f"{m:.3f}" + (f" ±{sp / 2:.3f}" if isinstance(sp, (int, float)) else "")
    return cell if meaningful else cell + "*"


def status_of(r: dict) -> str:
    st = r.get("status") or "?"
    errs = [k for k in (r.get("errors") or {}) if not k.endswith("_traceback")]
    if errs and st in ("ok", "partial"):
        st = f"{st} (failed: {', '.join(errs)})"
    return st


def markdown(doc: dict) -> str:
    host, s, meaningful = doc["host"], doc.get("summary") or {}, doc["timing_meaningful"]
    res = doc["workloads"]
    L = [f"# fusion-advisor vs eager vs torch.compile — {host.get('device_name')}", ""]
    L.append(f"Generated {doc['generated']} by `{doc['command']}` (fusion-advisor {host.get('git', '?')}): "
             f"torch {host.get('torch')}, triton {host.get('triton')}, transformers {host.get('transformers')}, "
             f"timm {host.get('timm') or 'not installed'}, torchvision {host.get('torchvision') or 'not installed'}, "
             f"Python {host.get('python')}. Budget {doc['budget_s']:.0f} s"
             + (f", ran {doc['wall_s']:.0f} s" if doc.get("wall_s") else " (run in progress or cut short)")
             + f"; advisor top {doc['top']} candidates; {doc['iters']} timed calls per configuration.")
    runs = sorted({r.get("run") for r in res if r.get("run")})
    if len(runs) > 1:
        L.append(f"Rows come from {len(runs)} runs (`--merge`): " + ", ".join(
            f"{run}{_rev_of(res, run)}: {', '.join(r['workload'] for r in res if r.get('run') == run)}" for run in runs)
            + ". Every ratio is between numbers of one run.")
    L.append("")
    if not meaningful:
        L += [f"**Timing is not meaningful in this run** ({NOT_MEANINGFUL}). Times are marked `*`; "
              "no speedup is claimed.", ""]
    L += ["## Results (bf16 inference, random weights; every number measured in this run)" if not doc["quick"]
          else "## Results (quick shapes)", ""]
    # The five columns first, then this suite's.
    L.append("| workload | shape | eager ms | torch.compile ms | compile s | fusion-advisor ms | advisor × eager "
             "| compile × eager | advisor cold s: empty cache | advisor cold s: warm cache "
             "| max rel err advisor / compile | kernels/iter eager / advisor / compile | patterns kept / patched "
             "| status |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in res:
        e, ad, co = r.get("eager") or {}, r.get("advisor") or {}, r.get("compile") or {}
        kept = ad.get("kept")
        pk = f"{len(kept)} / {ad.get('patched')}" if isinstance(kept, list) else (
            f"? / {ad['patched']}" if ad.get("patched") is not None else "—")
        L.append(f"| {r.get('title') or r['workload']} | {r.get('shape') or '—'} | {_time_cell(e, meaningful)} "
                 f"| {_time_cell(co, meaningful)} | {_s(co.get('first_call_s'))} | {_time_cell(ad, meaningful)} "
                 f"| {_x(ad.get('speedup'))} | {_x(co.get('speedup'))} "
                 f"| {_s(ad.get('cold_empty_s'))} | {_s(ad.get('cold_warm_s'))} "
                 f"| {_err(ad.get('max_rel_err'))} / {_err(co.get('max_rel_err'))} "
                 f"| {_kern(e.get('kernels_per_iter'))} / {_kern(ad.get('kernels_per_iter'))} / "
                 f"{_kern(co.get('kernels_per_iter'))} | {pk} | {status_of(r)} |")
    if meaningful:
        for label, g in (("", s), (", matmul-anchored (issue 10)", s.get("anchored"))):
            if g:
                L.append(f"| **geometric mean** ({len(g.get('geomean_over', []))} workloads{label}) | | | | | | "
                         f"**{_x(g.get('geomean_advisor'))}** | **{_x(g.get('geomean_compile'))}** | | | | | | |")
    L.append("")
    if meaningful and s.get("missing"):
        L += [f"Not in the geometric means (a number is missing): {', '.join(s['missing'])}.", ""]
    L += ["ms: median over the interleaved rounds, ± half the spread (max − min) of the round medians. "
          "Speedups: eager ms / ms, same run. Max rel err: max |x − eager| / max |eager| over the main output "
          "(logits, last hidden state, …). Kernels/iter: torch.profiler `kernel` events of one call. "
          "Cold start: from the call of `advisor.optimize` (resp. the first call of the `torch.compile`d model) "
          "to the end of the first optimised call, synchronised.", ""]
    if meaningful and s.get("targets"):
        L += ["## Targets (issue 7)", "", "| target | met | numbers |", "|---|---|---|"]
        for t in s["targets"]:
            met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
            L.append(f"| {t['target']} | {met} | {t['detail']} |")
        L.append("")
    if meaningful and not doc["quick"]:
        ANCHORS = _workloads().ANCHORS

        L += ["Issue 7's table, measured on an H100 earlier (orientation only: every ratio above is against "
              "this run's eager): " + "; ".join(f"{k} eager {v[0]} ms, torch.compile {v[1]} ms, {v[2]} s"
                                                for k, v in ANCHORS.items() if any(r["workload"] == k for r in res))
              + ".", ""]
    L += ["## Per workload: what the advisor applied", ""]
    for r in res:
        L += _workload_section(r, meaningful)
    L += ["## Method", "",
          "- One child process per workload (`bench/suite.py --child`), a fresh kernel cache "
          "(`FUSION_ADVISOR_CACHE`), Triton cache and Inductor cache each; the parent gives each workload a share "
          "of the time budget and kills a child that overruns it (the report keeps what it had measured).",
          "- Before anything is timed each child pays one-time process costs: imports (advisor, Inductor), CUDA "
          "and cuBLAS set-up, Triton's driver, dynamo + AOTAutograd first use (a trivial function compiled with "
          "`backend='aot_eager'`). Neither cold start includes them; both include everything else (tracing, "
          "code generation, Triton compilation with empty caches).",
          "- Order in the child: eager (reference output), `advisor.optimize` on a deep copy of the model (the "
          "process's first real dynamo capture, as in the warm-cache process), selection, torch.compile of the "
          "original model (it may profit from the warmer dynamo, the advisor never does), then the final "
          "interleaved timing of all three (each warmed up ≥ 0.5 s, then 3 rounds of eager / advisor / compile (reversed in the second), "
          "CUDA events around each call), then outputs and kernel counts. Each phase is time-capped (SIGALRM) so "
          "one slow phase cannot take the others' time; a phase that fails or overruns is reported, not hidden.",
          "- Selection: `advisor.workflows.selection.time_patterns` times each patched pattern alone against the captured "
          "model with every site on its original ops; a pattern is kept if it saves time alone (so a matmul "
          "epilogue is kept only if it beats cuBLAS + the separate epilogue). The kept set is re-patched and kept "
          "only if it is faster than eager end to end; otherwise the model is unpatched and the advisor's column "
          "is eager again (reported as dropped).",
          "- Warm cache: a second child process builds the model again and runs `advisor.optimize` with the "
          "kernel cache and Triton cache the first child filled (a real second run; in the same process dynamo's "
          "capture cache would make it look cheaper). The selection step is not part of either cold start.",
          "- Estimated saving: the analyzer's `est_time_saved_us` per call for each pattern; measured: captured "
          "model with only that pattern on vs none (`applied_alone`).", ""]
    return "\n".join(L) + "\n"


def _workload_section(r: dict, meaningful: bool) -> list:
    L = [f"### {r.get('title') or r['workload']} (`{r['workload']}`)", ""]
    st = status_of(r)
    if r.get("status") in ("not installed", "skipped"):
        return L + [f"{st}: {r.get('reason', '')}", ""]
    ad = r.get("advisor") or {}
    if r.get("shape"):
        L.append(f"Shape: {r['shape']} ({r.get('dtype')}, {r.get('params', 0) / 1e6:.1f} M parameters). "
                 f"Status: {st}; {r.get('wall_s', '?')} s of a {r.get('budget_s', '?')} s budget.")
    if ad.get("decision"):
        L.append(f"Decision: {ad['decision']}.")
    if ad.get("speedup_note"):
        L.append(f"Speedup counted as 1.00×: {ad['speedup_note']}.")
    if ad.get("phases_s"):
        L.append("Cold start, empty cache (s): " + ", ".join(f"{k} {v:.1f}" for k, v in ad["phases_s"].items())
                 + "; warm cache: " + ", ".join(f"{k} {v:.1f}" for k, v in ((r.get("warm") or {}).get("phases_s")
                                                                          or {}).items()) + ".")
    ap = ad.get("all_patched") or {}
    if ap.get("before_ms"):
        L.append(f"All patched patterns together (selection timing): {ap['before_ms']:.3f} → {ap['after_ms']:.3f} ms "
                 f"({_x(ap.get('speedup'))}); captured with every site on its original ops: "
                 f"{_ms(ap.get('captured_only_ms'))} ms.")
    e2e = ad.get("end_to_end")
    if e2e:
        L.append(f"End to end: measured saving {e2e['measured_saved_us']:.0f} µs per call vs "
                 f"{e2e['est_saved_us_kept']:.0f} µs estimated for the kept patterns"
                 + (f" ({e2e['ratio']:.2f}× the estimate)." if e2e.get("ratio") is not None else "."))
    if r.get("warm_status") and r.get("warm_status") != "ok":
        L.append(f"Warm-cache run: {r['warm_status']}.")
    w = r.get("warm") or {}
    if w.get("cache_files_before") is not None:
        grew = w.get("cache_files_after", 0) - w["cache_files_before"]
        L.append(f"Warm-cache run: {w.get('patched')} pattern(s) patched; kernel cache "
                 f"{'unchanged' if grew == 0 else f'grew by {grew} file(s)'}.")
    pats = ad.get("patterns") or []
    if pats:
        L += ["", "| candidate | pattern | sites | est. saving µs/call | measured alone µs/call (± spread) "
                  "| measured / est. | kept | status |", "|---|---|---|---|---|---|---|---|"]
        for p in pats:
            meas = p.get("measured_us")
            mcell = (f"{meas:.1f}" + (f" ±{p['measured_spread_us']:.1f}" if p.get("measured_spread_us") is not None
                                       else "")) if isinstance(meas, (int, float)) else (
                "—" if meaningful else "not meaningful")
            if p.get("measured_by") == "retimed":  # bench/retime.py's figure; selection's beside it
                mcell += f" (timed again; selection: {_s(p.get('selection_measured_us'))} ±{_s(p.get('selection_spread_us'))})"
            ratio = p.get("measured_over_est")
            rcell = "—" if ratio is None else (f"{ratio:.2f}" + ("" if p.get("within_25pct") else " (off)"))
            L.append(f"| {p['candidate']} | {p.get('title')} | {p.get('sites') or 0} | {_s(p.get('est_us'))} "
                     f"| {mcell} | {rcell} | {'yes' if p.get('kept') else 'no'} | {p.get('status') or ''} |")
    errs = {k: v for k, v in (r.get("errors") or {}).items() if not k.endswith("_traceback")}
    if errs or r.get("skipped"):
        L.append("")
    for k, v in errs.items():
        msg = " ".join(str(v).split())[:400].replace("`", "'")
        L.append(f"- **{k} failed**: `{msg}`")
    for k, v in (r.get("skipped") or {}).items():
        L.append(f"- {k} skipped: {v}")
    if r.get("log_tail") and r.get("status") not in ("ok",):
        L += ["", "<details><summary>last lines of the child's log</summary>", "", "```"]
        L += [ln.replace("```", "'''") for ln in r["log_tail"][-15:]]
        L += ["```", "</details>"]
    L.append("")
    return L


def one_line(r: dict, meaningful: bool) -> str:
    e, ad, co = r.get("eager") or {}, r.get("advisor") or {}, r.get("compile") or {}
    bits = [f"{r['workload']}: {status_of(r)}"]
    if e.get("median_ms") is not None:
        star = "" if meaningful else "*"
        bits.append(f"eager {e['median_ms']:.3f}{star} ms")
        if ad.get("median_ms") is not None:
            bits.append(f"advisor {ad['median_ms']:.3f}{star} ms {_x(ad.get('speedup'))}")
        if co.get("median_ms") is not None:
            bits.append(f"compile {co['median_ms']:.3f}{star} ms {_x(co.get('speedup'))}")
        bits.append(f"cold {_s(ad.get('cold_empty_s'))}/{_s(ad.get('cold_warm_s'))}/{_s(co.get('first_call_s'))} s")
    if r.get("wall_s") is not None:
        bits.append(f"({r['wall_s']:.0f} s)")
    return ", ".join(bits)


def tail_table(doc: dict) -> str:
    meaningful, s = doc["timing_meaningful"], doc.get("summary") or {}
    rows = [("workload", "eager ms", "advisor ms", "adv ×", "compile ms", "cmp ×", "cold s empty/warm/compile",
             "kept", "status")]
    for r in doc["workloads"]:
        e, ad, co = r.get("eager") or {}, r.get("advisor") or {}, r.get("compile") or {}
        kept = ad.get("kept")
        rows.append((r["workload"], _ms(e.get("median_ms")), _ms(ad.get("median_ms")), _x(ad.get("speedup")),
                     _ms(co.get("median_ms")), _x(co.get("speedup")),
                     f"{_s(ad.get('cold_empty_s'))}/{_s(ad.get('cold_warm_s'))}/{_s(co.get('first_call_s'))}",
                     f"{len(kept)}/{ad.get('patched')}" if isinstance(kept, list) else "—", status_of(r)[:60]))
    if meaningful:
        for label, g in (("geomean", s), ("anchored", s.get("anchored"))):
            if g:
                rows.append((label, "", "", _x(g.get("geomean_advisor")), "", _x(g.get("geomean_compile")), "", "",
                             f"over {len(g.get('geomean_over', []))}"))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    if not meaningful:
        lines.append(f"* {NOT_MEANINGFUL}; no speedup claimed")
    for t in s.get("targets", []):
        met = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        lines.append(f"target {met}: {t['target']} — {t['detail']}")
    return "\n".join(lines)
