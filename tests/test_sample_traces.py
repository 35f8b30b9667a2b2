"""The committed sample traces (H100 and CPU): loadable, joined, and the analyzer finds the patterns
each workload is known to have. These are what CI tests the GPU path against, since CI has no GPU."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from advisor.analyze.api import analyze
from advisor.graph.dataflow import build_graph, steady_windows
from advisor.trace.load import load_trace

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


def _find(doc, title_prefix: str) -> list[dict]:
    return [c for c in doc["candidates"] if c["title"].startswith(title_prefix)]


def _ops(c) -> list[str]:
    return [o.split("::")[1] for o in c["ops"]]


@pytest.mark.parametrize("device", ["", "cpu/"])
def test_llama_patterns(analyses, device):
    doc = analyses[f"{device}hf_llama"].doc
    (rms,) = _find(doc, "Residual add + RMSNorm")
    norm_chain = ["to_fp32", "pow", "mean", "add", "rsqrt", "mul", "to_bf16", "mul"] if not device else \
        ["pow", "mean", "add", "rsqrt", "mul", "mul"]  # fp32 on the CPU: no casts
    assert rms["title"].split(": ")[1].split(" → ") == ["add"] + norm_chain
    assert rms["occurrences"] == 4  # post-attention norms, layer-1 input norm, final norm
    (first_norm,) = _find(doc, "RMSNorm")
    assert first_norm["title"].split(": ")[1].split(" → ") == norm_chain
    if not device:
        assert len(first_norm["ops"]) == 8 and first_norm["kernels_saved"] == 7  # eight kernels into one
    (swiglu,) = _find(doc, "SwiGLU")
    assert _ops(swiglu) == ["silu", "mul"] and swiglu["occurrences"] == 2
    (rotary,) = _find(doc, "Rotary embedding")
    assert _ops(rotary) == ["mul", "neg", "cat", "mul", "add"] and rotary["occurrences"] == 4
    assert any(c["kind"] == "epilogue" and c["extends"] == swiglu["id"] for c in doc["candidates"])


@pytest.mark.parametrize("device", ["", "cpu/"])
@pytest.mark.parametrize("workload, anchor", [("hf_gpt2", "addmm"), ("hf_bert", "linear"), ("timm_vit", "linear")])
def test_bias_gelu_epilogues(analyses, device, workload, anchor):
    doc = analyses[f"{device}{workload}"].doc
    epis = [c for c in doc["candidates"] if c["kind"] == "epilogue" and "GELU" in c["title"]]
    assert epis, [c["title"] for c in doc["candidates"]]
    assert epis[0]["ops"][0] == f"aten::{anchor}" and epis[0]["occurrences"] == 2  # one per layer
    assert _find(doc, "Residual add + LayerNorm")


def test_gpt2_tanh_gelu_chain(analyses):
    (gelu,) = _find(analyses["hf_gpt2"].doc, "GELU")
    assert _ops(gelu) == ["mul", "pow", "mul", "add", "mul", "tanh", "add", "mul"]
    assert gelu["kernels_saved"] == 14  # 8 kernels into 1, in 2 layers


@pytest.mark.parametrize("device", ["", "cpu/"])
def test_resnet_batchnorm_relu(analyses, device):
    doc = analyses[f"{device}tv_resnet50"].doc
    (bn_relu,) = _find(doc, "BatchNorm + ReLU")
    assert bn_relu["occurrences"] == 33
    residual = _find(doc, "BatchNorm + residual add + ReLU")
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
    ranked = [c["est_time_saved_us"] for c in doc["candidates"]]
    assert ranked == sorted(ranked, reverse=True)


EAGER = [("cpu/hf_gpt2_eager", SAMPLES / "cpu" / "hf_gpt2_eager", ["matmul", "mul", "add", "softmax", "matmul"]),
         ("cpu/hf_bert_eager", SAMPLES / "cpu" / "hf_bert_eager", ["matmul", "mul", "softmax", "matmul"])]
EAGER += [(n.replace("cpu/", ""), SAMPLES / n.replace("cpu/", ""), ops) for n, _, ops in EAGER
          if (SAMPLES / n.replace("cpu/", "")).exists()]


@pytest.mark.parametrize("name, path, ops", EAGER, ids=[n for n, _, _ in EAGER])
def test_eager_attention_is_found(name, path, ops):
    doc = analyze(path).doc
    (att,) = [c for c in doc["candidates"] if c["kind"] == "attention"]
    assert _ops(att) == ops and att["occurrences"] == 2  # one per layer
    # The B x H x L x L scores and probabilities are never written by the fused kernel.
    assert att["intermediate_bytes"] > 0 and att["bytes_fused"] < att["bytes_unfused"]


SPLADE = [p for p in (SAMPLES / "splade", SAMPLES / "cpu" / "splade") if p.exists()]


@pytest.mark.parametrize("path", SPLADE, ids=[str(p.relative_to(SAMPLES)) for p in SPLADE])
def test_splade_matmul_reduction_is_found(path):
    doc = analyze(path).doc
    (mr,) = [c for c in doc["candidates"] if c["kind"] == "matmul_reduction"]
    assert _ops(mr) == ["linear", "relu", "log1p", "mul", "amax"]
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
    (swiglu,) = [c for c in doc["candidates"] if c["kind"] == "pointwise" and _ops(c) == ["silu", "mul"]]
    epis = [c for c in doc["candidates"] if c["kind"] == "epilogue" and c["extends"] == swiglu["id"]]
    heads = sorted(c["title"].split(":")[0] for c in epis)
    assert heads == ["linear epilogue (SwiGLU, gate_proj)", "linear epilogue (SwiGLU, up_proj)"], heads
    for c in epis:  # the name agrees with where its occurrences are
        proj = c["title"].split(", ")[1].split(")")[0]
        assert all(m.endswith(f".mlp.{proj}") for m in c["modules"] if "_proj" in m), c["modules"]
    titles = [c["title"] for c in doc["candidates"]]
    assert len(titles) == len(set(titles)), titles  # no two candidates read alike
