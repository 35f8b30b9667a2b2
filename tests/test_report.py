"""Stage 5: terminal, HTML and text reports rendered from analysis.json (+ apply.json)."""
from __future__ import annotations

import copy
import io
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from rich.console import Console

from advisor.errors import AdvisorError
from advisor.report import load, render_reports
from advisor.report.dataflow import NODE_W, _layers, _place
from advisor.report.html import render_html, write_html
from advisor.report.terminal import render_terminal
from advisor.units import fmt_bytes, fmt_bw, fmt_pct, fmt_time, module_groups, modules_summary, shorten_path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(Path(__file__).resolve().parent))
import browser_check  # noqa: E402


@pytest.fixture(scope="module")
def analysis() -> dict:
    return json.loads((FIXTURES / "analysis_example.json").read_text())


@pytest.fixture(scope="module")
def applied() -> dict:
    return json.loads((FIXTURES / "apply_example.json").read_text())


def _terminal(analysis, apply=None, width=120, top=10) -> str:
    con = Console(record=True, width=width, file=io.StringIO(), color_system=None)
    render_terminal(analysis, apply, con, top=top)
    return con.export_text()


def _report_dir(tmp_path, analysis, apply=None) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    (d / "analysis.json").write_text(json.dumps(analysis))
    if apply is not None:
        (d / "apply.json").write_text(json.dumps(apply))
    return d


# ---------------------------------------------------------------------------------- formatting
def test_units():
    assert fmt_time(0.5) == "500 ns" and fmt_time(3.14159) == "3.14 µs" and fmt_time(812.4) == "812 µs"
    assert fmt_time(15062.6) == "15.06 ms" and fmt_time(None) == "–"
    assert fmt_bytes(8388608) == "8.39 MB" and fmt_bytes(512) == "512 B" and fmt_bytes(1.05e9) == "1.05 GB"
    assert fmt_bw(2.95e12) == "2.95 TB/s" and fmt_bw(9.05e9) == "9.05 GB/s"
    assert fmt_pct(0.1513) == "15.1 %" and fmt_pct(0.0011) == "0.11 %"


def test_module_ranges_hf_and_profiler_names():
    hf = [f"model.layers.{i}.mlp" for i in range(32)] + [f"model.layers.{i}.mlp.act_fn" for i in range(32)]
    assert module_groups(hf) == ["model.layers.{0..31}.mlp"]  # a named block absorbs its children
    norms = [f"model.layers.{i}" for i in range(4)] + [f"model.layers.{i}.post_attention_layernorm" for i in range(4)]
    assert module_groups(norms) == ["model.layers.{0..3}.post_attention_layernorm"]  # `layers.3` is too coarse
    assert module_groups(["a.0.b", "a.2.b", "a.3.b", "a.4.b"]) == ["a.{0,2..4}.b"]
    prof = [f"LlamaForCausalLM_0/LlamaModel_0/LlamaDecoderLayer_{i}/LlamaMLP_{i}" for i in range(2)]
    assert module_groups(prof) == ["LlamaForCausalLM_0/LlamaModel_0/LlamaDecoderLayer_{0,1}/LlamaMLP_{0,1}"]
    assert modules_summary(prof, limit=48) == ["…/LlamaDecoderLayer_{0,1}/LlamaMLP_{0,1}"]
    assert modules_summary([""]) == ["(top level)"]
    short = shorten_path("transformer.h.{0..47}.attention.self_attention.query_key_value", 48)
    assert "{0..47}" in short and short.endswith("query_key_value") and len(short) <= 48


# ------------------------------------------------------------------------------------ terminal
def test_terminal_has_titles_units_and_numbers(analysis):
    out = _terminal(analysis)
    for c in analysis["candidates"]:
        assert c["title"].split(":")[0] in out
    for unit in ("µs", "ms", "GB", "MB", "TB/s", "%"):
        assert unit in out
    assert "NVIDIA H100 80GB HBM3" in out and "682 kernels" in out and "15.06 ms" in out
    assert "model.layers.{0..15}" in out and "2.28 ms" in out and "4.83 GB" in out
    assert "aten::_assert_async" in out  # unknown ops are listed
    assert "Low confidence" not in out


def test_terminal_with_apply_and_low_confidence(analysis, applied):
    a = copy.deepcopy(analysis)
    a["low_confidence"], a["source"]["et"] = True, None
    out = _terminal(a, applied)
    assert "✓ valid" in out and "✗ failed" in out and "skipped" in out
    assert "2.41 ms" in out  # measured 75.3 µs per call × 32 occurrences
    assert "15.94 ms → 12.87 ms" in out and "1.24×" in out
    assert "Low confidence" in out and "no execution trace" in out
    assert "max_abs 0.0312 exceeds atol" in out


def test_terminal_narrow_and_top(analysis, applied):
    out = _terminal(analysis, applied, width=80, top=3)
    assert "(3 of 7)" in out and "SwiGLU" in out and "Cross-entropy" not in out
    assert max(len(line) for line in out.splitlines()) <= 80


# ---------------------------------------------------------------------------------------- HTML
class _Tree(HTMLParser):
    """Collects, per candidate article, whether a `.dataflow` div holds an <svg>."""

    VOID = {"meta", "br", "wbr", "img", "input", "link", "hr"}

    def __init__(self):
        super().__init__()
        self.stack, self.flows, self.ids, self.fetching = [], {}, [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.append(a["id"])
        for k in ("src", "href", "xlink:href", "action", "poster"):
            if a.get(k) and not a[k].startswith(("#", "data:")):
                self.fetching.append((tag, k, a[k]))
        if tag in self.VOID:
            return
        self.stack.append((tag, a))
        if tag == "svg":
            cand = next((x.get("id") for t, x in self.stack if t == "article"), None)
            in_flow = any("dataflow" in (x.get("class") or "").split() for t, x in self.stack)
            if cand and in_flow:
                self.flows[cand] = self.flows.get(cand, 0) + 1

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self.stack.pop()

    def handle_endtag(self, tag):
        while self.stack:
            t, _ = self.stack.pop()
            if t == tag:
                break


def _parse(html: str) -> _Tree:
    t = _Tree()
    t.feed(html)
    return t


def test_html_is_self_contained(analysis, applied):
    html = render_html(analysis, applied)
    tree = _parse(html)
    assert tree.fetching == []  # no src/href that would load anything
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.I)
    assert not re.search(r"@import|url\(\s*['\"]?(https?:)?//|<link\b", html, re.I)
    assert "Content-Security-Policy" in html and "default-src 'none'" in html
    for key in ("summary-chart", "candidates-table", "timeline"):
        assert tree.ids.count(key) == 1, key
    assert len(set(tree.ids)) == len(tree.ids)  # ids (incl. SVG markers) are unique in the page


def test_html_sorting_js_present(analysis):
    html = render_html(analysis, None)
    assert 'class="sortable"' in html and "addEventListener('click'" in html and "aria-sort" in html
    assert re.search(r'<td class="num" data-v="2278\.4"', html)  # raw numbers for sorting, not "2.28 ms"


def test_every_candidate_has_a_dataflow_svg(analysis, applied):
    tree = _parse(render_html(analysis, applied))
    assert {f"cand-{c['id']}" for c in analysis["candidates"]} == set(tree.flows)
    assert all(n == 1 for n in tree.flows.values())


def test_graph_rewrites_are_in_both_reports(analysis, applied):
    """apply.json's rewrites besides our kernels (cuBLASLt's epilogues, attention inputs laid out) are named in the
    terminal summary and the HTML's After-apply card, with their counts; a report without them shows none."""
    a = copy.deepcopy(applied)
    a["gemm_epilogues"] = {"linear 16384 x 768 -> 3072 (bfloat16) + GELU: one cuBLASLt GEMM with the activation in "
                           "its epilogue (0.201 ms against 0.243 ms as two kernels)": 13}
    a["attention_layouts"] = {"attention's attn_mask (32, 12, 512, 512) laid out contiguously <b>": 14}
    out = _terminal(analysis, a, width=200)
    assert "Graph rewrites" in out and "cuBLASLt epilogue: linear 16384 x 768 -> 3072" in out and "(×13)" in out
    assert "attention input laid out: attention's attn_mask" in out and "(×14)" in out
    html = render_html(analysis, a)
    assert "Graph rewrites" in html and "0.201 ms against 0.243 ms" in html and "(×13)" in html
    assert "&lt;b&gt;" in html and "contiguously <b>" not in html  # escaped
    assert "Graph rewrites" not in _terminal(analysis, applied) and "Graph rewrites" not in render_html(analysis, applied)


def test_html_apply_sections(analysis, applied):
    html = render_html(analysis, applied)
    assert 'class="code"' in html and '<span class="tk-d">@triton.jit</span>' in html
    assert "validation failed" in html and "max_abs 0.0312 exceeds atol" in html
    assert "15.94 ms" in html and "12.87 ms" in html and "1.24×" in html
    assert "LlamaRMSNorm" in html and "c4_cross_entropy.py" in html  # manifest
    plain = render_html(analysis, None)
    assert 'class="code"' not in plain and "Manifest" not in plain


def test_html_escapes_everything(analysis, applied):
    a, p = copy.deepcopy(analysis), copy.deepcopy(applied)
    evil = '<script>alert("x")</script>'
    a["candidates"][0]["title"] = evil + ": a → b"
    a["candidates"][0]["modules"] = [evil]
    a["candidates"][0]["graph"]["nodes"][0]["op"] = evil
    a["timeline"][0]["name"] = evil
    a["device"]["name"] = evil
    p["patterns"][0]["source"] = "x = '</code></pre>" + evil + "'\n"
    p["patterns"][0]["reason"] = evil
    html = render_html(a, p)
    assert evil not in html and "<script>alert" not in html
    assert html.count("<script>") == 1  # only the page's own


def test_html_tolerates_sparse_input():
    # a candidate is read as an `advisor.records.Candidate`: its id and kind are what make it one
    sparse = {"schema_version": 1, "candidates": [{"id": "c1", "kind": "pointwise", "title": "Lonely: a → b", "graph": {
        "nodes": [{"id": "n0", "op": "aten::a"}, {"id": "n1", "op": "aten::b"}],
        "edges": [{"src": "n0", "dst": "n1"}, {"src": "n1", "dst": "n0"}, {"src": "n1", "dst": "ghost"}]}}]}
    html = render_html(sparse, {"schema_version": 1, "patterns": [{"candidate": "c1"}], "end_to_end": None})
    assert "Lonely" in html and "ghost" in html
    assert "Lonely" in _terminal(sparse, None)


def test_dataflow_layout_flows_right_and_never_overlaps(analysis):
    for c in analysis["candidates"]:
        vs, edges = _layers(c["graph"])
        width, height, *_ = _place(vs, edges)
        boxes = list(vs.values())
        for i, a in enumerate(boxes):
            assert 0 <= a.x and a.x + NODE_W <= width and 0 <= a.y and a.y + a.h <= height, (c["id"], a.id)
            for b in boxes[i + 1:]:
                apart = a.x + NODE_W <= b.x or b.x + NODE_W <= a.x or a.y + a.h <= b.y or b.y + b.h <= a.y
                assert apart, (c["id"], a.id, b.id)
        for ed in edges:  # columns strictly increase along every edge: left to right
            assert vs[ed["src"]].col < vs[ed["dst"]].col, (c["id"], ed)
        assert width <= 1400  # fits a laptop screen at >= 0.85 scale; long chains fold into bands


def test_long_timelines_stay_small(analysis):
    """A big model's iteration has tens of thousands of kernels; sub-pixel ones share marks."""
    from advisor.report.svg import timeline

    span = analysis["timeline"][-1]["ts_us"] + 10
    big = dict(analysis, timeline=[dict(k, ts_us=k["ts_us"] + r * span) for r in range(40) for k in analysis["timeline"]])
    svg = timeline(big, {"c1": "#f00"}, {})
    assert len(big["timeline"]) > 27_000 and svg.count("<rect") < 3000 and len(svg) < 1_000_000
    assert "kernels at this zoom" in svg
    small = timeline(analysis, {}, {})  # under the threshold: one mark per kernel, plus 2 lanes and candidates
    n_cand = sum(1 for k in analysis["timeline"] if k["candidate"])
    assert small.count("<rect") == 2 + len(analysis["timeline"]) + n_cand


# ---------------------------------------------------------------------------- files and the CLI
def test_render_reports_writes_html_and_txt(tmp_path, analysis, applied):
    d = _report_dir(tmp_path, analysis, applied)
    con = Console(record=True, width=100, file=io.StringIO())
    paths = render_reports(d, console=con)
    assert paths["html"].read_text().startswith("<!DOCTYPE html>")
    txt = paths["txt"].read_text()
    assert "Residual add + RMSNorm" in txt and "✓ valid" in txt and "\x1b[" not in txt
    assert "Residual add + RMSNorm" in con.export_text()
    assert render_reports(d, console=con, terminal=False) == paths  # the HTML alone, nothing printed
    assert con.export_text() == ""


@pytest.mark.parametrize("content, expect", [
    (None, "no analysis.json"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"schema_version": 99}', "schema_version 99"),
])
def test_load_errors_are_one_line(tmp_path, content, expect):
    if content is not None:
        (tmp_path / "analysis.json").write_text(content)
    with pytest.raises(AdvisorError) as ei:
        load(tmp_path)
    assert expect in str(ei.value) and "\n" not in str(ei.value)


def _cli(*args, cwd=ROOT):
    exe = shutil.which("fusion-advisor")
    cmd = [exe, *args] if exe else [sys.executable, "-m", "advisor", *args]
    env = dict(os.environ, COLUMNS="120")
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


def test_cli_report(tmp_path, analysis, applied):
    d = _report_dir(tmp_path, analysis, applied)
    r = _cli("report", str(d))
    assert r.returncode == 0, r.stderr
    assert "Residual add + RMSNorm" in r.stdout and "report.html" in r.stdout
    assert (d / "report.html").stat().st_size > 10_000 and (d / "report.txt").exists()


def test_cli_report_without_analysis_fails_in_one_line(tmp_path):
    r = _cli("report", str(tmp_path))
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "analysis.json" in lines[0] and "Traceback" not in r.stderr


# ------------------------------------------------------------------------------ real analyzer
def test_renders_what_the_analyzer_writes(tmp_path):
    """The contract with stage 2: a real (CPU) analysis.json renders, with a dataflow per candidate."""
    analyze = pytest.importorskip("advisor.analysis.api").analyze
    from advisor.collect.runner import profile_script

    script = tmp_path / "seed.py"
    script.write_text("import torch\n"
                      "class Seed(torch.nn.Module):\n"
                      "    def forward(self, x, b):\n"
                      "        return torch.log(torch.relu(x + b))\n"
                      "x, b = torch.randn(4096), torch.randn(4096)\n"
                      "m = Seed()\n"
                      "for _ in range(3):\n"
                      "    m(x, b)\n")
    profile_script(script, [], out_dir=tmp_path / "out", device="cpu", region=None)
    doc = analyze(tmp_path / "out").doc
    assert doc["candidates"], "the seed example should yield a candidate"
    tree = _parse(render_html(doc, None))
    assert {f"cand-{c['id']}" for c in doc["candidates"]} == set(tree.flows)
    out = _terminal(doc)
    assert doc["candidates"][0]["title"].split(":")[0] in out and "ops" in out


# -------------------------------------------------------------------------------------- browser
def _need_chromium():
    if browser_check.find_chromium():
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail("chromium is required in CI (.ci/run installs it)")
    pytest.skip("chromium not installed")


@pytest.mark.parametrize("with_apply", [True, False], ids=["with-apply", "analysis-only"])
def test_report_in_headless_chromium(tmp_path, analysis, applied, with_apply):
    _need_chromium()
    html = write_html(analysis, applied if with_apply else None, tmp_path / "report.html")
    shot = tmp_path / "report.png"
    res = browser_check.check(html, shot)
    assert res["ok"], res["failures"]
    assert res["requests"] == [html.resolve().as_uri()]
    assert len(res["probe"]["dataflows"]) == len(analysis["candidates"])
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


# ------------------------------------------------------------------ what to do next (issue 20 item 8)
def _with_ops(analysis, ops, kind=None):
    a = copy.deepcopy(analysis)
    a["candidates"][0]["ops"] = ops
    if kind:
        a["candidates"][0]["kind"] = kind
    return a


def test_next_step_names_the_command_to_run(tmp_path, analysis):
    text = _terminal(analysis)
    assert "Next step" in text and "fusion-advisor generate OUT --top" in text and "advisor.optimize(" in text
    html = render_html(analysis, None, out=tmp_path)
    assert 'id="next-step"' in html and f"fusion-advisor generate {tmp_path} --top" in html


def test_next_step_is_the_existing_fix_when_there_is_one(analysis):
    adam = _with_ops(analysis, ["aten::mul_", "aten::addcdiv_", "aten::lerp_"])
    assert "fused=True" in _terminal(adam) and "fused=True" in render_html(adam)
    attention = _with_ops(analysis, ["aten::matmul", "aten::softmax", "aten::matmul"], kind="attention")
    assert "scaled_dot_product_attention" in _terminal(attention)


def _apply_with(applied, **fields):
    ap = copy.deepcopy(applied)
    ap["patterns"][0].update(fields)
    return ap


def test_each_patterns_real_status(analysis, applied):
    """Validated but not found by the patcher is 'not patched', with the patcher's reason, never '✓ valid'."""
    ap = _apply_with(applied, validated=True, patched=False, status="not found in the captured graphs",
                     status_code="not_matched")
    cid = ap["patterns"][0]["candidate"]
    html = render_html(analysis, ap)
    row = re.search(rf'<tr data-c="{cid}">.*?</tr>', html, re.S).group(0)
    assert "not patched" in row and "not found in the captured graphs" in row and "✓ valid" not in row
    assert "not found in the captured graphs" in _terminal(analysis, ap)
    kept_out = _apply_with(applied, validated=True, patched=True, status="not kept: +3 µs per call alone",
                           status_code="not_kept")
    assert "not kept: +3 µs per call alone" in render_html(analysis, kept_out)
    patched = render_html(analysis, _apply_with(applied, validated=True, patched=True, status="patched",
                                                status_code="patched"))
    assert "✓ patched" in re.search(rf'<tr data-c="{cid}">.*?</tr>', patched, re.S).group(0)


def test_a_slowdown_is_never_green(analysis, applied):
    ap = copy.deepcopy(applied)
    ap["end_to_end"] = {"before_ms": 1.0, "after_ms": 1.25, "speedup": 0.8, "timing_meaningful": True}
    html = render_html(analysis, ap)
    assert 'class="tile bad"' in html and 'class="tile good"' not in html and "var(--good)\">0.80" not in html
    assert "1.25× slower" in html and "faster" not in _terminal(analysis, ap).split("After apply")[1].split("\n")[0]
    assert "advisor.patch(" not in _terminal(analysis, ap)  # nothing worth keeping


def test_no_python_reprs_in_the_html(analysis, applied):
    ap = _apply_with(applied, errors={"rel_l2": 1e-7, "dtype": "float32", "note": None,
                                      "shapes": [{"case": "odd", "inputs": [[3, 5, 7], [11, 7]]}]})
    html = render_html(analysis, ap)
    assert "odd: 3×5×7, 11×7" in html
    assert not re.search(r"\[\[|\{'|'case'|>None<", html)


def test_batchnorm_inputs_are_named():
    a = json.loads((ROOT / "reports" / "examples" / "tv_resnet50" / "analysis.json").read_text())
    a["candidates"] = a["candidates"][:2]
    html = render_html(a)
    for role in ("weight", "bias", "running_mean", "running_var"):
        assert f'class="io-name">{role}</text>' in html
