"""A distributed run's communication against compute per rank, the straggler, and the reports' per-rank view, on
the recorded two-rank gloo DDP trace (fixtures/ddp_gloo_trace) and on synthetic spans and ranks."""
from __future__ import annotations

import copy
import io
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from rich.console import Console

from advisor import codec
from advisor.analysis.overlap import CPU_RULE, GPU_RULE, communication_time
from advisor.analysis.ranks import STRAGGLER_MARGIN, analyze_ranks, merge
from advisor.documents import AnalysisDoc, DistributedSummary
from advisor.report.html import render_html, write_html
from advisor.report.terminal import render_terminal

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(Path(__file__).resolve().parent))
import browser_check  # noqa: E402


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    doc = analyze_ranks(FIXTURES / "ddp_gloo_trace", out)
    ranks = {k: json.loads((out / f"rank-{k}" / "analysis.json").read_text()) for k in (0, 1)}
    return doc.to_json(), ranks


def test_each_rank_has_its_communication_and_the_exposed_part(merged):
    doc, ranks = merged
    for k, rank_doc in ranks.items():
        c = rank_doc["communication_time"]
        assert c["rule"] == CPU_RULE
        # DDP's gradient all-reduce every step: communication, some of it waited on, within the iteration
        assert 0 < c["exposed_us"] <= c["communication_us"] < c["iteration_us"], (k, c)
        assert c["overlapped_us"] == pytest.approx(c["communication_us"] - c["exposed_us"])
        assert c["collectives"] >= 1
        assert AnalysisDoc.from_json(rank_doc).communication_time.exposed_us == c["exposed_us"]
    dist = DistributedSummary.from_json(doc["distributed"])
    assert [r.rank for r in dist.ranks] == [0, 1]
    assert [codec.to_json(r.communication_time) for r in dist.ranks] == [ranks[k]["communication_time"] for k in (0, 1)]
    # synchronous ranks: the same wall time per iteration, whatever each waited
    a, b = (r.communication_time.iteration_us for r in dist.ranks)
    assert abs(a - b) / max(a, b) < 0.05


def _kernels(rows):
    f = pd.DataFrame(rows, columns=["name", "cat", "ts", "dur"])
    return f.assign(end=f["ts"] + f["dur"])


def test_gpu_rule_exposes_a_collective_only_where_no_kernel_runs_beside_it():
    # one window 0-100: NCCL 10-50 beside a GEMM 0-30 (overlapped 20, exposed 20), NCCL 80-120 alone (exposed 20
    # inside the window); a memcpy 35-45 hides nothing
    kernels = _kernels([("ncclDevKernel_AllReduce_Sum_f32", "kernel", 10, 40), ("sm90_gemm", "kernel", 0, 30),
                        ("Memcpy DtoD", "gpu_memcpy", 35, 10), ("ncclDevKernel_AllReduce_Sum_f32", "kernel", 80, 40)])
    trace = SimpleNamespace(has_gpu=True, kernels=kernels, ops=pd.DataFrame())
    c = communication_time(trace, [(0.0, 100.0)])
    assert c.rule == GPU_RULE and c.iteration_us == 100
    assert (c.communication_us, c.exposed_us, c.overlapped_us, c.collectives) == (60, 40, 20, 2)
    no_comm = SimpleNamespace(has_gpu=True, kernels=kernels.iloc[1:2], ops=pd.DataFrame())
    assert communication_time(no_comm, [(0.0, 100.0)]) is None


def test_cpu_rule_counts_the_call_and_the_wait_as_exposed_and_the_async_work_beside_ops_as_overlapped():
    # main thread 1: AccumulateGrad 0-40 enclosing c10d::allreduce_ 20-30; idle (DDP's wait) 40-50; copy 50-70.
    # gloo's thread 2: the all-reduce's work 25-60. Communication 20-60 (40); compute 0-20, 30-40, 50-70;
    # exposed: the call 20-30 and the wait 40-50 (20); overlapped: 30-40 and 50-60 (20).
    ops = pd.DataFrame([("autograd::engine::evaluate_function: AccumulateGrad", "cpu_op", 0, 40, 1),
                        ("c10d::allreduce_", "cpu_op", 20, 10, 1), ("gloo:all_reduce", "user_annotation", 25, 35, 2),
                        ("aten::copy_", "cpu_op", 50, 20, 1), ("aten::copy_", "cpu_op", 26, 5, 2)],
                       columns=["name", "cat", "ts", "dur", "tid"])
    trace = SimpleNamespace(has_gpu=False, kernels=pd.DataFrame(), ops=ops)
    c = communication_time(trace, [(0.0, 100.0)])
    assert c.rule == CPU_RULE
    assert (c.communication_us, c.exposed_us, c.overlapped_us, c.collectives) == (40, 20, 20, 1)
    assert c.own_time_us == 80


def _rank_docs(merged):
    _, ranks = merged
    meta = {"backend": "gloo", "world_size": 2}
    return [(k, copy.deepcopy(ranks[0]), {**meta, "rank": k, "local_rank": k}) for k in (0, 1)]


def test_no_straggler_where_the_ranks_agree(merged):
    doc = merge(_rank_docs(merged), {"calls": [2, 3, 4]})
    dist = DistributedSummary.from_json(doc["distributed"])
    assert dist.straggler is None and "straggler" not in doc["distributed"]
    assert f"{STRAGGLER_MARGIN:.0%}" in dist.straggler_rule


def test_the_slowed_rank_is_named_with_its_time_against_the_others(merged):
    docs = _rank_docs(merged)
    c = docs[1][1]["communication_time"]
    c["iteration_us"] *= 1.3  # rank 1 works 30% longer and waits as long as before: the others wait on it
    doc = merge(docs, {"calls": [2, 3, 4]})
    s = DistributedSummary.from_json(doc["distributed"]).straggler
    own0 = docs[0][1]["communication_time"]["iteration_us"] - docs[0][1]["communication_time"]["exposed_us"]
    assert s.rank == 1 and s.own_time_us == pytest.approx(c["iteration_us"] - c["exposed_us"])
    assert s.others_us == {"0": pytest.approx(own0)} and s.others_median_us == pytest.approx(own0)
    assert s.excess > STRAGGLER_MARGIN
    # slowed by less than the margin: none
    docs = _rank_docs(merged)
    docs[1][1]["communication_time"]["iteration_us"] += 0.02 * (own0)
    assert "straggler" not in merge(docs, {})["distributed"]
    # without communication measured, the ranks' op time is compared
    docs = _rank_docs(merged)
    for _, d, _ in docs:
        del d["communication_time"]
    docs[0][1]["totals"]["time_us"] *= 2
    dist = DistributedSummary.from_json(merge(docs, {})["distributed"])
    assert dist.straggler.rank == 0 and "op or kernel time" in dist.straggler_rule


def test_terminal_and_html_show_the_ranks_and_the_straggler(merged, tmp_path):
    doc, _ = merged
    slowed = merge([(k, copy.deepcopy(d), {"backend": "gloo", "world_size": 2}) for k, d in
                    [(0, merged[1][0]), (1, _slowed(merged[1][0]))]], {"calls": [2, 3, 4]})
    con = Console(record=True, width=120, file=io.StringIO(), color_system=None)
    render_terminal(slowed, None, con)
    text = con.export_text()
    assert "rank 1 (straggler)" in text and "exposed" in text and "Straggler: rank 1" in text
    html = render_html(slowed, None)
    assert html.count('id="ranks"') == 1 and 'id="ranks-table"' in html
    assert '<tr class="straggler"><td>rank 1 <span class="badge straggler">straggler</span>' in html
    assert "Exposed" in html and "Straggler: rank 1" in html
    agreeing = merge([(k, copy.deepcopy(merged[1][0]), {"backend": "gloo"}) for k in (0, 1)], {})
    assert "No straggler" in render_html(agreeing, None) and 'class="straggler"' not in render_html(agreeing, None)
    one_process = json.loads((FIXTURES / "analysis_example.json").read_text())
    assert 'id="ranks"' not in render_html(one_process, None)
    if not browser_check.find_chromium():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("chromium is required in CI (.ci/run installs it)")
        return
    res = browser_check.check(write_html(slowed, None, tmp_path / "report.html"))
    assert res["ok"], res["failures"]
    rows = res["probe"]["rank_rows"]
    assert [r["straggler"] for r in rows] == [False, True] and res["probe"]["ranks_table"]["h"] > 0


def _slowed(doc: dict) -> dict:
    d = copy.deepcopy(doc)
    d["communication_time"]["iteration_us"] *= 1.5
    return d


def test_overlap_intervals_are_exact_on_touching_and_nested_spans():
    from advisor.analysis.overlap import _length, _minus, _union
    u = _union(np.array([0.0, 5, 10, 30]), np.array([10.0, 8, 20, 40]))
    assert u[0].tolist() == [0, 30] and u[1].tolist() == [20, 40]
    cut = _minus(u, _union(np.array([2.0, 15]), np.array([3.0, 35])))
    assert cut[0].tolist() == [0, 3, 35] and cut[1].tolist() == [2, 15, 40] and _length(cut) == 19
