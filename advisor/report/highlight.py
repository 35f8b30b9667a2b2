"""Tiny Python/Triton syntax highlighter: server-side spans, so the page needs no JS library."""
from __future__ import annotations

import re
from html import escape

_KEYWORDS = ("False None True and as assert break class continue def del elif else except finally for from "
             "global if import in is lambda nonlocal not or pass raise return try while with yield").split()
_TOKEN = re.compile(
    r"(?P<com>#[^\n]*)"
    r"|(?P<str>[rbuf]{0,2}(?:\"\"\"[\s\S]*?\"\"\"|'''[\s\S]*?'''|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'))"
    r"|(?P<dec>@[\w.]+)"
    r"|(?P<tl>\b(?:tl|triton|torch)\.[\w.]+)"
    r"|(?P<kw>\b(?:" + "|".join(_KEYWORDS) + r")\b)"
    r"|(?P<num>\b(?:0[xX][0-9a-fA-F]+|\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)\b)"
    r"|(?P<fn>(?<=def )\w+)"
)
_CLASS = {"com": "tk-c", "str": "tk-s", "dec": "tk-d", "tl": "tk-t", "kw": "tk-k", "num": "tk-n", "fn": "tk-f"}


def highlight_python(src: str) -> str:
    """HTML for `src` with token spans; every character of the source is escaped exactly once."""
    out, pos = [], 0
    for m in _TOKEN.finditer(src):
        out.append(escape(src[pos:m.start()]))
        out.append(f'<span class="{_CLASS[m.lastgroup]}">{escape(m.group())}</span>')
        pos = m.end()
    out.append(escape(src[pos:]))
    return "".join(out)
