"""Inline SVG charts for the HTML report: time by op class and the one-iteration timeline.

Everything is drawn server-side so the page needs no chart library and works offline.
"""
from __future__ import annotations

import math
from html import escape
from typing import Dict, List

from advisor.report import model as M
from advisor.report.style import class_color, class_label, ordered_classes
from advisor.units import fmt_pct, fmt_time, short_kernel


def e(s) -> str:
    return escape(str(s), quote=True)


def class_bars(analysis: dict, width: int = 560) -> str:
    totals = analysis.get("totals") or {}
    by_class = totals.get("by_class") or {}
    rows = [(c, M.num(by_class.get(c), 0.0)) for c in ordered_classes(by_class)]
    rows = sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])
    total = M.num(totals.get("time_us")) or sum(v for _, v in rows) or 1.0
    peak = max((v for _, v in rows), default=1.0) or 1.0
    label_w, value_w, row_h = 126, 132, 28
    bar_w = width - label_w - value_w
    h = max(1, len(rows)) * row_h + 6
    out = [f'<svg id="summary-chart" class="chart" viewBox="0 0 {width} {h}" width="{width}" height="{h}" '
           f'role="img" aria-label="Time per iteration by op class">']
    for i, (cls, v) in enumerate(rows):
        y = 4 + i * row_h
        w = max(2.0, bar_w * v / peak)
        tip = f"{class_label(cls)}: {fmt_time(v)} ({fmt_pct(v / total)} of the iteration)"
        out.append(f'<g class="bar" data-class="{e(cls)}"><title>{e(tip)}</title>'
                   f'<text x="{label_w - 10}" y="{y + 15}" text-anchor="end" class="lbl">{e(class_label(cls))}</text>'
                   f'<rect x="{label_w}" y="{y + 3}" width="{w:.1f}" height="{row_h - 10}" rx="3" fill="{class_color(cls)}"/>'
                   f'<text x="{label_w + w + 8:.1f}" y="{y + 15}" class="val">{e(fmt_time(v))}'
                   f'<tspan class="muted"> · {e(fmt_pct(v / total))}</tspan></text></g>')
    if not rows:
        out.append('<text x="0" y="20" class="muted">no per-class times in analysis.json</text>')
    out.append("</svg>")
    return "".join(out)


def _nice_step(span: float, target: int = 8) -> float:
    raw = span / max(1, target)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


MAX_MARKS = 2000  # past this, sub-pixel kernels share one mark per ~pixel (keeps the file small)


def _merge(marks: list, noun: str) -> list:
    """Fold runs of sub-pixel marks into ~1 px marks coloured by whichever took the most time."""
    out = []
    for m in marks:
        x, w, col, c, tip, dur = m
        p = out[-1] if out else None
        if p and w < 1 and p[1] < 2 and x - p[0] < 1.5:
            p[1] = max(p[1], x + w - p[0])
            p[5] += dur
            p[6][(col, c)] = p[6].get((col, c), 0.0) + dur
            p[7] += 1
            p[2], p[3] = max(p[6], key=p[6].get)
            p[4] = f"{p[7]} {noun} at this zoom, {fmt_time(p[5])} in all; the first:\n{p[8]}"
        else:
            out.append([x, w, col, c, tip, dur, {(col, c): dur}, 1, tip])
    return [m[:6] for m in out]


def timeline(analysis: dict, cand_colors: Dict[str, str], cand_titles: Dict[str, str], width: int = 1180) -> str:
    events = [k for k in analysis.get("timeline") or [] if isinstance(k, dict)]
    label_w, pad_r = 96, 12
    noun = M.work_noun(analysis)
    lanes = [(noun.capitalize(), "by op class"), ("Candidates", f"fusable {noun}")]
    lane_h, lane_gap, top, axis_h = 30, 10, 6, 26
    h = top + len(lanes) * (lane_h + lane_gap) + axis_h
    out = [f'<svg id="timeline" viewBox="0 0 {width} {h}" width="{width}" height="{h}" role="img" '
           f'aria-label="Kernels of one steady-state iteration over time">']
    if not events:
        out.append(f'<text x="{label_w}" y="{top + 20}" class="muted">no timeline in analysis.json</text></svg>')
        return "".join(out)
    t0 = min(M.num(k.get("ts_us"), 0.0) for k in events)
    t1 = max(M.num(k.get("ts_us"), 0.0) + M.num(k.get("dur_us"), 0.0) for k in events)
    span = max(t1 - t0, 1e-9)
    plot_w = width - label_w - pad_r
    sx = plot_w / span

    for i, (name, sub) in enumerate(lanes):
        y = top + i * (lane_h + lane_gap)
        out.append(f'<rect x="{label_w}" y="{y}" width="{plot_w}" height="{lane_h}" class="lane"/>'
                   f'<text x="{label_w - 10}" y="{y + 13}" text-anchor="end" class="lbl">{name}</text>'
                   f'<text x="{label_w - 10}" y="{y + 25}" text-anchor="end" class="muted small">{sub}</text>')
    y_k, y_c = top, top + lane_h + lane_gap
    kern, cand = [], []
    for k in events:
        ts, dur = M.num(k.get("ts_us"), 0.0), M.num(k.get("dur_us"), 0.0)
        x = label_w + (ts - t0) * sx
        w = max(0.8, dur * sx)  # sub-pixel kernels still have to be visible, and hoverable
        cid = k.get("candidate")
        tip = (f"{short_kernel(k.get('name'), 90)}\n{k.get('op', '?')} · {class_label(k.get('class', 'other'))}"
               f"\n{k.get('module') or '(top level)'}\n{fmt_time(dur)} at {fmt_time(ts - t0)}")
        if cid:
            tip += f"\ncandidate {cand_titles.get(str(cid), cid)}"
        kern.append([x, w, class_color(k.get("class")), None, tip, dur])
        if cid:
            cand.append([x, w, cand_colors.get(str(cid), "#555"), str(cid), tip, dur])
    if len(events) > MAX_MARKS:
        kern, cand = _merge(kern, noun), _merge(cand, noun)
    for marks, y, extra in ((kern, y_k, ""), (cand, y_c, " c")):
        out.append(f'<g class="{"cands" if extra else "kernels"}">')
        out.extend(f'<rect class="k{extra}"' + (f' data-c="{e(c)}"' if c else "")
                   + f' x="{x:.2f}" y="{y + 3}" width="{w:.2f}" height="{lane_h - 6}" fill="{col}"><title>{e(tip)}</title></rect>'
                   for x, w, col, c, tip, _ in marks)
        out.append("</g>")

    y_ax = top + len(lanes) * (lane_h + lane_gap)
    step = _nice_step(span)
    out.append(f'<line x1="{label_w}" x2="{label_w + plot_w}" y1="{y_ax}" y2="{y_ax}" class="axis"/>')
    t = 0.0
    while t <= span + 1e-9:
        x = label_w + t * sx
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y_ax}" y2="{y_ax + 4}" class="axis"/>'
                   f'<text x="{x:.1f}" y="{y_ax + 16}" text-anchor="middle" class="muted small">{e(fmt_time(t) if t else "0")}</text>')
        t += step
    out.append("</svg>")
    return "".join(out)


def timeline_legend(analysis: dict, cand_colors: Dict[str, str], cand_titles: Dict[str, str]) -> str:
    present = {str(k.get("class")) for k in analysis.get("timeline") or [] if isinstance(k, dict)}
    items: List[str] = []
    for cls in ordered_classes({c: 1 for c in present}):
        items.append(f'<span class="key"><i style="background:{class_color(cls)}"></i>{e(class_label(cls))}</span>')
    cls_html = "".join(items)
    cands = "".join(
        f'<span class="key" data-c="{e(cid)}"><i style="background:{col}"></i>{e(cand_titles.get(cid, cid))}</span>'
        for cid, col in cand_colors.items())
    return (f'<div class="legend"><span class="legend-title">Op class</span>{cls_html}</div>'
            f'<div class="legend"><span class="legend-title">Candidate</span>{cands}</div>')

