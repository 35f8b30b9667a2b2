"""Calls at shapes never profiled run fused: a row or pointwise kernel takes its sizes from its tensors, so the
capture matches the pattern with its leading sizes rebound (`patching.resize`) and launches the kernel made at
the profiled ones. Real HF Llama from a tiny config, real Triton kernels in the interpreter, fused launches
counted per call; `generate` with `decode=True` on HF's static cache gives the unpatched model's tokens."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import advisor
from advisor.patching import resize
from advisor.patching.forward import UNPROFILED

transformers = pytest.importorskip("transformers")


def _tiny_llama():
    # batch 3 x 12 tokens, head dim 16, 2 KV heads: no profiled size equals another (a free size must map to one)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    model = _tiny_llama()
    untouched = copy.deepcopy(model)
    ids = torch.randint(0, 256, (3, 12))
    report = advisor.optimize(model, {"input_ids": ids}, interpret=True, reuse=False,
                              out=tmp_path_factory.mktemp("llama"))
    return model, untouched, report


def _launches(handle, call) -> int:
    before = handle.launches()
    call()
    after = handle.launches()
    return sum(n - before.get(k, 0) for k, n in after.items())


def test_other_batch_and_length_run_every_kernel_of_the_profiled_shape(llama):
    model, untouched, report = llama
    profiled = report.runs["fused_launches_per_call"]
    assert profiled >= 6, report.runs
    for shape in [(1, 9), (5, 20)]:
        ids = torch.randint(0, 256, shape)
        with torch.no_grad():
            got = {}
            assert _launches(report.handle, lambda: got.setdefault("y", model(input_ids=ids).logits)) == profiled
            torch.testing.assert_close(got["y"], untouched(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    assert not any(UNPROFILED in why for f in report.handle.fallbacks().values() for why in f)


def test_generate_on_the_static_cache_gives_the_unpatched_tokens(tmp_path):
    model = _tiny_llama()
    untouched = copy.deepcopy(model)
    prompt = torch.randint(0, 256, (3, 12))
    report = advisor.optimize(model, {"input_ids": prompt}, interpret=True, reuse=False, out=tmp_path, decode=True)
    assert model.generation_config.cache_implementation == "static"
    assert "static cache" in report.decode and "static cache" in str(report)
    with torch.no_grad():
        want = untouched.generate(prompt, max_new_tokens=4, do_sample=False)
        launched = _launches(report.handle, lambda: model.generate(prompt, max_new_tokens=4, do_sample=False))
        got = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)
    assert launched >= report.runs["fused_launches_per_call"]  # the prompt's forward, on the static cache, fused
    advisor.unpatch(model)
    assert model.generation_config.cache_implementation is None  # as the user had it


def test_a_model_without_generate_is_told_so(tmp_path):
    model = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32)).eval()
    report = advisor.optimize(model, (torch.randn(4, 8, 32),), interpret=True, reuse=False, out=tmp_path, decode=True)
    assert "has no Hugging Face `generate`" in report.decode


def test_kernels_with_sizes_fixed_inside_are_not_resized():
    group_norm = {"nodes": [{"op": "aten::native_group_norm", "args": [], "outputs": []}], "inputs": []}
    pointwise = {"nodes": [{"op": "aten::add", "args": [], "outputs": []}, {"op": "aten::mean", "args": [], "outputs": []}],
                 "inputs": []}
    assert not resize.resizable(group_norm) and resize.resizable(pointwise)
    assert not resize.resizable({"nodes": [{"op": "aten::mm", "args": [], "outputs": []}], "inputs": []})


def test_rebinding_keeps_dense_layouts_dense_and_maps_views():
    program = {"inputs": [{"id": "in0", "shape": [3, 12, 64], "strides": [768, 64, 1], "storage_offset": 0},
                          {"id": "in1", "shape": [3, 4, 12, 16], "strides": [768, 16, 64, 1], "storage_offset": 0}],
               "nodes": [{"op": "aten::cat", "args": [{"list": [{"ref": "in1", "shape": [3, 4, 12, 8],
                                                                  "strides": [768, 16, 64, 1], "storage_offset": 8}]}],
                          "outputs": [{"id": "v0", "shape": [3, 4, 12, 8], "strides": [384, 96, 8, 1]}]}]}
    free = resize.free_sizes(program)
    assert 64 not in free and 16 not in free and 8 not in free and {3, 12, 768} <= free
    out = resize.rebind(program, {3: 1, 12: 9, 768: 576})
    assert out["inputs"][0]["strides"] == [576, 64, 1]  # dense: follows the new sizes
    assert out["inputs"][1]["strides"] == [576, 16, 64, 1]  # a transposed view: mapped
    assert out["nodes"][0]["args"][0]["list"][0]["shape"] == [1, 4, 9, 8]
    assert out["nodes"][0]["outputs"][0]["strides"] == [288, 72, 8, 1]  # dense, though 384 and 96 were never bound
