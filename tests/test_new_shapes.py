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


@pytest.mark.filterwarnings("error:fusion-advisor.*launcher failed:RuntimeWarning")
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


def test_a_size_recorded_in_two_roles_takes_each_role_s_new_value(tmp_path):
    """Profiled at batch 4 with 4 KV heads and half a head dim of 4: the new batch rebinds the batch alone (a
    mapping of recorded sizes would have had to send every 4 to one new size, and the rotary patterns would
    run unfused at every new shape)."""
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=4, vocab_size=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    untouched = copy.deepcopy(model)
    report = advisor.optimize(model, {"input_ids": torch.randint(0, 256, (4, 12))}, interpret=True, reuse=False,
                              out=tmp_path)
    profiled = report.runs["fused_launches_per_call"]
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        got = {}
        assert _launches(report.handle, lambda: got.setdefault("y", model(input_ids=ids).logits)) == profiled
        torch.testing.assert_close(got["y"], untouched(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def _tiny(kind: str):
    torch.manual_seed(0)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=256)
        return transformers.Qwen2ForCausalLM(cfg).eval()
    cfg = transformers.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=256,
                                decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg).eval()


@pytest.mark.parametrize("kind", ["qwen2", "t5"])
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.filterwarnings("error:fusion-advisor.*launcher failed:RuntimeWarning")  # a site its kernel refuses
def test_generate_after_optimize_gives_the_unpatched_tokens(kind, decode, tmp_path):
    """A decoder-only and an encoder-decoder model generate the unpatched model's tokens in float32, their calls
    at shapes never profiled (each decode step) running fused kernels (counted over the whole `generate`)."""
    model = _tiny(kind)
    untouched = copy.deepcopy(model)
    prompt = torch.randint(1, 256, (3, 12))
    inputs = {"input_ids": prompt} if kind == "qwen2" else {"input_ids": prompt, "decoder_input_ids": prompt[:, :5]}
    report = advisor.optimize(model, inputs, interpret=True, reuse=False, out=tmp_path, decode=decode)
    with torch.no_grad():
        want = untouched.generate(prompt, max_new_tokens=4, do_sample=False)
        got = {}
        launched = _launches(report.handle, lambda: got.setdefault(
            "tokens", model.generate(prompt, max_new_tokens=4, do_sample=False)))
    assert torch.equal(got["tokens"], want)
    assert launched > 0, report


def test_decode_steps_past_the_budget_stop_asking_the_guards(tmp_path, monkeypatch):
    """Every decode step of `generate` calls each layer at the same top-level shapes (one token) while the KV cache
    inside grows, so dynamo's guards refuse each one: after `REFUSALS_TO_STOP` refusals in a row a layer stops asking
    them (asking cost ~100 us per layer call on the H200: generate() ran 0.90x eager) and runs its original forward,
    the tokens unchanged."""
    from advisor.patching import forward

    model = _tiny_llama()
    untouched = copy.deepcopy(model)
    prompt = torch.randint(1, 256, (3, 12))
    advisor.optimize(model, {"input_ids": prompt}, interpret=True, reuse=False, out=tmp_path)
    asked = []
    accept = forward._guards_accept
    monkeypatch.setattr(forward, "_guards_accept", lambda *a, **k: asked.append(1) or accept(*a, **k))
    steps, layers = 16, model.config.num_hidden_layers
    with torch.no_grad():
        want = untouched.generate(prompt, max_new_tokens=steps, do_sample=False)
        got = model.generate(prompt, max_new_tokens=steps, do_sample=False)
        first = len(asked)
        assert torch.equal(model.generate(prompt, max_new_tokens=steps, do_sample=False), want)
    assert torch.equal(got, want)
    assert first <= layers * (forward.REFUSALS_TO_STOP + 1), f"guards asked {first} times over {steps} steps"
    assert len(asked) - first <= layers, "a second generate asked the guards again past its prompt"


def test_a_whole_stack_at_a_new_shape_keeps_each_read_where_the_kernel_reads_it(tmp_path):
    """ModernBERT rotates the query and the key of a packed QKV alike, so a loose match at a new shape may bind the
    program's query to the graph's key: every read then moves by the 64 elements between them, while the kernel,
    made at the profiled sizes, keeps its own distances (its key read landed on the values: outputs 0.6 off). Such
    a rebinding is refused; the whole stack's capture at a new shape gives the unpatched outputs."""
    cfg = transformers.ModernBertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=64, pad_token_id=0,
                                        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
                                        global_attn_every_n_layers=2, local_attention=8)
    torch.manual_seed(0)
    model = transformers.ModernBertModel(cfg).eval()
    untouched = copy.deepcopy(model)

    def text(batch, seq):
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[1, -3:] = 0
        return {"input_ids": torch.randint(3, 128, (batch, seq)), "attention_mask": mask}

    report = advisor.optimize(model, text(2, 16), interpret=True, reuse=False, out=tmp_path)
    handle = report.handle
    assert handle.outer, "the plan has no whole-stack capture to check"
    other = text(3, 11)
    handle.set_outer(True)
    try:
        with torch.no_grad():
            got = model(**other).last_hidden_state
    finally:
        handle.set_outer(False)
    with torch.no_grad():
        want = untouched(**other).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
