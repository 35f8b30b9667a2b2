"""The committed sample traces (H100 and CPU): loadable, joined, and the analyzer finds the patterns
each workload is known to have. These are what CI tests the GPU path against, since CI has no GPU."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from advisor.analysis.api import analyze
from advisor.graph.dataflow import build_graph, steady_windows
from advisor.trace.load import load_trace
from candidates import (RESIDUAL_LAYERNORM, RMS_OPS, ROTARY, SWIGLU, TANH_GELU, find_candidate, find_candidates,
                        op_names, pattern_labels)  # (pytest puts tests/ on sys.path)

SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"
WORKLOADS = ["seed", "mlp_block", "hf_llama", "hf_gpt2", "hf_bert", "timm_vit", "tv_resnet50", "hf_gpt2_eager",
             "hf_bert_eager", "splade"]
TRACES = [(f"{d}/{w}", SAMPLES / d / w) for d in ("", "cpu") for w in WORKLOADS]
TRACES = [(name.lstrip("/"), path) for name, path in TRACES]


@pytest.fixture(scope="module", params=TRACES, ids=[n for n, _ in TRACES])
def sample(request):
    name, path = request.param
    return name, path, load_trace(path)


def test_trace_files_and_meta(sample):
    name, path, trace = sample
    for f in ("kineto.json.gz", "et.json.gz", "meta.json"):
        assert (path / "trace" / f).exists(), f
        assert (path / "trace" / f).stat().st_size < 5 * 1024 * 1024
    meta = trace.meta
    assert meta["complete"] is True
    assert meta["bandwidth_Bps"] > 0 and meta["launch_us"] > 0
    assert meta["steady_state"]["source"] == "module" and len(meta["steady_state"]["iterations"]) >= 1
    gpu = not name.startswith("cpu/")
    assert meta["device"]["type"] == ("cuda" if gpu else "cpu")
    if gpu:
        assert "H100" in meta["device"]["name"]


def test_kernels_ops_et_and_modules_are_joined(sample):
    name, _, trace = sample
    gpu = not name.startswith("cpu/")
    aten = trace.ops[trace.ops["name"].astype(str).str.startswith("aten::")]
    assert len(aten) > 0 and len(trace.et_nodes) > 0
    # Every aten cpu op recorded while the ET observer ran joins an ET node by record-function id.
    joined = aten["rf_id"].isin(set(trace.et_nodes["rf_id"]))
    assert joined.mean() > 0.95, joined.mean()
    graph = build_graph(trace)
    assert graph.confidence == "high"
    assert any(n.module for n in graph.nodes), "module paths missing"
    if gpu:
        assert len(trace.kernels) > 0
        # Every kernel launched inside a steady-state window reaches a graph node through
        # correlation -> launching runtime call -> cpu op -> ET node.
        ts = trace.runtime["ts"].to_numpy()
        inside = np.zeros(len(ts), dtype=bool)
        for a, b in steady_windows(trace):
            inside |= (ts >= a) & (ts <= b)
        launched = trace.kernels["correlation"].isin(set(trace.runtime["correlation"][inside]))
        charged = sum(len(n.kernels) for n in graph.nodes)
        assert launched.sum() > 0 and charged == launched.sum(), (charged, launched.sum())
        assert all(n.kernels for n in graph.nodes if n.cls.value in ("pointwise", "matmul"))


@pytest.fixture(scope="module")
def analyses():
    return {name: analyze(path) for name, path in TRACES}


@pytest.mark.parametrize("device", ["", "cpu/"])
def test_llama_patterns(analyses, device):
    doc = analyses[f"{device}hf_llama"].doc
    cands = doc["candidates"]
    norm_chain = ["to_fp32", "pow", "mean", "add", "rsqrt", "mul", "to_bf16", "mul"] if not device else \
        ["pow", "mean", "add", "rsqrt", "mul", "mul"]  # fp32 on the CPU: no casts
    rms_norms = find_candidates(cands, kind="norm", has=RMS_OPS)
    rms = find_candidate(rms_norms, first="add")  # the residual add and the RMSNorm it feeds
    assert pattern_labels(rms) == ["add"] + norm_chain
    assert rms["occurrences"] == 4  # post-attention norms, layer-1 input norm, final norm
    (first_norm,) = [c for c in rms_norms if c is not rms]
    assert pattern_labels(first_norm) == norm_chain
    if not device:
        assert first_norm["kernels_saved"] == 7  # eight kernels into one
    swiglu = find_candidate(cands, SWIGLU)
    assert op_names(swiglu) == ["silu", "mul"] and swiglu["occurrences"] == 2
    rotary = find_candidate(cands, ROTARY)
    assert op_names(rotary) == ["mul", "neg", "cat", "mul", "add"] and rotary["occurrences"] == 4
    assert any(c["kind"] == "epilogue" and c["extends"] == swiglu["id"] for c in doc["candidates"])


@pytest.mark.parametrize("device", ["", "cpu/"])
@pytest.mark.parametrize("workload, anchor", [("hf_gpt2", "addmm"), ("hf_bert", "linear"), ("timm_vit", "linear")])
def test_bias_gelu_epilogues(analyses, device, workload, anchor):
    doc = analyses[f"{device}{workload}"].doc
    gelu = "tanh" if workload == "hf_gpt2" else "gelu"  # GPT-2 spells its GELU out in pointwise ops
    epi = find_candidate(doc["candidates"], kind="epilogue", has=[anchor, gelu])
    assert op_names(epi)[0] == anchor and epi["occurrences"] == 2  # one per layer
    assert find_candidates(doc["candidates"], RESIDUAL_LAYERNORM)


def test_gpt2_tanh_gelu_chain(analyses):
    gelu = find_candidate(analyses["hf_gpt2"].doc["candidates"], TANH_GELU)
    assert op_names(gelu) == ["mul", "pow", "mul", "add", "mul", "tanh", "add", "mul"]
    assert gelu["kernels_saved"] == 14  # 8 kernels into 1, in 2 layers


@pytest.mark.parametrize("device", ["", "cpu/"])
def test_resnet_batchnorm_relu(analyses, device):
    doc = analyses[f"{device}tv_resnet50"].doc
    bn_relu = find_candidate(doc["candidates"], kind="norm", ops=["batch_norm", "relu_"])
    assert bn_relu["occurrences"] == 33
    residual = find_candidates(doc["candidates"], kind="norm", has=["batch_norm", "add", "relu"])
    assert sum(c["occurrences"] for c in residual) == 16  # one per bottleneck block
    assert any(c["kind"] == "epilogue" and c["ops"][0] == "aten::conv2d" for c in doc["candidates"])


def test_seed_on_h100(analyses):
    (c,) = analyses["seed"].doc["candidates"]
    n = 1 << 24
    assert (c["bytes_unfused"], c["bytes_fused"], c["bytes_saved"], c["kernels_saved"]) == (28 * n, 12 * n, 16 * n, 2)
    assert c["measured_time_us"] > 0 and 0 < c["est_time_saved_us"] < c["measured_time_us"]


def test_no_unknown_ops_on_samples(analyses):
    for name, a in analyses.items():
        assert not a.doc["unknown_ops"], (name, a.doc["unknown_ops"])


def test_analysis_json_roundtrip(analyses, tmp_path):
    a = analyses["hf_llama"]
    doc = json.loads(a.to_json(tmp_path / "analysis.json").read_text())
    assert doc["candidates"][0]["rank"] == 1
    assert doc["totals"]["time_kind"] == "gpu" and doc["device"]["bandwidth_source"] == "measured"
    # Ranked by estimated time, the negligible candidates after all the others (issue 20 item 7).
    for flag in (False, True):
        ranked = [c["est_time_saved_us"] for c in doc["candidates"] if c["negligible"] is flag]
        assert ranked == sorted(ranked, reverse=True)
    assert [c["negligible"] for c in doc["candidates"]] == sorted(c["negligible"] for c in doc["candidates"])


EAGER = [("cpu/hf_gpt2_eager", SAMPLES / "cpu" / "hf_gpt2_eager", ["matmul", "mul", "add", "softmax", "matmul"]),
         ("cpu/hf_bert_eager", SAMPLES / "cpu" / "hf_bert_eager", ["matmul", "mul", "softmax", "matmul"])]
EAGER += [(n.replace("cpu/", ""), SAMPLES / n.replace("cpu/", ""), ops) for n, _, ops in EAGER
          if (SAMPLES / n.replace("cpu/", "")).exists()]


@pytest.mark.parametrize("name, path, ops", EAGER, ids=[n for n, _, _ in EAGER])
def test_eager_attention_is_found(name, path, ops):
    doc = analyze(path).doc
    (att,) = [c for c in doc["candidates"] if c["kind"] == "attention"]
    assert op_names(att) == ops and att["occurrences"] == 2  # one per layer
    # The B x H x L x L scores and probabilities are never written by the fused kernel.
    assert att["intermediate_bytes"] > 0 and att["bytes_fused"] < att["bytes_unfused"]


SPLADE = [p for p in (SAMPLES / "splade", SAMPLES / "cpu" / "splade") if p.exists()]


@pytest.mark.parametrize("path", SPLADE, ids=[str(p.relative_to(SAMPLES)) for p in SPLADE])
def test_splade_matmul_reduction_is_found(path):
    doc = analyze(path).doc
    (mr,) = [c for c in doc["candidates"] if c["kind"] == "matmul_reduction"]
    assert op_names(mr) == ["linear", "relu", "log1p", "mul", "amax"]
    out = mr["graph"]["outputs"]
    assert len(out) == 1 and len(out[0]["shape"]) == 2  # only the B x V result is written
    # The logits (B x L x V) and the pointwise intermediates are never materialised.
    logits = [e for e in mr["graph"]["edges"] if e["src"] == "n0"]
    assert logits and mr["intermediate_bytes"] >= logits[0]["bytes"]


# ------------------------------------------------------------------------------- issue 20 item 7
@pytest.mark.parametrize("device", ["", "cpu/"])
def test_swiglu_epilogues_name_their_projection(analyses, device):
    """Llama's gate and up SwiGLU epilogues are two patterns: each title names the Linear that anchors it."""
    doc = analyses[f"{device}hf_llama"].doc
    (swiglu,) = [c for c in doc["candidates"] if c["kind"] == "pointwise" and op_names(c) == ["silu", "mul"]]
    epis = [c for c in doc["candidates"] if c["kind"] == "epilogue" and c["extends"] == swiglu["id"]]
    heads = sorted(c["title"].split(":")[0] for c in epis)
    assert heads == ["linear epilogue (SwiGLU, gate_proj)", "linear epilogue (SwiGLU, up_proj)"], heads
    for c in epis:  # the name agrees with where its occurrences are
        proj = c["title"].split(", ")[1].split(")")[0]
        assert all(m.endswith(f".mlp.{proj}") for m in c["modules"] if "_proj" in m), c["modules"]
    titles = [c["title"] for c in doc["candidates"]]
    assert len(titles) == len(set(titles)), titles  # no two candidates read alike


def _terminal(doc, width=140, top=10) -> str:
    import io

    from rich.console import Console

    from advisor.report.terminal import render_terminal

    con = Console(record=True, width=width, file=io.StringIO(), color_system=None)
    render_terminal(doc, None, con, top=top)
    return con.export_text()


def test_could_save_counts_alternatives_once(analyses):
    """Llama's SwiGLU has two epilogues (gate, up) and rotary one (q/k): each epilogue and the group it extends are
    alternatives. Counted once each: the groups, plus the best epilogue of each on top (its estimate is on top of
    its group's); the old sum added the gate and the up epilogue both."""
    from advisor.report import model as M

    doc = analyses["hf_llama"].doc
    cands = doc["candidates"]
    epis = [c for c in cands if c["kind"] == "epilogue"]
    assert {c["extends"] for c in epis} == {c["id"] for c in cands if op_names(c) in (["silu", "mul"],
                                                                                  ["mul", "neg", "cat", "mul", "add"])}
    best_on_top = {}
    for c in epis:
        best_on_top[c["extends"]] = max(best_on_top.get(c["extends"], 0.0), c["est_time_saved_us"])
    want = sum(c["est_time_saved_us"] for c in cands if c["kind"] != "epilogue") + sum(best_on_top.values())
    total = doc["totals"]["est_time_saved_us"]
    assert total == pytest.approx(want, rel=1e-9)
    assert total < sum(c["est_time_saved_us"] for c in cands) - min(c["est_time_saved_us"] for c in epis) + 1e-6
    # The reports state that figure; an analysis.json without it gets the same from the candidates alone.
    assert M.potential_saving(doc) == total
    old = dict(doc, totals={k: v for k, v in doc["totals"].items() if k != "est_time_saved_us"})
    assert M.potential_saving(old) == pytest.approx(total, rel=1e-9)
    row = next(line for line in _terminal(doc).splitlines() if "Fusion could save" in line)
    assert "567 µs" in row and "alternatives counted once" in row, row


@pytest.mark.parametrize("device", ["", "cpu/"])
def test_negligible_candidates_are_kept_out_of_the_list(analyses, device):
    """Llama's mask and position arithmetic (`eq → all` on 4 or 8 bytes, `sub → ne`, ...) is in analysis.json,
    ranked last and flagged, but not in the top list, and the report says so."""
    doc = analyses[f"{device}hf_llama"].doc
    cands = doc["candidates"]
    small = [c for c in cands if c["negligible"]]
    (eq_all,) = [c for c in cands if op_names(c) == ["eq", "all"]]
    assert eq_all["bytes_saved"] <= 8 and eq_all in small
    assert cands[-len(small):] == small and not any(c["negligible"] for c in cands[:-len(small)])
    best = max(c["est_time_saved_us"] for c in cands)
    most = max(c["bytes_saved"] for c in cands)
    for c in small:
        assert c["est_time_saved_us"] < 0.01 * best or (c["est_time_saved_us"] < 0.1 * best and (
            c["bytes_saved"] < 0.001 * most or c["bytes_saved"] < 1024 * c["occurrences"]))
    listed = [c for c in cands if not c["negligible"]]
    # (Its GEMM epilogues are estimated to save nothing on the H100 trace, the Triton GEMM being slower than
    # cuBLAS's: listed after the others too.)
    assert listed[0]["est_time_saved_us"] == best and len(listed) >= 5
    # Not negligible: anything saving real traffic, however small next to the best (GPT-2's final LayerNorm).
    gpt2 = analyses[f"{device}hf_gpt2"].doc["candidates"]
    assert not any(c["negligible"] for c in gpt2 if c["bytes_saved"] >= 0.005 * max(x["bytes_saved"] for x in gpt2)
                   and c["est_time_saved_us"] >= 0.01 * max(x["est_time_saved_us"] for x in gpt2))
    out = _terminal(doc, top=len(cands))
    table = out.split("Top fusion candidates")[1].split("not listed")[0]
    assert f"({len(listed)} of {len(listed)})" in table
    for c in small:
        assert f" {c['id']} " not in table
    assert f"{len(small)} more candidates not listed: " in out and "negligible" in out


def test_cpu_trace_promises_no_share_of_cpu_time(analyses):
    """On a CPU trace the fused kernels run in Triton's interpreter: the estimate is what a GPU would save by
    the bytes model (bytes at its bandwidth + launches), and no percentage of the CPU time is claimed."""
    from advisor.report.html import render_html

    doc = analyses["cpu/hf_llama"].doc
    est = doc["estimate"]
    assert est["basis"] == "gpu_bytes_model" and est["device"] == "cuda"
    for c in doc["candidates"]:
        assert c["share_of_iteration"] is None
        by_bytes = c["bytes_saved"] / est["bandwidth_Bps"] * 1e6 + c["kernels_saved"] * est["launch_us"]
        if c["kind"] == "epilogue":  # less what the Triton GEMM costs against cuBLAS on that GPU
            assert 0 < c["est_time_saved_us"] < by_bytes
        else:
            assert c["est_time_saved_us"] == pytest.approx(by_bytes, rel=1e-6)
        assert c["est_cpu_time_saved_us"] > 0  # the CPU-time figure stays in analysis.json
    out = _terminal(doc)
    row = out[out.index("Fusion could save"):out.index("Time by op class")]
    assert "on a GPU by the bytes model" in row and "%" not in row, row
    assert "GPU est." in out
    html = render_html(doc)
    assert "a GPU could save per iteration, by the bytes model" in html and "fusion could save per iteration (" not in html
    gpu = analyses["hf_llama"].doc
    assert gpu["estimate"]["basis"] == "measured" and gpu["candidates"][0]["share_of_iteration"] > 0


@pytest.mark.parametrize("device", ["", "cpu/"])
def test_time_per_iteration_shows_median_and_spread(analyses, device):
    doc = analyses[f"{device}hf_llama"].doc
    sp = doc["totals"]["time_us_per_iteration"]
    assert sp["iterations"] == doc["steady_state"]["iterations"] == 2
    assert sp["min"] <= sp["median"] <= sp["max"] and sp["min"] > 0
    assert sp["median"] == pytest.approx(doc["totals"]["time_us"])  # two iterations: the median is the mean
    row = next(line for line in _terminal(doc).splitlines() if "Per iteration" in line)
    assert "median" in row and "range" in row and "2 iterations" in row, row


def test_candidate_ids_do_not_depend_on_timings(tmp_path):
    """The same trace with another bandwidth and launch cost (as a second profile of the same script gets):
    the estimates and the ranking move, the ids stay with their patterns."""
    import shutil

    src = SAMPLES / "hf_llama"
    shutil.copytree(src, tmp_path / "run")
    meta_path = tmp_path / "run" / "trace" / "meta.json"
    meta = json.loads(meta_path.read_text())
    before = analyze(src).doc["candidates"]
    meta["bandwidth_Bps"], meta["launch_us"] = meta["bandwidth_Bps"] / 40, meta["launch_us"] * 40
    meta_path.write_text(json.dumps(meta))
    after = analyze(tmp_path / "run").doc["candidates"]
    rank = lambda cs: [c["pattern_id"] for c in cs]  # noqa: E731
    assert rank(before) != rank(after)  # the new device model reorders them...
    assert {c["pattern_id"]: c["id"] for c in before} == {c["pattern_id"]: c["id"] for c in after}  # ...not the ids
    assert sorted(int(c["id"][1:]) for c in after) == list(range(1, len(after) + 1))


def test_an_input_just_written_is_read_from_l2():
    """GPT-2's residual add + LayerNorm on the H100: of its outside reads, the attention projection's output (16 MiB,
    written by the kernel just before) is still in the 50 MB L2 and is not HBM traffic in the fused kernel's
    prediction; the residual stream (written a whole attention block earlier) and the LayerNorm weights (never
    written) are. An L2 of unknown size gives the all-HBM roofline; one whose share is half the value keeps the half
    written last (least recently used goes first)."""
    from dataclasses import replace

    from advisor.analysis.cost import TrafficSince, external_io, group_cost, l2_resident_bytes

    a = analyze(SAMPLES / "hf_gpt2" / "trace")
    assert a.device.l2_bytes == 52428800
    cand = find_candidates(a.doc["candidates"], RESIDUAL_LAYERNORM)[0]  # the one inside the blocks, not the embedding's
    group = a.groups[cand["id"]][0]
    g = a.graph
    reads, _ = external_io(g, group.members)
    first = min(group.members)
    just_written = [v for v in reads if g.values[v].producer == first - 1]
    assert len(just_written) == 1 and reads[just_written[0]] == 16 << 20
    assert l2_resident_bytes(g, group.members, reads, a.device, TrafficSince(g)) == 16 << 20
    with_l2 = group_cost(g, group, a.device)
    hbm_us = (16 << 20) / a.device.bandwidth_Bps * 1e6
    for l2, resident in ((0, 0), (16 << 20, 8 << 20)):
        device = replace(a.device, l2_bytes=l2)
        assert l2_resident_bytes(g, group.members, reads, device, TrafficSince(g)) == resident
        without = group_cost(g, group, device)
        assert without.bytes_fused == with_l2.bytes_fused  # the bytes the kernel moves do not change, only where from
        assert without.predicted_fused_us - with_l2.predicted_fused_us == pytest.approx(
            hbm_us * (1 - resident / (16 << 20)), rel=1e-6)


def test_l2_residency_is_judged_where_the_fused_kernel_runs():
    """Llama's SwiGLU, silu(gate) * up: the up projection runs between silu and mul, so the fused kernel (in mul's
    place) reads `up` straight from L2 and `gate` across the up projection's traffic (x, W_up, up: 52 MiB), silu's
    own traffic no longer there. With the H100's L2 share (25 MiB) only `up` (22 MiB) is still in it; with an L2
    twice the traffic both are; with one whose share holds the traffic and half of `gate`, `up` and the half of
    `gate` written last."""
    from dataclasses import replace

    from advisor.analysis.cost import TrafficSince, external_io, l2_resident_bytes

    a = analyze(SAMPLES / "hf_llama" / "trace")
    g = a.graph
    group = a.groups[find_candidate(a.doc["candidates"], SWIGLU)["id"]][0]
    reads, _ = external_io(g, group.members)
    silu, mul = sorted(group.members)
    up = next(v for v in reads if silu < g.values[v].producer < mul)
    gate = next(v for v in reads if g.values[v].producer < silu)
    tensor = reads[up]
    assert reads[gate] == tensor == 4096 * 2816 * 2
    between = TrafficSince(g).between(g.values[gate].producer, mul) - g.nodes[silu].bytes
    assert between == g.nodes[g.values[up].producer].bytes > 25 << 20  # the up projection, silu not counted
    assert l2_resident_bytes(g, group.members, reads, a.device, TrafficSince(g)) == tensor
    big = replace(a.device, l2_bytes=4 * between)
    assert l2_resident_bytes(g, group.members, reads, big, TrafficSince(g)) == 2 * tensor
    half_over = replace(a.device, l2_bytes=2 * between + tensor)  # its share: the traffic and half of `gate`
    assert l2_resident_bytes(g, group.members, reads, half_over, TrafficSince(g)) == tensor + tensor / 2


def test_the_estimate_for_sites_left_by_a_pattern_that_took_the_others():
    """ResNet-50 on the H100: the conv epilogue over conv -> BatchNorm -> ReLU occurs 17 times; the window chain
    (BatchNorm + ReLU + max-pool) holds the stem's, the widest. Patched beside it, the window chain takes that
    one: the epilogue's 16 sites save its estimate less the stem's own, not 16/17 of it (measured 677 µs where
    16/17 said 968: reports/suite/shared-sites-estimate)."""
    from advisor.records import PatternResult
    from advisor.workflows.selection import estimate_for_sites

    a = analyze(SAMPLES / "tv_resnet50" / "trace")
    by_title = {c["title"].split(":")[0]: c for c in a.doc["candidates"]}
    epilogue = by_title["conv2d epilogue (BatchNorm + ReLU, conv1/conv2)"]
    window = by_title["BatchNorm + ReLU + max-pool"]
    norm = by_title["BatchNorm + ReLU"]
    stem = epilogue["shared"][window["id"]]
    assert epilogue["occurrences"] == 17 and stem["occurrences"] == 1
    assert 0 < stem["est_time_saved_us"] < epilogue["est_time_saved_us"]
    assert epilogue["shared"][norm["id"]]["occurrences"] == 17  # every one of its BatchNorm + ReLU is the base's
    r = PatternResult(candidate=epilogue["id"], est_time_saved_us=epilogue["est_time_saved_us"], occurrences=17,
                      shared=epilogue["shared"])
    est = epilogue["est_time_saved_us"]
    assert estimate_for_sites(r, 16, frozenset({window["id"]})) == pytest.approx(est - stem["est_time_saved_us"], abs=0.01)
    # the window chain not patched, or the counts not adding up (the base patched too): the sites' share
    assert estimate_for_sites(r, 16, frozenset()) == pytest.approx(est * 16 / 17, abs=0.01)
    assert estimate_for_sites(r, 16, frozenset({window["id"], norm["id"]})) == pytest.approx(est * 16 / 17, abs=0.01)
    assert estimate_for_sites(r, 17, frozenset({window["id"]})) == pytest.approx(est, abs=0.01)


def test_a_row_kernel_of_many_short_rows_is_bound_by_its_programs():
    """A row kernel's programs take time however few bytes they move: on the H100 a softmax over 301056 rows of
    49, 16 rows to a program, took 41 µs where its bytes take 20 (one row a program: 186 µs). The prediction of
    a row group is the larger of its bytes and its programs; GPT-2's 1024-wide add + LayerNorm rows, one a
    program, stay bound by their bytes."""
    from dataclasses import replace

    from advisor.analysis.cost import PACKED_PROGRAM_S, ROW_PROGRAM_S, group_cost

    a = analyze(SAMPLES / "hf_gpt2" / "trace")
    group = a.groups[find_candidates(a.doc["candidates"], RESIDUAL_LAYERNORM)[0]["id"]][0]
    rows, width = group.rows
    assert width == 1024
    wide = group_cost(a.graph, group, a.device)
    assert wide.predicted_fused_us > rows * ROW_PROGRAM_S * 1e6 + a.device.launch_us  # bytes-bound
    short = group_cost(a.graph, replace(group, rows=(301056, 64)), a.device)  # bf16 rows of 128 bytes: aligned
    assert short.predicted_fused_us == pytest.approx(301056 / 16 * PACKED_PROGRAM_S * 1e6 + a.device.launch_us)
    assert short.bytes_fused == wide.bytes_fused  # the bytes do not change, only what bounds the kernel


def test_short_unaligned_rows_cost_by_the_tensors_each_row_moves(tmp_path):
    """Swin's shifted-window softmax (scores + per-head bias + per-window mask, rows of 49: 98 bytes in bf16, 196
    in fp32, no multiple of 16) loads and stores one element at a time: on the H100 a packed program of it took
    3.4 ns where a plain softmax over the same rows took 2.2 (docs/EXPERIMENTS.md: row_index_math). Its four row streams
    (scores, bias and mask in, probabilities out) predict that; rows of 64 stay at the aligned packed cost."""
    from dataclasses import replace

    from advisor.analysis.cost import (PACKED_PROGRAM_S, UNALIGNED_PROGRAM_S, UNALIGNED_STREAM_S, external_io,
                                       gpu_model, group_cost, row_streams)
    from advisor.collect.in_process import profile_calls
    from candidates import SOFTMAX_MASK

    torch = pytest.importorskip("torch")
    windows, heads, n = 4, 3, 49
    scores, bias, mask = torch.randn(8 * windows, heads, n, n), torch.randn(heads, n, n), torch.randn(windows, n, n)

    def window_softmax():
        s = (scores + bias.unsqueeze(0)).view(-1, windows, heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
        return torch.softmax(s.view(-1, heads, n, n), -1)

    a = analyze(profile_calls(window_softmax, tmp_path, "cpu", calls=2))
    gpu = gpu_model()  # the CPU trace's candidates, costed as on a GPU (its bytes are a few MB: programs bound)
    group = a.groups[find_candidate(a.doc["candidates"], SOFTMAX_MASK)["id"]][0]
    rows, width = group.rows
    assert (rows, width) == (8 * windows * heads * n, n)
    reads, escapes = external_io(a.graph, group.members)
    assert row_streams(a.graph, reads, escapes, width) == 4
    program = UNALIGNED_PROGRAM_S + 4 * UNALIGNED_STREAM_S
    assert program == pytest.approx(3.46e-9)
    cost = group_cost(a.graph, replace(group, rows=(301056, n)), gpu)  # Swin-T's first stage at batch 32
    assert cost.predicted_fused_us == pytest.approx(301056 / 16 * program * 1e6 + gpu.launch_us)
    aligned = group_cost(a.graph, replace(group, rows=(301056, 64)), gpu)
    assert aligned.predicted_fused_us == pytest.approx(301056 / 16 * PACKED_PROGRAM_S * 1e6 + gpu.launch_us)


def test_a_tiny_kernel_saves_a_launch_at_least():
    """Llama's mask arithmetic (`sub → ne`: two kernels of about 1.5 µs) holds the GPU's timeline for a launch each
    (meta's `launch_us`, measured as a tiny kernel's cost in a CUDA graph of them): fusing it saves that, not the
    kernels' durations alone (T5's and RoBERTa's position chains measured 1.7-2.5x their duration-based estimate)."""
    from advisor.analysis import cost

    a = analyze(SAMPLES / "hf_llama" / "trace")
    (mask,) = [c for c in a.doc["candidates"] if op_names(c) == ["sub", "ne"]]
    nodes = [a.graph.nodes[m] for m in a.groups[mask["id"]][0].members]
    assert all(s[2] < a.device.launch_us for n in nodes for s in n.kernel_spans)
    c = cost.group_cost(a.graph, a.groups[mask["id"]][0], a.device)
    assert c.timeline_us == pytest.approx(len(nodes) * a.device.launch_us) and c.timeline_us > c.measured_us
    assert mask["est_time_saved_us"] == pytest.approx(c.timeline_us - c.predicted_fused_us)
