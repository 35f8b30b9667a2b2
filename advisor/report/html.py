"""The HTML report: one self-contained file (inline CSS, JS and SVG; nothing fetched)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional

from advisor.records import Candidate, PatternResult
from advisor.version import __version__
from advisor.report import model as M
from advisor.report.assets import CSS, JS
from advisor.report.dataflow import classes_in, dataflow_svg, node_count
from advisor.report.highlight import highlight_python
from advisor.report.next_step import next_steps
from advisor.report.style import candidate_color, class_color, class_label
from advisor.report.svg import class_bars, e, timeline, timeline_legend
from advisor.units import (fmt_bw, fmt_bytes, fmt_count, fmt_int, fmt_ms, fmt_pct, fmt_sci, fmt_time,
                           module_groups, modules_summary)

# The CSP makes "fetches nothing" a property the browser enforces, not just a promise of this code.
CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"
STATUS_LABEL = {"patched": "patched in", "unpatched": "validated, not patched", "valid": "validated",
                "failed": "validation failed", "skipped": "not generated", "absent": ""}
SHORT_STATUS = {"patched": "✓ patched", "unpatched": "not patched", "valid": "✓ valid", "failed": "✗ failed",
                "skipped": "skipped", "absent": ""}


def _tile(value: str, label: str, cls: str = "") -> str:
    return f'<div class="tile {cls}"><div class="v">{e(value)}</div><div class="k">{e(label)}</div></div>'


def _summary(a: dict, apply: Optional[dict]) -> str:
    dev, src, ss, tot = (a.get(k) or {} for k in ("device", "source", "steady_state", "totals"))
    kind = "GPU" if tot.get("time_kind") == "gpu" else "CPU"
    pot, t = M.potential_saving(a), M.total_time_us(a)
    noun = M.work_noun(a)
    sp_it = M.iteration_spread(a)
    per_iter = f"{kind} time per iteration" + (
        f" (median {fmt_time(sp_it.get('median'))}, range {fmt_time(sp_it.get('min'))} – {fmt_time(sp_it.get('max'))}, "
        f"{fmt_int(sp_it.get('iterations'))} iterations)" if sp_it else "")
    saving = ("a GPU could save per iteration, by the bytes model (not CPU time: on the CPU the kernels run in "
              "Triton's interpreter)" if M.gpu_estimate(a) else
              f"fusion could save per iteration ({fmt_pct(pot / t) if t else '–'}), alternatives counted once")
    tiles = [_tile(fmt_int(tot.get("kernels")), f"{noun} per iteration"),
             _tile(fmt_time(tot.get("time_us")), per_iter),
             _tile(fmt_pct(tot.get("memory_bound_share")), f"of time in memory-bound {noun}"),
             _tile(fmt_time(pot), saving, "hi"),
             _tile(fmt_int(len(M.candidates(a))), "fusion candidates")]
    sp = M.speedup(apply)
    if sp:  # a slowdown is never shown in green
        tiles.append(_tile(f"{sp:.2f}×", f"end to end after apply ({M.speed_words(sp)})", "good" if sp > 1 else "bad"))
    facts = [("Device", f"{dev.get('name', '?')} ({dev.get('type', '?')})"),
             ("Bandwidth", f"{fmt_bw(dev.get('bandwidth_Bps'))} ({dev.get('bandwidth_source', '?')})"),
             ("Launch overhead", fmt_time(dev.get("launch_us"))),
             ("Steady state", f"{fmt_int(ss.get('iterations'))} iterations, found by {ss.get('source', '?')}"
              + (M.TRAINING_STEP if ss.get("training_step") else "")),
             ("Kineto trace", src.get("kineto") or "–"), ("Execution trace", src.get("et") or "none")]
    dl = "".join(f"<dt>{e(k)}</dt><dd>{e(v)}</dd>" for k, v in facts)
    return (f'<section class="card" id="summary"><div class="summary"><div><h2>Summary</h2>'
            f'<div class="tiles">{"".join(tiles)}</div><dl class="facts">{dl}</dl></div>'
            f'<div><h2>Time per iteration by op class</h2>{class_bars(a)}</div></div></section>')


def _breakable(path: str) -> str:
    """Escaped path that wraps only before a separator, never inside a module name or a `{0..15}` range."""
    return re.sub(r"([./])(?![^{]*\})", r"<wbr>\1", e(path))


def _table(a: dict, apply: Optional[dict], colors: Dict[str, str]) -> str:
    pats = M.patterns_by_candidate(apply)
    # "\n" in a header becomes a line break: two-line headers keep the number columns narrow.
    gpu_est = M.gpu_estimate(a)
    heads = [("Id", "num"), ("Pattern", "text"), ("Module(s)", "text"), ("Occ.", "num"), (f"{M.saved_label(a)}\nsaved", "num"),
             ("Bytes\nsaved", "num"), ("GPU est.\n(bytes model)" if gpu_est else "Est.\nsaved", "num")]
    if pats:
        heads += [("Measured\nsaved", "num"), ("Kernel", "text")]
    th = "".join(f'<th data-type="{t}" class="{"num" if t == "num" else ""}"'
                 f'{" aria-sort=ascending" if i == 0 else ""}>{e(h).replace(chr(10), "<br>")}</th>'
                 for i, (h, t) in enumerate(heads))
    rows = []
    for c in M.listed(a):
        cid = c.id
        head, chain = M.title_parts(c)
        tags = f'<span class="badge">{e(c.kind.value)}</span>' + (f' <span class="badge">{e(c.phase)}</span>' if c.phase else "")
        if c.confidence == "low":
            tags += ' <span class="badge low">low confidence</span>'
        mods = "<br>".join(_breakable(m) for m in modules_summary(list(c.modules), max_groups=3, limit=60))
        share = M.share(c, a)

        def num(v, text):  # data-v carries the raw number so sorting never parses "1.2 ms"
            raw = M.num(v)
            return f'<td class="num" data-v="{"" if raw is None else raw!r}">{e(text)}</td>'

        cells = [num(c.rank, cid),  # sorted by rank, named by the id (stable between analyze and apply)
                 f'<td class="pat" data-v="{e(head)}"><span class="chip" style="background:{colors.get(cid, "#888")}"></span> '
                 f'<a href="#cand-{e(cid)}"><b>{e(head)}</b></a> {tags}<div class="chain">{e(chain)}</div></td>',
                 f'<td class="mods">{mods}</td>',
                 num(c.occurrences, fmt_count(c.occurrences)),
                 num(c.kernels_saved, fmt_count(c.kernels_saved)),
                 num(c.bytes_saved, fmt_bytes(c.bytes_saved)),
                 f'<td class="num" data-v="{M.num(c.est_time_saved_us, "")}"><b>{e(fmt_time(c.est_time_saved_us))}</b>'
                 + ("" if gpu_est else f'<div class="caption">{e(fmt_pct(share))}</div>') + '</td>']
        if pats:
            p = pats.get(cid)
            meas, st = M.measured_saved_per_iter(p, c), M.status(p)
            cells.append(num(meas, fmt_time(meas)).replace('class="num"', 'class="num neg"', 1) if meas is not None
                         and meas < 0 else num(meas, fmt_time(meas)))
            why = M.status_reason(p)
            cells.append(f'<td data-v="{st}">' + (f'<span class="badge {st}" title="{e(why)}">{SHORT_STATUS[st]}</span>'
                                                   + (f'<div class="caption">{e(why)}</div>' if why else "") if p else "–")
                         + "</td>")
        rows.append(f'<tr data-c="{e(cid)}">{"".join(cells)}</tr>')
    unknown = [u for u in a.get("unknown_ops") or [] if isinstance(u, dict)]
    note = ""
    if unknown:
        items = ", ".join(f"<code>{e(u.get('name', '?'))}</code> ×{e(fmt_int(u.get('count')))} ({e(fmt_time(u.get('time_us')))})"
                          for u in unknown)
        note = f'<p class="caption">Unknown ops (not modelled, counted as “other”): {items}</p>'
    foot = '<p class="caption">Est. saved is per iteration over all occurrences' + (
        " (on a CPU trace: what a GPU would save by the bytes model)" if gpu_est else "") + \
        '; measured saved is the fused kernel\'s saving per call × occurrences. An epilogue\'s estimate is on top of ' \
        'the group it extends (fusing it fuses that group too). Click a header to sort.</p>'
    small = M.negligible(a)
    if small:
        foot += (f'<p class="caption">{len(small)} more candidate{"s" if len(small) != 1 else ""} not listed: '
                 f'{e(M.negligible_words(small))}</p>')
    return (f'<section class="card"><h2>Fusion candidates</h2><div class="tablewrap">'
            f'<table id="candidates-table" class="sortable"><thead><tr>{th}</tr></thead><tbody>{"".join(rows)}</tbody>'
            f'</table></div>{foot}{note}</section>')


def _bytes_bars(c: Candidate) -> str:
    bu, bf = M.num(c.bytes_unfused), M.num(c.bytes_fused)
    if not bu:
        return ""
    bf = bf or 0.0
    saved = M.num(c.bytes_saved, bu - bf)
    return (f'<div class="bytes"><b>Memory traffic per iteration</b>'
            f'<div class="row"><span>unfused</span><div class="bar" style="width:100%"></div><span>{e(fmt_bytes(bu))}</span></div>'
            f'<div class="row"><span>fused</span><div class="bar fused" style="width:{max(0.5, 100 * bf / bu):.1f}%"></div>'
            f'<span>{e(fmt_bytes(bf))}</span></div>'
            f'<div class="caption">saves {e(fmt_bytes(saved))} ({e(fmt_pct(saved / bu))}) of the traffic</div></div>')


def _kv(caption: str, rows) -> str:
    body = "".join(f'<tr><td>{e(k)}</td><td class="{cls}">{e(v)}</td></tr>' for k, v, cls in rows)
    return f'<table class="kv"><caption>{e(caption)}</caption><tbody>{body}</tbody></table>'


def _validation(c: Candidate, p: Optional[PatternResult]) -> str:
    if not p:
        return ""
    st = M.status(p)
    parts = [f'<div class="val-box {st}"><b>Generated kernel:</b> <span class="badge {st}">{STATUS_LABEL[st]}</span>']
    why = M.status_reason(p) or (p.reason or "")
    if why:
        parts.append(f'<div>{e(why)}</div>')
    tables = []
    errs = p.errors or {}
    if isinstance(errs, dict) and errs:
        tables.append(_kv("Numerical check", [(k.replace("_", " "), _plain(v), "mono") for k, v in errs.items()
                                              if v is not None and v != ""]))
    m = p.measured or {}
    if isinstance(m, dict) and m:
        occ = M.num(c.occurrences, 1) or 1
        est_call = M.num(c.est_time_saved_us, 0.0) / occ
        meas = M.num(m.get("saved_us"))
        vs_est = f" ({meas / est_call:.0%} of the estimate)" if meas is not None and est_call else ""
        tables.append(_kv("Timing", [
            ("unfused → fused, per call", f"{fmt_time(m.get('unfused_us'))} → {fmt_time(m.get('fused_us'))}", ""),
            ("saved per call: measured vs est.", f"{fmt_time(meas)} vs {fmt_time(est_call)}{vs_est}", ""),
            ("saved per iteration (× occurrences)", fmt_time(M.measured_saved_per_iter(p, c)), ""),
            ("achieved bandwidth", f"{fmt_bw(m.get('achieved_Bps'))} ({fmt_pct(m.get('bw_fraction'))} of the device)", "")]))
    if tables:
        parts.append(f'<div class="val-grid">{"".join(tables)}</div>')
    parts.append("</div>")
    src = p.source or ""
    if src:
        n = src.count("\n") + (0 if src.endswith("\n") else 1)
        gutter = "\n".join(str(i) for i in range(1, n + 1))
        parts.append(f'<details open><summary>Generated Triton kernel — {e(p.kernel_file or "source")} ({n} lines)'
                     f'</summary><div class="code"><pre class="gutter">{gutter}</pre>'
                     f'<pre><code>{highlight_python(src.rstrip(chr(10)))}</code></pre></div></details>')
    return "".join(parts)


def _plain(v) -> str:
    """A value as a reader writes it, never as Python prints it: shapes as 2×32×64, lists joined."""
    if isinstance(v, float):
        return fmt_sci(v)
    if isinstance(v, dict):
        if "inputs" in v:  # one validation case: {"case": "odd", "inputs": [[3, 5, 7], ...]}
            return f"{v.get('case', '?')}: " + ", ".join(_plain(s) for s in v["inputs"])
        return ", ".join(f"{k} {_plain(x)}" for k, x in v.items())
    if isinstance(v, (list, tuple)):
        if all(isinstance(x, int) for x in v):
            return "×".join(map(str, v)) or "scalar"
        return "; ".join(_plain(x) for x in v)
    return str(v)


def _next_steps(a: dict, apply: Optional[dict], out) -> str:
    steps = next_steps(a, apply, out)
    if not steps:
        return ""
    items = "".join(f"<li>{e(s.text)}" + (f"<pre><code>{e(s.code)}</code></pre>" if s.code else "") + "</li>"
                    for s in steps)
    return f'<section class="card next" id="next-step"><h2>Next step</h2><ol>{items}</ol></section>'


def _candidate(a: dict, c: Candidate, p: Optional[PatternResult], color: str) -> str:
    cid = c.id
    head, chain = M.title_parts(c)
    badges = [f'<span class="badge">{e(c.kind.value)}</span>'] + ([f'<span class="badge">{e(c.phase)}</span>'] if c.phase else [])
    if c.confidence == "low":
        badges.append('<span class="badge low">low confidence</span>')
    if p:
        st = M.status(p)
        badges.append(f'<span class="badge {st}">{STATUS_LABEL[st]}</span>')
    with_k, n_ops = node_count(c)
    occ = M.num(c.occurrences, 1) or 1
    facts = [("Occurrences", f"{fmt_count(c.occurrences)} per iteration"),
             (f"{M.work_noun(a).capitalize()} per occurrence", f"{with_k} → 1" if with_k else "–"),
             (f"{M.saved_label(a)} saved", f"{fmt_count(c.kernels_saved)} per iteration"),
             ("Est. saved" + (" on a GPU (bytes model)" if M.gpu_estimate(a) else ""),
              f"{fmt_time(c.est_time_saved_us)} per iteration"
              + ("" if M.gpu_estimate(a) else f" ({fmt_pct(M.share(c, a))})") + ", "
                            f"{fmt_time(M.num(c.est_time_saved_us, 0) / occ)} per occurrence"),
             ("Unfused kernels take", f"{fmt_time(c.measured_time_us)} per iteration")]
    dl = "".join(f"<dt>{e(k)}</dt><dd>{e(v)}</dd>" for k, v in facts)
    groups = module_groups(list(c.modules))
    mods = "".join(f"<li>{e(g)}</li>" for g in groups)
    n_mods = len(c.modules)
    legend = "".join(f'<span class="key"><i style="background:{class_color(k)}"></i>{e(class_label(k))}</span>'
                     for k in classes_in(c))
    return (f'<article class="card candidate" id="cand-{e(cid)}" data-c="{e(cid)}"><header>'
            f'<span class="rank" style="background:{color}">{e(c.id)}</span><h3>{e(head)}</h3>'
            f'{"".join(badges)}</header><div class="chain">{e(chain)}</div>'
            f'<div class="cols"><dl class="facts">{dl}</dl>{_bytes_bars(c)}</div>'
            f'<div class="dataflow">{dataflow_svg(c)}</div>'
            f'<div class="caption">{legend} One occurrence, {n_ops} op{"s" if n_ops != 1 else ""}. Grey boxes are '
            f'tensors in memory (inputs read, outputs written); fused, every edge between ops stays on chip.</div>'
            f'<details><summary>Modules ({n_mods} path{"s" if n_mods != 1 else ""})</summary>'
            f'<ul class="modules">{mods}</ul></details>'
            f'<details><summary>Canonical pattern</summary><code>{e(c.pattern)}</code></details>'
            f'{_validation(c, p)}</article>')


def _ranks(a: dict) -> str:
    """A distributed run's ranks: per rank its wall time, communication and exposed communication per iteration,
    its own time (what the others wait on), and the straggler marked; empty for one process's analysis."""
    dist = M.distributed(a)
    if dist is None:
        return ""
    late = dist.straggler.rank if dist.straggler else None

    def cell(v, text=None):
        return f'<td class="num" data-v="{v:.6g}">{e(text or fmt_time(v))}</td>' if v is not None else "<td>–</td>"

    rows = []
    for r in dist.ranks:
        c = r.communication_time
        exposed = f"{fmt_time(c.exposed_us)} ({fmt_pct(c.exposed_us / c.iteration_us)})" if c and c.iteration_us else None
        mark = ' <span class="badge straggler">straggler</span>' if r.rank == late else ""
        row_class = ' class="straggler"' if r.rank == late else ""
        rows.append(f'<tr{row_class}><td>rank {r.rank}{mark}</td>'
                    + cell(c.iteration_us if c else None) + cell(M.num(r.time_us))
                    + cell(c.communication_us if c else M.num(r.communication_us))
                    + cell(c.exposed_us if c else None, exposed) + cell(c.own_time_us if c else None) + "</tr>")
    calls = list(dist.steady_state_calls)
    sub = (f"{len(dist.ranks)} of {dist.world_size} ranks, backend {dist.backend or 'unknown'}"
           + (f", steady-state calls {calls[0]}–{calls[-1]} on every rank" if calls else ""))
    note = ("Exposed communication: a collective in flight with no compute beside it on the rank's device (GPU: "
            "communication kernels against compute kernels on any stream; CPU: the calling thread in a collective "
            "or idle while gloo's threads work). Own time: the iteration less its exposed communication.")
    return (f'<section class="card" id="ranks"><h2>Ranks</h2><p class="muted">{e(sub)}</p>'
            f'<p class="{"warn" if dist.straggler else "muted"}">{e(M.straggler_words(dist))}</p>'
            '<div class="tablewrap"><table id="ranks-table"><thead><tr><th>Rank</th>'
            '<th>Wall time / iteration</th><th>Op time / iteration</th><th>Communication</th><th>Exposed</th>'
            f'<th>Own time</th></tr></thead><tbody>{"".join(rows)}</tbody></table></div>'
            f'<p class="muted">{e(note)}</p></section>')


def _after_apply(apply: dict) -> str:
    e2e, man = apply.get("end_to_end"), [m for m in apply.get("manifest") or [] if isinstance(m, dict)]
    rewrites = M.graph_rewrites(apply)
    if not isinstance(e2e, dict) and not man and not rewrites:
        return ""
    out = ['<section class="card" id="after-apply"><h2>After apply</h2>']
    if isinstance(e2e, dict):
        sp = M.speedup(apply)
        out.append(f'<div class="e2e"><div><div class="caption">before</div><div class="big">{e(fmt_ms(e2e.get("before_ms")))}</div></div>'
                   f'<div class="big muted">→</div><div><div class="caption">after</div>'
                   f'<div class="big">{e(fmt_ms(e2e.get("after_ms")))}</div></div>'
                   + (f'<div><div class="caption">{"speedup" if sp >= 1 else "slowdown"}</div><div class="big" '
                      f'style="color:var(--{"good" if sp > 1 else "bad"})">{sp:.2f}×</div></div>' if sp else "")
                   + "</div>")
        if not e2e.get("timing_meaningful", True):
            out.append('<div class="warn">These timings are not meaningful on this device (e.g. a CPU run); '
                       'the kernels were validated, not benchmarked.</div>')
    if rewrites:
        out.append('<h2 style="margin-top:8px">Graph rewrites</h2><ul class="rewrites">'
                   + "".join(f"<li>{e(line)}</li>" for line in rewrites) + "</ul>")
    if man:
        rows = "".join(f"<tr><td class=\"mono\">{e(m.get('module') or '(top level)')}</td><td>{e(m.get('class', ''))}</td>"
                       f"<td class=\"mono\">{e(m.get('kernel_file', ''))}</td><td class=\"mono\">{e(m.get('guard', ''))}</td></tr>"
                       for m in man)
        out.append('<h2 style="margin-top:8px">Manifest</h2><div class="tablewrap"><table class="manifest"><thead><tr>'
                   '<th>Module</th><th>Class</th><th>Kernel file</th><th>Guard</th></tr></thead>'
                   f'<tbody>{rows}</tbody></table></div>')
    out.append("</section>")
    return "".join(out)


def render_html(analysis: dict, apply: Optional[dict] = None, out=None) -> str:
    """`out`: the directory the report is written to, for the commands of the next-step box."""
    a = analysis
    cands = M.candidates(a)
    colors = {c.id: candidate_color(i) for i, c in enumerate(cands)}
    titles = {c.id: f"{c.id} {M.title_parts(c)[0]}" for c in cands}
    pats = M.patterns_by_candidate(apply)
    dev, src = a.get("device") or {}, a.get("source") or {}
    warn = ""
    if a.get("low_confidence"):
        reasons = M.low_confidence_reasons(a)
        warn = ('<div class="warn"><b>Low confidence.</b> Treat the estimates as rough'
                + (": " + e("; ".join(reasons)) if reasons else "") + ".</div>")
    sections: List[str] = [
        f'<header class="top"><div><h1>Fusion report</h1><div class="sub">{e(dev.get("name", "?"))} · '
        f'{e(src.get("kineto") or "?")}</div></div><div class="sub">fusion-advisor {e(__version__)}</div></header>',
        warn, _summary(a, apply), _next_steps(a, apply, out),
        f'<section class="card"><h2>One steady-state iteration ({M.work_noun(a)} over time)</h2>'
        f'{timeline(a, colors, titles)}'
        f'{timeline_legend(a, colors, titles)}</section>',
        _table(a, apply, colors), _ranks(a),
    ]
    if isinstance(apply, dict):
        sections.append(_after_apply(apply))
    sections += [_candidate(a, c, pats.get(c.id), colors[c.id]) for c in M.listed(a)]
    body = "".join(sections)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>Fusion report — {e(dev.get("name", ""))}</title><style>{CSS}</style></head>'
            f'<body><main class="wrap">{body}<footer>Generated by fusion-advisor {e(__version__)} from analysis.json'
            f'{" and apply.json" if apply else ""}.</footer></main><script>{JS}</script></body></html>\n')


def write_html(analysis: dict, apply: Optional[dict], path, out=None) -> Path:
    path = Path(path)
    path.write_text(render_html(analysis, apply, out), encoding="utf-8")
    return path
