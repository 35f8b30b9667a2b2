"""Padded GEMMs: a matmul whose leading dimension cuBLAS finds unaligned (GPT-2's vocabulary of 50257 in
bf16) becomes a `padded_matmul` candidate; its launcher zero-pads K and N, calls the same op and copies the
first N columns out. Here: the alignment rule, the launcher validated at odd sizes for each op (and wrong
ones rejected), tiny GPT-2 / BERT-MLM heads with an odd vocabulary found, patched and run by
`advisor.optimize`, an aligned vocabulary left alone, and the committed H100 GPT-2 trace's LM head."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import advisor
from advisor.analysis.alignment import aligned
from advisor.analysis.api import analyze
from advisor.analysis.cost import DeviceModel, GroupCost, padding_pays
from advisor.collect.in_process import profile_calls
from advisor.codegen import load_module
from advisor.codegen.anchored import generate_anchored
from advisor.codegen.cache import atomic_write
from advisor.codegen.record import record_program
from advisor.patching.capture import launched_sites
from advisor.validate import validate

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
ODD_VOCAB, ALIGNED_VOCAB = 1001, 1008  # 1008: a multiple of 8 (bf16/fp16) and of 4 (fp32)


def test_alignment_rule():
    assert not aligned((8192, 50257), (50257, 1), 0, 2)  # GPT-2's logits in bf16
    assert aligned((8192, 50264), (50264, 1), 0, 2)
    assert aligned((8192, 1001), (1001, 1), 0, 4) is False and aligned((1, 1001), (1001, 1), 0, 4)  # one row
    assert not aligned((64, 64), (64, 1), 3, 4)  # a base off 16 bytes
    assert not aligned((13, 16), (1, 13), 0, 4)  # column-major with M = 13 leading


def _gen(fn, *args):
    gen = generate_anchored(record_program(fn, *args), "padded_matmul", use_cache=False)
    return gen, load_module(gen.path)


def _a(*shape, dtype):
    return torch.randn(*shape, dtype=dtype)


# Each is generated from the recorded program and validated at the recorded, odd and all-ones sizes
# (where K and N are odd whatever they were recorded as: every padding path runs).
CASES = {
    "mm, N unaligned": (lambda a, b: torch.mm(a, b), lambda dt: (_a(12, 16, dtype=dt), _a(16, 37, dtype=dt))),
    "addmm, K unaligned, alpha/beta": (lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
                                       lambda dt: (_a(24, dtype=dt), _a(12, 13, dtype=dt), _a(13, 24, dtype=dt))),
    "mm, A column-major with M unaligned": (lambda a, b: torch.mm(a, b),
                                            lambda dt: (_a(16, 13, dtype=dt).t(), _a(16, 24, dtype=dt))),
    "bmm, N unaligned": (lambda a, b: torch.bmm(a, b), lambda dt: (_a(3, 9, 16, dtype=dt), _a(3, 16, 21, dtype=dt))),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_launcher_validates(case, dtype):
    fn, make = CASES[case]
    gen, mod = _gen(fn, *make(dtype))
    v = validate(gen, mod)
    assert v.validated, v.reason
    assert [s["case"] for s in v.errors["shapes"]] == ["recorded", "odd", "ones"]


@pytest.mark.parametrize("old, new", [
    (".zero_()", ".fill_(1)"),  # padding K with ones: the products pick up the padded columns
    ("result[..., :n]", "result[..., 1:n + 1]"),  # the wrong N columns kept
    ("return (result[..., :n],)", "return (result,)"),  # the padded columns handed out too
], ids=["ones-in-padding", "shifted-columns", "padding-handed-out"])
def test_planted_wrong_launcher_is_rejected(old, new, tmp_path):
    gen, _ = _gen(lambda a, b: torch.mm(a, b), _a(12, 13, dtype=torch.float32), _a(13, 37, dtype=torch.float32))
    assert old in gen.code
    wrong = load_module(atomic_write(tmp_path / "planted.py", gen.code.replace(old, new)))
    assert not validate(gen, wrong, memo=False).validated


def _tiny(name: str, vocab: int):
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    if name == "gpt2":
        cfg = GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=vocab, n_positions=64, bos_token_id=0,
                         eos_token_id=0)
        model, kw = GPT2LMHeadModel(cfg), {"use_cache": False}
    else:
        cfg = BertConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                         vocab_size=vocab, max_position_embeddings=64)
        model, kw = BertForMaskedLM(cfg), {"attention_mask": torch.ones(2, 16, dtype=torch.long)}
        with torch.no_grad():
            model.cls.predictions.bias.normal_()  # zeros at init: a bias padded or read wrong would not show
    cfg._attn_implementation = "sdpa"
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    return model.eval(), {"input_ids": ids, **kw}


def _logits(model, x):
    with torch.inference_mode():
        return model(**x).logits


def _padded(doc: dict) -> list:
    return [c for c in doc["candidates"] if c["kind"] == "padded_matmul"]


@pytest.mark.parametrize("name, head", [("gpt2", "lm_head"), ("bert", "cls.predictions.decoder")],
                         ids=["gpt2", "bert-mlm"])
def test_unaligned_vocab_head_is_padded_by_optimize(name, head, tmp_path):
    model, x = _tiny(name, ODD_VOCAB)
    ref = _logits(model, x)
    report = advisor.optimize(model, x, top=12, out=tmp_path, reuse=False, interpret=True)
    [cand] = _padded(json.loads((tmp_path / "analysis.json").read_text()))
    assert cand["title"].startswith(f"GEMM with unaligned N={ODD_VOCAB} → 1004, padded")
    assert cand["ops"] == ["aten::linear"] and cand["modules"][0].endswith(head)
    [rec] = [r for r in report.patterns if r["candidate"] == cand["id"]]
    assert rec["validated"] and rec["patched"], rec
    # the module holding it is captured even though it occurs once, outside the repeated layers
    assert any(e["pattern_id"] == cand["pattern_id"] and e["module"].endswith(head)
               for e in json.loads((tmp_path / "apply.json").read_text())["manifest"])
    before = report.handle.launches()
    out = _logits(model, x)
    ran = launched_sites(before, report.handle.launches())
    assert ran.get(f"{cand['pattern_id']}:kernel") == 1, ran
    # a view of the padded product, as torch.compile returns it: rows of 1004, the loss code's flattening
    # of batch and sequence still a view
    assert out.shape == ref.shape and out.stride()[-2] == 1004 and not out.is_contiguous()
    torch.testing.assert_close(out.view(-1, ODD_VOCAB), ref.view(-1, ODD_VOCAB), rtol=1e-5, atol=1e-5)


def test_aligned_vocab_has_no_padded_candidate(tmp_path):
    model, x = _tiny("gpt2", ALIGNED_VOCAB)
    doc = analyze(profile_calls(lambda: _logits(model, x), tmp_path, "cpu", calls=2)).doc
    assert not _padded(doc)


def test_h100_gpt2_trace_lm_head_is_the_top_candidate():
    """The committed H100 trace of GPT-2 (bf16, batch 8 x 1024): its LM head ran cuBLAS's align1 kernel for
    8.8 ms; padded, it is predicted at its roofline plus the weight's pad copy, about 1.3 ms (measured on the
    H100: 1.25 ms, docs/EXPERIMENTS.md: padded_matmul)."""
    doc = analyze(ROOT / "sample_traces" / "hf_gpt2").doc
    [cand] = _padded(doc)
    assert cand["rank"] == 1 and cand["title"].startswith("GEMM with unaligned N=50257 → 50264, padded (lm_head)")
    assert 8000 < cand["measured_time_us"] < 9500
    assert 7000 < cand["est_time_saved_us"] < 8000
    assert cand["bytes_saved"] < 0  # padding costs traffic: it saves time


def _cost(measured_us: float) -> tuple[GroupCost, DeviceModel]:
    from advisor.analysis.alignment import PaddedGemm
    from advisor.analysis.cost import padded_us

    pad = PaddedGemm(8192, 50257, 1024, 1, "bfloat16", 8, 50264, 1024, ("out",), 1_852_688_384, 2)
    gpu = DeviceModel("cuda", "H100", 3.0e12, 2.5, 50e12, 700e12, "measured")
    return GroupCost(0, pad.copy_bytes, 1, measured_us, padded_us(pad, gpu), 0, pad), gpu


@pytest.mark.parametrize("measured_us, pays", [(8800.0, True), (1300.0, False)], ids=["align1", "near-roofline"])
def test_gpu_trace_keeps_only_a_gemm_far_above_its_roofline(measured_us, pays):
    cost, gpu = _cost(measured_us)
    assert padding_pays(cost, gpu) is pays


def test_padded_head_trains_through_autograd(tmp_path):
    # the padded GEMM is PyTorch's own ops: under autograd it runs as it is (its backward GEMMs padded too)
    # and the gradients are eager's; GPT-2 ties the head to the embedding, so both paths meet in one grad
    model, x = _tiny("gpt2", ODD_VOCAB)
    ref_model = copy.deepcopy(model)
    report = advisor.optimize(model, x, top=12, out=tmp_path, reuse=False, interpret=True, train=True)
    [cand] = _padded(json.loads((tmp_path / "analysis.json").read_text()))
    before = report.handle.launches()
    model(**x).logits.float().pow(2).mean().backward()
    assert launched_sites(before, report.handle.launches()).get(f"{cand['pattern_id']}:kernel") == 1
    ref_model(**x).logits.float().pow(2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("paths, keeps", [((((32, 1001), (2, 16, 1001)),), True), ((((2, 16016),),), False),
                                          (None, False)], ids=["views-that-accept-it", "a-merging-view", "read-in-graph"])
def test_a_launchers_layout_reaches_the_caller_only_where_the_graph_accepts_it(paths, keeps):
    # the padded head's strided view is handed on where the graph only views it on the way out and every
    # view can be taken of it; otherwise it is copied into the layout the graph was traced with
    from advisor.patching.rewrite import Site

    padded = torch.randn(2, 16, 1004)
    site = Site(key="k", label="c8", launcher=None, fallback=None, inputs=[],
                outputs=[((2, 16, 1001), (16016, 1001, 1), torch.float32)], device_type=None, handed_back=(paths,))
    [out] = site._check((padded[..., :1001],))
    assert (out.stride() == (16064, 1004, 1)) is keeps and out.stride() in {(16064, 1004, 1), (16016, 1001, 1)}
    torch.testing.assert_close(out, padded[..., :1001])
