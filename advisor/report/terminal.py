"""The terminal report: a summary panel and the top-N candidates table (rich)."""
from __future__ import annotations

import re
from typing import Optional

from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from advisor.records import Candidate
from advisor.report import model as M
from advisor.report.next_step import next_steps
from advisor.report.style import class_color, class_label, ordered_classes
from advisor.units import (fmt_bw, fmt_bytes, fmt_count, fmt_int, fmt_ms, fmt_pct, fmt_time, modules_summary)

STATUS_TEXT = {
    "patched": ("✓ patched", "green"),
    "unpatched": ("– not patched", "yellow"),  # validated, but not in use: the footnote says why
    "valid": ("✓ valid", "green"),
    "failed": ("✗ failed", "bold red"),
    "skipped": ("– skipped", "yellow"),  # attempted, no kernel produced
    "absent": ("", ""),
}
BAR_WIDTH = 28


def _class_bars(analysis: dict) -> Table:
    totals = analysis.get("totals") or {}
    by_class = totals.get("by_class") or {}
    total = M.num(totals.get("time_us")) or sum(M.num(v, 0.0) for v in by_class.values()) or 1.0
    rows = sorted(((c, M.num(by_class[c], 0.0)) for c in ordered_classes(by_class)), key=lambda r: -r[1])
    peak = max((v for _, v in rows), default=0.0) or 1.0
    t = Table.grid(padding=(0, 1))
    t.add_column(min_width=13)
    t.add_column(width=BAR_WIDTH, no_wrap=True)
    t.add_column(justify="right")
    t.add_column(justify="right", style="dim")
    for cls, v in rows:
        if v <= 0:
            continue
        n = max(1, round(BAR_WIDTH * v / peak))
        t.add_row(class_label(cls), Text("█" * n, style=class_color(cls)), fmt_time(v), fmt_pct(v / total))
    return t


def _summary(analysis: dict, apply: Optional[dict]) -> Panel:
    dev, src = analysis.get("device") or {}, analysis.get("source") or {}
    ss, totals = analysis.get("steady_state") or {}, analysis.get("totals") or {}
    g = Table.grid(padding=(0, 2))
    g.add_column(style="bold", no_wrap=True)
    g.add_column()
    bw_src = dev.get("bandwidth_source")
    g.add_row("Device", f"{dev.get('name', '?')} ({dev.get('type', '?')}) · {fmt_bw(dev.get('bandwidth_Bps'))}"
              + (f" {bw_src}" if bw_src else "") + f" · launch {fmt_time(dev.get('launch_us'))}")
    trace = str(src.get("kineto") or "?") + ("" if src.get("et") else "  (no execution trace)")
    g.add_row("Trace", trace)
    if ss:
        g.add_row("Steady state", f"{fmt_int(ss.get('iterations'))} iterations, found by {ss.get('source', '?')}"
                  + (M.TRAINING_STEP if ss.get("training_step") else ""))
    kind = "GPU" if totals.get("time_kind") == "gpu" else "CPU"
    noun = M.work_noun(analysis)
    g.add_row("Per iteration", f"{fmt_int(totals.get('kernels'))} {noun} · {fmt_time(totals.get('time_us'))} {kind} time"
              + spread_words(analysis))
    g.add_row("Memory-bound", f"{fmt_pct(totals.get('memory_bound_share'))} of the time is in memory-bound {noun}")
    line = saving_words(analysis)
    if line:
        g.add_row("Fusion could save", line)
    e2e = (apply or {}).get("end_to_end") if isinstance(apply, dict) else None
    if isinstance(e2e, dict):
        sp = M.num(e2e.get("speedup"))
        line = f"{fmt_ms(e2e.get('before_ms'))} → {fmt_ms(e2e.get('after_ms'))}" + (f"  ({M.speed_words(sp)})" if sp else "")
        faster = M.speedup(apply)
        style = "yellow" if faster is None else "bold green" if faster > 1 else "bold red"  # a slowdown is never green
        txt = Text(line, style=style)
        if not e2e.get("timing_meaningful", True):
            txt.append("  timing not meaningful on this device", style="yellow")
        g.add_row("After apply", txt)
    for i, line in enumerate(M.graph_rewrites(apply)):
        g.add_row("Graph rewrites" if i == 0 else "", line)
    body = Group(g, Text(""), Text("Time by op class", style="bold"), _class_bars(analysis))
    return Panel(body, title="[bold]fusion-advisor report[/]", title_align="left", border_style="blue",
                 padding=(0, 1), expand=False)


def spread_words(analysis: dict) -> str:
    """` (median 7.4 ms, 7.1–7.6 ms over 3 iterations)`: one figure would hide a noisy run."""
    sp = M.iteration_spread(analysis)
    if not sp:
        return ""
    return (f" (median {fmt_time(sp.get('median'))}, range {fmt_time(sp.get('min'))} – {fmt_time(sp.get('max'))}, "
            f"{fmt_int(sp.get('iterations'))} iterations)")


def saving_words(analysis: dict) -> str:
    """The "could save" line: overlapping alternatives counted once; on a CPU trace, what a GPU would save."""
    n = len(M.candidates(analysis))
    if not n:
        return ""
    pot, t = M.potential_saving(analysis), M.total_time_us(analysis)
    over = f"over {n} candidate{'s' if n != 1 else ''} (alternatives counted once)"
    if M.gpu_estimate(analysis):
        est = analysis.get("estimate") or {}
        return (f"about {fmt_time(pot)} per iteration on a GPU by the bytes model ({fmt_bw(est.get('bandwidth_Bps'))}, "
                f"{fmt_time(est.get('launch_us'))} a launch) {over}; no CPU saving is promised: on the CPU the fused "
                "kernels run in Triton's interpreter")
    return f"up to {fmt_time(pot)}" + (f" ({fmt_pct(pot / t)})" if t else "") + f" per iteration {over}"


def _pattern_cell(c: Candidate) -> Text:
    head, chain = M.title_parts(c)
    t = Text(head, style="bold")
    if chain:
        t.append("\n" + chain, style="dim")
    t.append(f"\n{c.kind.value}", style="dim italic")
    if c.phase:
        t.append(f" · {c.phase}", style="magenta")
    if c.confidence == "low":
        t.append(" · low confidence", style="yellow")
    return t


def _wrap_dotted(path: str, width: int) -> str:
    """Break a module path before a separator, never inside a name (rich would fold mid-word)."""
    parts = re.split(r"(?=[./](?![^{]*\}))", path)
    lines, cur = [], ""
    for p in parts:
        if cur and len(cur) + len(p) > width:
            lines.append(cur)
            cur = p
        else:
            cur += p
    return "\n".join(lines + [cur])


def _candidates_table(analysis: dict, apply: Optional[dict], top: int, width: int) -> Table:
    pats = M.patterns_by_candidate(apply)
    has_apply = bool(pats)
    # Narrow terminals fold the module column, and the status under the measured saving, into the pattern cell
    # rather than truncate numbers and labels (80 columns, what a pipe gets, cut "– not patched" to "– not p").
    narrow = width < (110 if has_apply else 100)
    mod_w = max(16, width - (60 if has_apply else 50)) if narrow else max(26, min(34, (width - (62 if has_apply else 52)) // 2))
    n_all = len(M.listed(analysis))
    t = Table(title=f"Top fusion candidates ({min(top, n_all)} of {n_all})", title_justify="left",
              title_style="bold", box=box.SIMPLE_HEAVY, header_style="bold", pad_edge=False)
    t.add_column("Id", justify="right", no_wrap=True)  # stable between analyze and apply (kernel files, apply.json)
    t.add_column("Pattern", min_width=20, overflow="fold")
    if not narrow:
        t.add_column("Module(s)", width=mod_w, overflow="fold")
    t.add_column("Occ.", justify="right", no_wrap=True)
    t.add_column(f"{M.saved_label(analysis)}\nsaved", justify="right", no_wrap=True)
    t.add_column("Bytes\nsaved", justify="right", no_wrap=True)
    gpu_est = M.gpu_estimate(analysis)
    t.add_column("GPU est.\n(bytes model)" if gpu_est else "Est. saved\n(share)", justify="right", no_wrap=True)
    if has_apply:
        t.add_column("Measured\nsaved", justify="right", no_wrap=True)
    for c in M.listed(analysis)[:top]:
        mods = "\n".join(_wrap_dotted(m, mod_w) for m in modules_summary(list(c.modules), limit=64))
        pattern = _pattern_cell(c)
        label, status_style = STATUS_TEXT[M.status(pats.get(c.id))] if has_apply else ("", "")
        if narrow and label:
            pattern.append("\n" + label, style=status_style)
        if narrow and mods:
            pattern.append("\n" + mods, style="cyan")
        est = Text(fmt_time(c.est_time_saved_us), style="bold")
        if not gpu_est:
            est.append(f"\n{fmt_pct(M.share(c, analysis))}", style="dim")
        row = [c.id, pattern] + ([] if narrow else [mods])
        row += [fmt_count(c.occurrences), fmt_count(c.kernels_saved), fmt_bytes(c.bytes_saved), est]
        if has_apply:
            meas = M.measured_saved_per_iter(pats.get(c.id), c)
            cell = Text(fmt_time(meas) if meas is not None else "–", style="red" if meas is not None and meas < 0 else "")
            if label and not narrow:
                cell.append("\n" + label, style=status_style)
            row.append(cell)
        t.add_row(*row, end_section=True)
    return t


def _footnotes(analysis: dict, apply: Optional[dict], top: int) -> list:
    out = []
    pats = M.patterns_by_candidate(apply)
    if pats:
        out.append(Text("Measured saved = the fused kernel's saving per call × occurrences.", style="dim"))
        for c in M.listed(analysis)[:top]:
            p = pats.get(c.id)
            why = M.status_reason(p)
            if why:
                out.append(Text.assemble((f"  {c.id} ", "bold"), (f"{STATUS_TEXT[M.status(p)][0]}: ", "yellow"), why))
    small = M.negligible(analysis)
    if small:
        out.append(Text.assemble((f"{len(small)} more candidate{'s' if len(small) != 1 else ''} not listed: ", "bold"),
                                 (M.negligible_words(small), "dim")))
    if M.candidates(analysis) and any(c.extends for c in M.listed(analysis)[:top]):
        out.append(Text("An epilogue's estimate is on top of the group it extends: the two are alternatives "
                        "(fusing the epilogue fuses its group too), counted once in what fusion could save.", style="dim"))
    unknown = [u for u in analysis.get("unknown_ops") or [] if isinstance(u, dict)]
    if unknown:
        parts = ", ".join(f"{u.get('name', '?')} ×{fmt_int(u.get('count'))} ({fmt_time(u.get('time_us'))})" for u in unknown)
        out.append(Text.assemble(("Unknown ops ", "bold"), ("(not modelled, counted as other): ", "dim"), parts))
    if analysis.get("low_confidence"):
        reasons = M.low_confidence_reasons(analysis)
        out.append(Text("⚠ Low confidence: treat the estimates as rough"
                        + (" — " + "; ".join(reasons) if reasons else "") + ".", style="bold yellow"))
    return out


def _print_next_steps(analysis: dict, apply: Optional[dict], out, console: Console) -> None:
    """The next steps, each command on one line of its own, outside any box: a command folded at the terminal's
    width, or between a box's borders, cannot be pasted."""
    steps = next_steps(analysis, apply, out)
    if not steps:
        return
    console.print(Text("Next step", style="bold green"))
    for step in steps:
        console.print(Text(step.text), overflow="fold")
        if step.code:
            console.print(Text("  " + step.code, style="bold cyan"), soft_wrap=True)


def render_terminal(analysis: dict, apply: Optional[dict], console: Console, top: int = 10, out=None) -> None:
    """`out`: the directory the reports are in, for the commands of the next-step box."""
    console.print(_summary(analysis, apply))
    if M.listed(analysis):
        console.print(_candidates_table(analysis, apply, top, console.width))
    else:
        console.print(Text("No fusion candidates found.", style="bold"))
    for line in _footnotes(analysis, apply, top):
        console.print(line)
    if analysis.get("distributed"):
        console.print(_ranks_table(analysis, top))
    _print_next_steps(analysis, apply, out, console)


def _ranks_table(analysis: dict, top: int) -> Group:
    """A distributed run: per rank its time and communication per iteration (exposed: waiting on the other
    ranks), the straggler, and each listed candidate's estimated saving on every rank (the merged estimate is
    their median)."""
    dist = M.distributed(analysis)
    ranks = [r.rank for r in dist.ranks]
    calls = list(dist.steady_state_calls)
    title = (f"{len(ranks)} of {dist.world_size} ranks ({dist.backend or 'backend unknown'})"
             + (f", steady-state calls {calls[0]}-{calls[-1]} on every rank" if calls else ""))
    t = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    t.add_column("")
    late = dist.straggler.rank if dist.straggler else None
    for r in ranks:
        t.add_column(f"rank {r}" + (" (straggler)" if r == late else ""), justify="right",
                     style="bold yellow" if r == late else None)
    t.add_column("spread", justify="right")
    per = dist.ranks
    t.add_row("op time / iteration", *[fmt_time(M.num(r.time_us, 0.0)) for r in per], "")
    timed = [r.communication_time for r in per]
    if all(timed):
        t.add_row("wall time / iteration", *[fmt_time(c.iteration_us) for c in timed], "")
        t.add_row("communication", *[fmt_time(c.communication_us) for c in timed], "")
        t.add_row("  exposed", *[f"{fmt_time(c.exposed_us)} ({c.exposed_us / c.iteration_us:.0%})" if c.iteration_us
                                 else fmt_time(c.exposed_us) for c in timed], "")
        t.add_row("own time", *[fmt_time(c.own_time_us) for c in timed], "")
    else:
        t.add_row("communication", *[fmt_time(M.num(r.communication_us, 0.0)) for r in per], "")
    for c in M.listed(analysis)[:top]:
        spread = c.ranks or {}
        by_rank = spread.get("est_time_saved_us") or {}
        cells = [fmt_time(by_rank[str(r)]) if str(r) in by_rank else "–" for r in ranks]
        lo, hi = spread.get("min"), spread.get("max")
        t.add_row(f"{c.id} est. saved", *cells,
                  f"{fmt_time(lo)} – {fmt_time(hi)}" if lo is not None and hi is not None else "")
    return Group(t, Text(M.straggler_words(dist), style="bold yellow" if dist.straggler else "dim"))
