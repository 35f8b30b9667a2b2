"""Formatting shared by the terminal and HTML reports (and an analysis's summary), so all say the same number
the same way.

Byte sizes use decimal units (1 MB = 10^6 B) to agree with bandwidths quoted in GB/s.
"""
from __future__ import annotations

import re
from typing import Iterable, List, Optional

DTYPE_SHORT = {
    "float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
    "float64": "fp64", "double": "fp64", "int64": "i64", "long": "i64", "int32": "i32", "int": "i32",
    "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "bool", "float8_e4m3fn": "fp8e4m3", "float8_e5m2": "fp8e5m2",
}


def _num(x) -> Optional[float]:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if v == v else None  # NaN counts as missing


def fmt_time(us, missing: str = "–") -> str:
    v = _num(us)
    if v is None:
        return missing
    a = abs(v)
    if a < 1:
        return f"{v * 1000:.0f} ns" if a >= 0.001 or a == 0 else f"{v:.2g} µs"
    if a < 10:
        return f"{v:.2f} µs"
    if a < 1000:
        return f"{v:.1f} µs" if a < 100 else f"{v:.0f} µs"
    if a < 1e6:
        ms = v / 1000
        return f"{ms:.2f} ms" if abs(ms) < 100 else f"{ms:.1f} ms"
    return f"{v / 1e6:.2f} s"


def fmt_ms(ms, missing: str = "–") -> str:
    v = _num(ms)
    return missing if v is None else fmt_time(v * 1000)


def fmt_bytes(n, missing: str = "–") -> str:
    v = _num(n)
    if v is None:
        return missing
    a = abs(v)
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if a >= scale:
            q = v / scale
            return f"{q:.2f} {unit}" if abs(q) < 10 else (f"{q:.1f} {unit}" if abs(q) < 100 else f"{q:.0f} {unit}")
    return f"{v:.0f} B"


def fmt_bw(bps, missing: str = "–") -> str:
    v = _num(bps)
    if v is None:
        return missing
    if abs(v) >= 1e12:
        return f"{v / 1e12:.2f} TB/s"
    return f"{v / 1e9:.0f} GB/s" if abs(v) >= 1e10 else f"{v / 1e9:.2f} GB/s"


def fmt_pct(share, missing: str = "–") -> str:
    v = _num(share)
    if v is None:
        return missing
    p = v * 100
    if p == 0:
        return "0 %"
    return f"{p:.2f} %" if abs(p) < 1 else f"{p:.1f} %"


def fmt_int(n, missing: str = "–") -> str:
    v = _num(n)
    return missing if v is None else f"{int(round(v)):,}"


def fmt_count(n, missing: str = "–") -> str:
    """A count per iteration: whole numbers as integers, a fraction as one (a pattern that runs once in three
    iterations is 0.33 per iteration, never "0")."""
    v = _num(n)
    if v is None:
        return missing
    if abs(v - round(v)) < 1e-9 or abs(v) >= 100:
        return f"{int(round(v)):,}"
    return f"{v:.2g}" if abs(v) < 1 else f"{v:.3g}"


def fmt_sci(x, missing: str = "–") -> str:
    v = _num(x)
    if v is None:
        return missing
    if v == 0:
        return "0"
    return f"{v:.3g}" if 1e-3 <= abs(v) < 1e4 else f"{v:.2e}"


def short_dtype(dtype) -> str:
    d = str(dtype or "?").replace("torch.", "")
    return DTYPE_SHORT.get(d, d)


def fmt_shape(shape) -> str:
    if shape is None:
        return "?"
    try:
        return "[" + ",".join(str(s) for s in shape) + "]"
    except TypeError:
        return str(shape)


def op_short(op: str) -> str:
    """`aten::_to_copy` -> `_to_copy`: the namespace repeats on every node and costs width."""
    op = str(op or "?")
    return op.split("::", 1)[1] if op.startswith("aten::") else op


def short_kernel(name: str, limit: int = 60) -> str:
    """A CUDA kernel name without its template arguments and signature, which can run to 1000 chars."""
    s = str(name or "")
    if s.startswith(("Memcpy", "Memset")):
        return s
    s = s.replace("->", "→")
    s = re.sub(r"^(void|__global__)\s+", "", s)
    depth, out = 0, []
    for ch in s:
        if ch in "<(":
            if depth == 0:
                out.append("<…>" if ch == "<" else "(…)")
            depth += 1
        elif ch in ">)" and depth:
            depth -= 1
        elif depth == 0:
            out.append(ch)
    t = "".join(out).replace("(…)", "")
    return t if len(t) <= limit else t[: limit - 1] + "…"


def ellipsize(s: str, limit: int) -> str:
    s = str(s)
    return s if len(s) <= limit else s[: max(1, limit - 1)] + "…"


# ---- module paths -------------------------------------------------------------------------

# An index is a path segment of digits (`layers.3`, HF names) or a `_3` suffix (`LlamaMLP_3`, the
# profiler's module-instance names).
_INDEX = re.compile(r"(?:(?<=[./_])|^)(\d+)(?=[./]|$)")
_SEP = re.compile(r"[./](?![^{]*\})")  # separators outside `{0..31}`


def _ranges(nums: Iterable[int]) -> str:
    xs = sorted(set(nums))
    parts, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else (f"{xs[i]},{xs[j]}" if j == i + 1 else f"{xs[i]}..{xs[j]}"))
        i = j + 1
    return "{" + ",".join(parts) + "}"


def module_groups(modules: Iterable[str]) -> List[str]:
    """Collapse module paths into index-range patterns, leaves only.

    `model.layers.{0..31}.mlp` says where a pattern lives in one line where 32 paths would not.
    Ancestors are dropped (a residual add runs in `layers.3` itself, its norm in
    `layers.3.post_attention_layernorm`): the most specific module names the place.
    """
    mods = sorted({str(m) for m in modules if m is not None})
    if not mods:
        return []
    drop = set()
    for anc in mods:
        for desc in mods:
            if desc != anc and (anc == "" or desc.startswith(anc + ".") or desc.startswith(anc + "/")):
                # A numbered container entry (`layers.3`) is too coarse to name the site, so its
                # child wins; a named block (`mlp`) is the natural site, so it absorbs `mlp.act_fn`.
                coarse = anc == "" or re.search(r"(^|[./_])\d+$", anc) is not None
                drop.add(anc if coarse else desc)
    leaves = [m for m in mods if m not in drop]
    groups: dict = {}
    for m in leaves:
        nums = [int(x) for x in _INDEX.findall(m)]
        template = _INDEX.sub("\0", m)
        groups.setdefault((template, len(nums)), []).append(nums)
    out = []
    for (template, n), rows in groups.items():
        s = template
        for pos in range(n):
            vals = {r[pos] for r in rows}
            s = s.replace("\0", str(next(iter(vals))) if len(vals) == 1 else _ranges(vals), 1)
        out.append((-len(rows), s or "(top level)"))
    # Most repeated first: the layers are what the candidate is about, one-offs come after.
    return [s for _, s in sorted(out)]


def shorten_path(path: str, limit: int = 48) -> str:
    """Fit a module path in about `limit` chars, keeping what locates it: the index ranges and the leaf.

    Segments go in this order: the root-side ones before the first `{..}` range (keeping the
    container of a bare index, e.g. `layers`), then the longest of the rest; the leaf always stays.
    """
    if len(path) <= limit:
        return path
    seps = [m.group() for m in _SEP.finditer(path)]
    parts = _SEP.split(path)
    first_range = next((i for i, p in enumerate(parts) if "{" in p), len(parts) - 1)
    keep_parent = parts[first_range].startswith("{")  # `layers.{0..15}` needs `layers`; `Layer_{0,1}` does not
    order = list(range(0, max(0, first_range - (1 if keep_parent else 0))))
    order += sorted((i for i in range(first_range, len(parts) - 1) if "{" not in parts[i]), key=lambda i: -len(parts[i]))
    dropped = set()

    def join():
        out, prev_dropped = "", False
        for i, p in enumerate(parts):
            if i in dropped:
                if not prev_dropped:
                    out += ("" if i == 0 else seps[i - 1]) + "…"
                prev_dropped = True
                continue
            out += ("" if i == 0 else seps[i - 1]) + p
            prev_dropped = False
        return out

    for i in order:
        if len(join()) <= limit:
            break
        dropped.add(i)
    return join()  # may stay over the limit: a name cut mid-word would point nowhere


def modules_summary(modules: Iterable[str], max_groups: int = 2, limit: int = 48) -> List[str]:
    groups = module_groups(modules)
    shown = [shorten_path(g, limit) for g in groups[:max_groups]]
    if len(groups) > max_groups:
        shown.append(f"+{len(groups) - max_groups} more")
    return shown
