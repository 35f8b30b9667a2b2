"""Attention that ran SDPA's math backend is found in a GPU trace, with its cause where the trace shows it
(`advisor.analysis.attention_backends`), and both reports say what to do first (`report.next_step`).

sample_traces/hf_t5_encoder: examples/hf_t5_encoder.py profiled on an H200 (transformers 5.17, whose T5 hands SDPA
its position bias under the padding mask with a strided last dimension); sample_traces/hf_bert: SDPA's fused
kernel (cuDNN) on the same kind of GPU."""
from pathlib import Path

import pytest

from advisor import analyze
from advisor.documents import AnalysisDoc
from advisor.report.next_step import next_steps

SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"


@pytest.fixture(scope="module")
def t5():
    return analyze(SAMPLES / "hf_t5_encoder").doc


def test_the_math_backend_and_its_strided_mask_are_found(t5):
    (entry,) = t5["math_attention"]
    assert entry["op"] == "aten::scaled_dot_product_attention" and entry["cause"] == "layout"
    assert entry["strided_inputs"] == [{"name": "attn_mask", "shape": [32, 12, 512, 512], "last_stride": 12}]
    assert entry["calls"] == 2 and entry["kernels_per_call"] == 18  # two layers a call, GEMMs + softmax + copies
    assert entry["time_us"] > 0.5 * t5["totals"]["time_us"]  # most of the model's GPU time
    assert entry["modules"] == [f"T5EncoderModel.encoder.block.{i}.layer.0.SelfAttention" for i in (0, 1)]
    assert AnalysisDoc.from_json(t5).math_attention == t5["math_attention"]


def test_fused_attention_is_not_reported():
    assert "math_attention" not in analyze(SAMPLES / "hf_bert").doc  # cuDNN's kernel ran
    assert "math_attention" not in analyze(SAMPLES / "cpu" / "hf_bert").doc  # a CPU trace: no kernels to read


def test_the_first_step_says_what_to_do(t5):
    first = next_steps(t5)[0]
    assert "math backend" in first.text and "attn_mask (32, 12, 512, 512) has a last dimension of stride 12" in first.text
    assert first.code.startswith("attn_mask = attn_mask.contiguous()")


def test_a_cause_the_trace_does_not_show_gets_sdpas_own_reasons():
    doc = {"totals": {"time_us": 1000.0}, "candidates": [],
           "math_attention": [{"op": "aten::scaled_dot_product_attention", "cause": "unknown", "strided_inputs": [],
                               "calls": 4, "time_us": 400.0, "kernels_per_call": 12, "modules": ["m"]}]}
    (step,) = next_steps(doc)  # no candidate: the step alone
    assert "(40%)" in step.text and "does not show why" in step.text
    assert "SDPBackend.EFFICIENT_ATTENTION" in step.code
