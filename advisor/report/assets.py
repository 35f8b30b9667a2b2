"""The report's CSS and JS, kept as strings so they ship inside the wheel and inline into one file.

System font stacks only: the page must render offline and fetch nothing (no web fonts, no CDN).
"""

CSS = r"""
:root {
  --bg: #f4f6f9; --card: #ffffff; --ink: #1c2430; --muted: #5f6b7a; --faint: #8a95a3;
  --line: #e1e6ec; --line2: #eef1f5; --accent: #2458c6; --good: #1f8a4c; --bad: #c23b3b; --warn: #a86a00;
  --mono: ui-monospace, SFMono-Regular, Menlo, Consolas, "DejaVu Sans Mono", "Liberation Mono", monospace;
  --sans: system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", "Noto Sans", "DejaVu Sans", Arial, sans-serif;
}
* { box-sizing: border-box; }
html { -webkit-text-size-adjust: 100%; }
body { margin: 0; background: var(--bg); color: var(--ink); font: 14px/1.45 var(--sans); }
.wrap { max-width: 1260px; margin: 0 auto; padding: 20px 24px 40px; }
a { color: var(--accent); text-decoration: none; }
a:hover { text-decoration: underline; }
h1 { font-size: 22px; margin: 0; letter-spacing: -0.01em; }
h2 { font-size: 16px; margin: 0 0 12px; }
h3 { font-size: 16px; margin: 0; }
code, .mono { font-family: var(--mono); font-size: 12px; }
.muted { color: var(--muted); fill: var(--muted); }
.small { font-size: 11px; }
header.top { display: flex; justify-content: space-between; align-items: flex-end; gap: 16px; margin-bottom: 16px; }
header.top .sub { color: var(--muted); margin-top: 4px; overflow-wrap: anywhere; }
.card { background: var(--card); border: 1px solid var(--line); border-radius: 10px; padding: 18px 20px;
        margin-bottom: 16px; box-shadow: 0 1px 2px rgba(16, 24, 40, .04); }
.warn { background: #fff7e6; border: 1px solid #f3d08a; color: #6b4500; border-radius: 8px; padding: 10px 14px;
        margin-bottom: 16px; }
.badge { display: inline-block; font-size: 11.5px; line-height: 18px; padding: 0 8px; border-radius: 9px;
         background: var(--line2); color: var(--muted); white-space: nowrap; vertical-align: middle; }
.badge.low { background: #fff1d6; color: var(--warn); }
.badge.valid { background: #e3f4ea; color: var(--good); }
.badge.patched { background: #e3f4ea; color: var(--good); }
.badge.unpatched { background: #fff1d6; color: var(--warn); }
.badge.failed { background: #fbe6e6; color: var(--bad); }
.badge.skipped { background: #fff1d6; color: var(--warn); }
.badge.straggler { background: #fbe6e6; color: var(--bad); margin-left: 6px; }
#ranks tr.straggler td { font-weight: 600; }
.summary { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1.05fr); gap: 28px; }
.tiles { display: grid; grid-template-columns: repeat(3, minmax(0, 1fr)); gap: 10px; margin-bottom: 14px; }
.tile { border: 1px solid var(--line); border-radius: 8px; padding: 10px 12px; }
.tile .v { font-size: 20px; font-weight: 650; font-variant-numeric: tabular-nums; white-space: nowrap; }
.tile .k { color: var(--muted); font-size: 12px; }
.tile.hi { border-color: #b9cdf3; background: #f3f7ff; }
.tile.good { border-color: #b7e0c6; background: #f1faf4; }
.tile.bad { border-color: #efc4c4; background: #fdf3f3; }
.tile.bad .v, td.num.neg { color: var(--bad); }
.next ol { margin: 0; padding-left: 20px; }
.next li { margin: 4px 0 10px; }
.next pre { margin: 4px 0 0; padding: 8px 12px; background: #0f1720; color: #e2e8f0; border-radius: 6px;
  font: 12.5px/1.5 var(--mono); white-space: pre-wrap; overflow-wrap: anywhere; }
dl.facts { display: grid; grid-template-columns: max-content minmax(0, 1fr); gap: 4px 14px; margin: 0; }
dl.facts dt { color: var(--muted); }
dl.facts dd { margin: 0; overflow-wrap: anywhere; }
svg { display: block; max-width: 100%; height: auto; font-family: var(--sans); }
svg text { font-size: 12px; fill: var(--ink); }
svg .lbl { font-weight: 600; }
svg .val { font-variant-numeric: tabular-nums; }
svg .small { font-size: 10.5px; }
svg .muted { fill: var(--muted); }
#timeline .lane { fill: #f7f8fa; stroke: var(--line); }
#timeline .axis { stroke: #aab3bf; }
#timeline rect.k:hover { stroke: #000; stroke-width: .6; }
#timeline.focusing .cands rect { opacity: .18; }
#timeline.focusing .cands rect.on { opacity: 1; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 14px; margin-top: 8px; font-size: 12.5px; color: var(--muted); }
.legend-title { font-weight: 600; color: var(--ink); min-width: 74px; }
.key { display: inline-flex; align-items: center; gap: 5px; cursor: default; }
.key i, .chip { display: inline-block; width: 11px; height: 11px; border-radius: 3px; flex: none; }
.tablewrap { overflow-x: auto; }
table { border-collapse: collapse; width: 100%; }
th, td { padding: 7px 9px; border-bottom: 1px solid var(--line2); text-align: left; vertical-align: top; }
th { font-size: 12px; color: var(--muted); font-weight: 600; border-bottom: 1px solid var(--line); white-space: nowrap;
     background: #fafbfc; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
table.sortable th { cursor: pointer; user-select: none; }
table.sortable th:hover { color: var(--ink); }
table.sortable th::after { content: "\2195"; opacity: .3; margin-left: 3px; font-size: 11px; }
table.sortable th[aria-sort=ascending]::after { content: "\25B2"; opacity: .8; }
table.sortable th[aria-sort=descending]::after { content: "\25BC"; opacity: .8; }
#candidates-table tbody tr:hover { background: #f6f9ff; }
#candidates-table .pat { min-width: 230px; }
#candidates-table th { vertical-align: bottom; }
#candidates-table .chain { color: var(--muted); font-size: 12.5px; }
#candidates-table .mods { font-family: var(--mono); font-size: 11.5px; min-width: 220px; }
.candidate > header { display: flex; align-items: center; gap: 10px; flex-wrap: wrap; }
.rank { display: inline-flex; align-items: center; justify-content: center; min-width: 30px; height: 24px;
        border-radius: 6px; color: #fff; font-weight: 700; font-size: 13px; padding: 0 6px; }
.candidate .chain { color: var(--muted); margin: 6px 0 12px; }
.cols { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 24px; margin-bottom: 12px; }
.bytes .row { display: grid; grid-template-columns: 70px minmax(0, 1fr) 90px; align-items: center; gap: 8px; margin: 4px 0; }
.bytes .bar { height: 12px; border-radius: 3px; background: #c6cfdb; }
.bytes .bar.fused { background: var(--good); }
.bytes .row span:last-child { text-align: right; font-variant-numeric: tabular-nums; }
.dataflow { border: 1px solid var(--line2); border-radius: 8px; padding: 6px; margin: 8px 0; overflow-x: auto;
            background: #fcfdfe; }
.dataflow .edge { fill: none; stroke: #7d8896; stroke-width: 1.3; }
.dataflow .arrow { fill: #7d8896; }
.dataflow .io-box { fill: #f1f4f8; stroke: #9aa6b5; stroke-width: 1.2; }
.dataflow .out .io-box { fill: #eef7f1; stroke: #7fb394; }
.dataflow .op-name { font-weight: 650; font-size: 12.5px; }
.dataflow .op-sub { font-size: 10.5px; fill: var(--muted); }
.dataflow .io-name { font-weight: 600; font-size: 11.5px; }
.dataflow text.mono { font-family: var(--mono); font-size: 10.5px; }
.dataflow .elabel { font-family: var(--mono); font-size: 10px; fill: #3f4a58; paint-order: stroke;
                    stroke: #fcfdfe; stroke-width: 3px; stroke-linejoin: round; }
.caption { color: var(--muted); font-size: 12px; }
.caption .key { margin-right: 10px; }
details { margin-top: 8px; }
details > summary { cursor: pointer; color: var(--accent); font-weight: 600; }
ul.modules { margin: 6px 0 0; padding-left: 18px; font-family: var(--mono); font-size: 12px; }
.val-box { border-left: 3px solid var(--line); padding: 2px 0 2px 12px; margin: 10px 0; }
.val-box.valid { border-color: var(--good); }
.val-box.patched { border-color: var(--good); }
.val-box.unpatched { border-color: var(--warn); }
.val-box.failed { border-color: var(--bad); }
.val-box.skipped { border-color: var(--warn); }
.val-grid { display: flex; flex-wrap: wrap; gap: 8px 48px; margin-top: 6px; }
table.kv { width: auto; }
table.kv caption { text-align: left; font-weight: 600; padding-bottom: 2px; }
table.kv td { padding: 2px 14px 2px 0; border: 0; vertical-align: baseline; }
table.kv td:first-child { color: var(--muted); }
.code { display: grid; grid-template-columns: max-content minmax(0, 1fr); background: #0f1720; color: #e2e8f0;
        border-radius: 8px; overflow: auto; max-height: 480px; margin-top: 8px; }
.code pre { margin: 0; padding: 12px 14px; font: 12px/1.5 var(--mono); overflow-x: auto; }
.code .gutter { color: #5b6b80; text-align: right; user-select: none; background: #0b121a; }
.tk-k { color: #c792ea; } .tk-s { color: #c3e88d; } .tk-c { color: #7f8ea3; font-style: italic; }
.tk-n { color: #f78c6c; } .tk-d { color: #ffcb6b; } .tk-t { color: #82aaff; } .tk-f { color: #89ddff; }
.e2e { display: flex; gap: 24px; align-items: center; flex-wrap: wrap; margin-bottom: 12px; }
.e2e .big { font-size: 26px; font-weight: 700; font-variant-numeric: tabular-nums; }
footer { color: var(--faint); font-size: 12px; text-align: center; margin-top: 24px; }
@media (max-width: 980px) { .summary, .cols { grid-template-columns: minmax(0, 1fr); } }
/* Narrow windows drop the module column (each candidate's card lists its modules) so that Est. saved,
   the column the table is for, stays in view instead of behind a horizontal scroll. */
@media (max-width: 980px) {
  #candidates-table .mods, #candidates-table th:nth-child(3) { display: none; }
  #candidates-table th, #candidates-table td { padding: 7px 6px; }
  #candidates-table .pat { min-width: 170px; }
}
"""

JS = r"""
(function () {
  'use strict';
  function cellKey(td, numeric) {
    var v = td.getAttribute('data-v');
    if (v === null) v = td.textContent.trim();
    if (!numeric) return v.toLowerCase();
    var f = parseFloat(v);
    return isNaN(f) ? -Infinity : f;
  }
  function sortBy(table, th, idx) {
    var numeric = th.getAttribute('data-type') === 'num';
    var cur = th.getAttribute('aria-sort');
    // Numbers start high-to-low (biggest saving first), text starts A-Z.
    var dir = cur ? (cur === 'ascending' ? 'descending' : 'ascending') : (numeric ? 'descending' : 'ascending');
    Array.prototype.forEach.call(th.parentNode.cells, function (c) { c.removeAttribute('aria-sort'); });
    th.setAttribute('aria-sort', dir);
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = cellKey(a.cells[idx], numeric), y = cellKey(b.cells[idx], numeric);
      var r = x < y ? -1 : (x > y ? 1 : 0);
      return dir === 'ascending' ? r : -r;
    });
    rows.forEach(function (r) { body.appendChild(r); });
  }
  Array.prototype.forEach.call(document.querySelectorAll('table.sortable'), function (table) {
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, idx) {
      th.tabIndex = 0;
      th.addEventListener('click', function () { sortBy(table, th, idx); });
      th.addEventListener('keydown', function (ev) {
        if (ev.key === 'Enter' || ev.key === ' ') { ev.preventDefault(); sortBy(table, th, idx); }
      });
    });
  });
  // Hovering a candidate (table row or legend key) picks out its kernels in the timeline.
  var tl = document.getElementById('timeline');
  if (!tl) return;
  function focus(cid) {
    tl.classList.toggle('focusing', !!cid);
    Array.prototype.forEach.call(tl.querySelectorAll('.cands rect'), function (r) {
      r.classList.toggle('on', r.getAttribute('data-c') === cid);
    });
  }
  Array.prototype.forEach.call(document.querySelectorAll('[data-c]'), function (el) {
    if (el.closest('#timeline')) return;
    el.addEventListener('mouseenter', function () { focus(el.getAttribute('data-c')); });
    el.addEventListener('mouseleave', function () { focus(null); });
  });
})();
"""
