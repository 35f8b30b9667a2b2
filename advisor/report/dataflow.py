"""The per-candidate dataflow diagram: inputs → op nodes → outputs, layered left to right by depth.

Long chains (an RMSNorm is nine ops) would be far wider than a laptop screen, so columns fold
into bands that read like lines of text: left to right, then on to the next band below.
"""
from __future__ import annotations

import math
from collections import defaultdict
from html import escape
from typing import Dict, List, Tuple

from advisor.records import Candidate
from advisor.report.style import class_color, class_label
from advisor.units import ellipsize, fmt_bytes, fmt_shape, fmt_time, op_short, short_dtype, short_kernel

NODE_W, OP_H, IO_H = 112, 44, 52
GAP = 88            # room between columns for a two-line edge label
ROW = 68            # vertical pitch of nodes within a column
MARGIN_X, MARGIN_Y = 22, 14
CHANNEL = 14        # spacing of parallel routed edges: one label line fits between two
MAX_W = 1160
MIN_SCALE = 0.85


def e(s) -> str:
    return escape(str(s), quote=True)


class _V:
    __slots__ = ("id", "kind", "data", "col", "x", "y", "h", "order")

    def __init__(self, vid, kind, data):
        self.id, self.kind, self.data = vid, kind, data
        self.col, self.x, self.y, self.h, self.order = 0, 0.0, 0.0, OP_H if kind == "op" else IO_H, 0.0


def _layers(graph: dict) -> Tuple[Dict[str, _V], List[dict]]:
    vs: Dict[str, _V] = {}
    for kind, key in (("in", "inputs"), ("op", "nodes"), ("out", "outputs")):
        for d in graph.get(key) or []:
            if isinstance(d, dict) and d.get("id") is not None:
                vs.setdefault(str(d["id"]), _V(str(d["id"]), kind, d))
    edges = []
    for ed in graph.get("edges") or []:
        if not isinstance(ed, dict):
            continue
        s, t = str(ed.get("src")), str(ed.get("dst"))
        for v in (s, t):  # an edge naming an undeclared vertex still deserves a box
            vs.setdefault(v, _V(v, "op", {"id": v, "op": v, "class": "other"}))
        if s != t:
            edges.append({**ed, "src": s, "dst": t})
    preds, succs = defaultdict(list), defaultdict(list)
    for ed in edges:
        preds[ed["dst"]].append(ed["src"])
        succs[ed["src"]].append(ed["dst"])

    # Longest-path depth of ops; inputs count as depth 0. Iterating to a fixed point (bounded)
    # tolerates a cyclic graph from a buggy analyser instead of hanging.
    ops = [v for v in vs.values() if v.kind == "op"]
    depth = {v.id: 1 for v in ops}
    for _ in range(len(ops) + 1):
        changed = False
        for v in ops:
            d = 1 + max((depth.get(p, 0) for p in preds[v.id] if vs[p].kind == "op"), default=0)
            if d > depth[v.id] and d <= len(ops):
                depth[v.id], changed = d, True
        if not changed:
            break
    for v in ops:
        v.col = depth[v.id]
    last_op = max((v.col for v in ops), default=0)
    for v in vs.values():
        if v.kind == "in":  # just left of its first consumer, so weights do not cross the whole graph
            cons = [vs[s].col for s in succs[v.id] if vs[s].kind == "op"]
            v.col = max(0, min(cons) - 1) if cons else 0
    for v in vs.values():
        if v.kind == "out":
            prods = [vs[p].col for p in preds[v.id] if vs[p].kind != "out"]
            v.col = (max(prods) + 1) if prods else last_op + 1

    cols = defaultdict(list)
    for i, v in enumerate(vs.values()):
        v.order = i
        cols[v.col].append(v)
    # Two barycentre sweeps: order each column by where its producers sit, to cut crossings.
    for _ in range(2):
        for c in sorted(cols):
            for v in cols[c]:
                ps = [vs[p].order for p in preds[v.id] if vs[p].col < c]
                if ps:
                    v.order = sum(ps) / len(ps) + v.order * 1e-6
            cols[c].sort(key=lambda v: (v.kind == "out", v.order))
            for i, v in enumerate(cols[c]):
                v.order = i
    return vs, edges


def _place(vs: Dict[str, _V], edges: List[dict]):
    ncols = max((v.col for v in vs.values()), default=0) + 1
    pitch = NODE_W + GAP
    natural = 2 * MARGIN_X + ncols * NODE_W + (ncols - 1) * GAP
    # Scaling down a little keeps a graph on one line; past ~0.85 the labels get too small to read.
    per_band = ncols if natural <= MAX_W / MIN_SCALE else max(3, (MAX_W - 2 * MARGIN_X + GAP) // pitch)
    bands = math.ceil(ncols / per_band)
    per_band = math.ceil(ncols / bands)

    def band_of(col):
        return col // per_band

    cols = defaultdict(list)
    for v in vs.values():
        cols[v.col].append(v)
    for c in cols:
        cols[c].sort(key=lambda v: v.order)
    row_of = {v.id: (i, len(col)) for col in cols.values() for i, v in enumerate(col)}

    # Edges that skip a column run in horizontal channels above the band (sources in the upper half
    # of their column) or below it (lower half, and every edge that continues in the next band).
    n_top, n_bot = defaultdict(int), defaultdict(int)
    routes = {}
    for i, ed in enumerate(edges):
        s, t = vs[ed["src"]], vs[ed["dst"]]
        bs, bt = band_of(s.col), band_of(t.col)
        i_row, n_rows = row_of[s.id]
        if bs == bt and t.col - s.col <= 1:
            routes[i] = ("direct", bs, 0)
        elif bs == bt and i_row < n_rows / 2:
            routes[i] = ("top", bs, n_top[bs])
            n_top[bs] += 1
        else:
            routes[i] = ("bottom", bs, n_bot[bs])
            n_bot[bs] += 1

    heights = []
    for b in range(bands):
        hs = [sum(v.h for v in cols[c]) + (len(cols[c]) - 1) * (ROW - OP_H) for c in cols if band_of(c) == b]
        heights.append(max(hs, default=OP_H))
    y = MARGIN_Y
    band_top = []
    for b in range(bands):
        y += n_top[b] * CHANNEL + (12 if n_top[b] else 0)
        band_top.append(y)
        y += heights[b] + (n_bot[b] * CHANNEL + 16 if n_bot[b] else 0) + (22 if b < bands - 1 else 0)
    total_h = y + MARGIN_Y
    width = 2 * MARGIN_X + per_band * NODE_W + (per_band - 1) * GAP
    for c, col in cols.items():
        b = band_of(c)
        col_h = sum(v.h for v in col) + (len(col) - 1) * (ROW - OP_H)
        yy = band_top[b] + (heights[b] - col_h) / 2
        for v in col:
            v.x = MARGIN_X + (c % per_band) * pitch
            v.y = yy
            yy += v.h + ROW - OP_H
    return width, total_h, routes, band_top, heights


def _node(v: _V) -> str:
    d, x, y = v.data, v.x, v.y
    if v.kind == "op":
        cls = str(d.get("class") or "other")
        col = class_color(cls)
        # CPU traces have no kernels at all, so "did work" is: not a view, and took time or launched one.
        has_kernel = _does_work(d)
        # Class shows as colour (legend under the diagram): the box has room for the time only.
        sub = fmt_time(d.get("time_us")) if has_kernel else "view, no kernel"
        tip = f"{d.get('op', '?')} ({class_label(cls)})\nmodule: {d.get('module') or '(top level)'}"
        if has_kernel:
            tip += (f"\nkernel: {short_kernel(d.get('kernel'), 100)}" if d.get("kernel") else "") + f"\ntime: {fmt_time(d.get('time_us'))}"
        else:
            tip += "\nno kernel (a view)"
        dash = '' if has_kernel else ' stroke-dasharray="4 3"'
        return (f'<g class="node op" data-class="{e(cls)}"><title>{e(tip)}</title>'
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{NODE_W}" height="{v.h}" rx="7" fill="{col}" fill-opacity="0.13" '
                f'stroke="{col}" stroke-width="1.6"{dash}/>'
                f'<rect x="{x:.1f}" y="{y:.1f}" width="5" height="{v.h}" rx="2" fill="{col}"/>'
                f'<text x="{x + NODE_W / 2 + 2:.1f}" y="{y + 19:.1f}" text-anchor="middle" class="op-name">'
                f'{e(ellipsize(d.get("label") or op_short(d.get("op")), 15))}</text>'
                f'<text x="{x + NODE_W / 2 + 2:.1f}" y="{y + 34:.1f}" text-anchor="middle" class="op-sub">{e(sub)}</text></g>')
    label = "input" if v.kind == "in" else "output"
    shape, dt = fmt_shape(d.get("shape")), short_dtype(d.get("dtype"))
    tip = f"{label} {v.id}" + (f" ({d['role']})" if d.get("role") else "") + \
        f": {shape} {d.get('dtype', '?')}, {fmt_bytes(d.get('bytes'))}"
    name = ellipsize(d["role"], 18) if d.get("role") else f"{label} {v.id}"
    return (f'<g class="node io {v.kind}"><title>{e(tip)}</title>'
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{NODE_W}" height="{v.h}" rx="10" class="io-box"/>'
            f'<text x="{x + NODE_W / 2:.1f}" y="{y + 15:.1f}" text-anchor="middle" class="io-name">{e(name)}</text>'
            f'<text x="{x + NODE_W / 2:.1f}" y="{y + 30:.1f}" text-anchor="middle" class="mono">{e(ellipsize(shape, 19))}</text>'
            f'<text x="{x + NODE_W / 2:.1f}" y="{y + 44:.1f}" text-anchor="middle" class="mono muted">'
            f'{e(dt)} · {e(fmt_bytes(d.get("bytes")))}</text></g>')


def _blocked(vs, a: _V, b: _V, y: float) -> bool:
    return any(a.col < v.col < b.col and v.y - 4 < y < v.y + v.h + 4 for v in vs.values())


def dataflow_svg(c: Candidate) -> str:
    graph = c.graph or {}
    cid = c.id
    vs, edges = _layers(graph)
    for vid, role in input_roles(c).items():
        if vid in vs:
            vs[vid].data = {**vs[vid].data, "role": role}
    if not vs:
        return ('<svg class="empty" width="320" height="40" role="img"><text x="0" y="24" class="muted">'
                'no graph in analysis.json</text></svg>')
    width, height, routes, band_top, heights = _place(vs, edges)
    marker = "arr-" + "".join(ch if ch.isalnum() else "-" for ch in cid)
    paths, labels = [], []
    # One label per produced tensor (fan-out edges carry the same one), on its shortest edge.
    labelled = set()
    order = sorted(range(len(edges)), key=lambda i: (routes[i][0] != "direct", i))
    for i in order:
        ed = edges[i]
        s, t = vs[ed["src"]], vs[ed["dst"]]
        x1, y1 = s.x + NODE_W, s.y + s.h / 2
        x2, y2 = t.x - 2, t.y + t.h / 2
        kind, band, k = routes[i]
        # Parallel channel edges get their own vertical lanes in the column gaps.
        xa, xb = x1 + 8 + (k % 6) * 5, x2 - 10 - (k % 6) * 5
        same_row = abs(y1 - y2) < 1 and abs(t.x - s.x - (t.col - s.col) * (NODE_W + GAP)) < 1
        if kind == "direct" or (same_row and not _blocked(vs, s, t, y1)):
            mx = (x1 + x2) / 2
            d = f"M{x1:.1f},{y1:.1f} C{mx:.1f},{y1:.1f} {mx:.1f},{y2:.1f} {x2:.1f},{y2:.1f}"
            lx, ly, one_line = x1 + min(GAP, x2 - x1) / 2, (y1 + y2) / 2, False
            # Beside the curve's flat start, on the side it does not bend towards; a fan-out that
            # bends both ways keeps the midpoint.
            dirs = {(vs[o["dst"]].y + vs[o["dst"]].h / 2 > y1 + 1) - (vs[o["dst"]].y + vs[o["dst"]].h / 2 < y1 - 1)
                    for o in edges if o["src"] == s.id}
            if dirs <= {0, 1}:
                ly = y1
            elif dirs == {-1}:
                ly = y1 + 25
        else:
            cy = (band_top[band] - 10 - k * CHANNEL) if kind == "top" else \
                 (band_top[band] + heights[band] + 12 + k * CHANNEL)
            d = f"M{x1:.1f},{y1:.1f} H{xa:.1f} V{cy:.1f} H{xb:.1f} V{y2:.1f} H{x2:.1f}"
            lx, ly, one_line = (xa + xb) / 2, cy, True
        tensor = f"{fmt_shape(ed.get('shape'))} {short_dtype(ed.get('dtype'))}, {fmt_bytes(ed.get('bytes'))}"
        paths.append(f'<path d="{d}" class="edge" marker-end="url(#{marker})"><title>{e(ed["src"])} → '
                     f'{e(ed["dst"])}: {e(tensor)}</title></path>')
        if s.kind == "in" or t.kind == "out" or s.id in labelled:
            continue  # the box already states the tensor
        labelled.add(s.id)
        shape, meta = fmt_shape(ed.get("shape")), f"{short_dtype(ed.get('dtype'))} · {fmt_bytes(ed.get('bytes'))}"
        if one_line:
            labels.append(f'<text x="{lx:.1f}" y="{ly - 3:.1f}" text-anchor="middle" class="elabel">'
                          f'{e(shape)} {e(meta)}</text>')
        else:
            labels.append(f'<text x="{lx:.1f}" y="{ly - 14:.1f}" text-anchor="middle" class="elabel">'
                          f'{e(ellipsize(shape, 16))}<tspan x="{lx:.1f}" dy="10.5">{e(meta)}</tspan></text>')
    nodes = "".join(_node(v) for v in vs.values())
    n_ops = sum(1 for v in vs.values() if v.kind == "op")
    return (f'<svg viewBox="0 0 {width:.0f} {height:.0f}" width="{width:.0f}" height="{height:.0f}" role="img" '
            f'aria-label="Dataflow of candidate {e(cid)}: {n_ops} ops">'
            f'<defs><marker id="{marker}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
            f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" class="arrow"/></marker></defs>'
            f'<g class="edges">{"".join(paths)}</g><g class="nodes">{nodes}</g>'
            f'<g class="labels">{"".join(labels)}</g></svg>')


GENERIC_ARGS = {"self", "input", "other", "x", "tensor", "tensors", "a", "b", "mat1", "mat2"}


def _arg_names(schema: str) -> List[str]:
    """`aten::batch_norm(Tensor input, Tensor? weight, ...) -> Tensor` -> ["input", "weight", ...]."""
    inner = schema.partition("(")[2].rpartition(") ->")[0]
    names, depth, cur = [], 0, ""
    for ch in inner + ",":
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            names.append(cur.split("=")[0].split()[-1] if cur.strip() else "")
            cur = ""
        else:
            cur += ch
    return [n.lstrip("*") for n in names]


def input_roles(c: Candidate) -> Dict[str, str]:
    """Inputs the program reads as a named schema argument (weight, bias, running_mean, ...), by input id:
    `in1`…`in4` of a BatchNorm say nothing. The main operand (self, input, other) keeps its id."""
    roles: Dict[str, str] = {}
    for node in (c.program or {}).get("nodes") or []:
        for name, arg in zip(_arg_names(str(node.get("schema") or "")), node.get("args") or []):
            ref = arg.get("ref") if isinstance(arg, dict) else None
            if ref and ref.startswith("in") and ref not in roles and name and name not in GENERIC_ARGS:
                roles[ref] = name
    return roles


def classes_in(c: Candidate) -> List[str]:
    nodes = (c.graph or {}).get("nodes") or []
    return sorted({str(n.get("class") or "other") for n in nodes if isinstance(n, dict)})


def _does_work(n: dict) -> bool:
    if n.get("class") == "view":
        return False
    return bool(n.get("kernel")) or (n.get("time_us") or 0) > 0


def node_count(c: Candidate) -> Tuple[int, int]:
    """(ops that do work, all ops) of one occurrence."""
    nodes = [n for n in (c.graph or {}).get("nodes") or [] if isinstance(n, dict)]
    return sum(1 for n in nodes if _does_work(n)), len(nodes)


