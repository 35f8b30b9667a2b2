"""The patcher on real Hugging Face models from tiny configs (random weights, nothing downloaded).

First with stand-in replacements that must be bit-identical (`subgraph`: the matched ops themselves,
which tests the matcher and the substitution; `program`: the analyzer's program replayed by PyTorch,
which also tests input order and views), then with the generated Triton kernels (interpreter).
"""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import advisor
from advisor.analysis.api import analyze
from advisor.collect.in_process import profile_calls
from advisor.patching import build_plan, occurrence_modules, only, patch, patched_modules, patches_off, \
    spec_from_candidate, unpatch
from candidates import (RESIDUAL_LAYERNORM, RESIDUAL_RMSNORM, RMSNORM, ROTARY, SWIGLU, TANH_GELU, Structure,
                        describe, find_candidates)  # (pytest puts tests/ on sys.path)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def tiny(name: str, layers: int = 2):
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if name == "llama":
        cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                          vocab_size=256, max_position_embeddings=128)
        cls, kw = LlamaForCausalLM, {"use_cache": False}
    elif name == "gpt2":
        cfg = GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=256, n_positions=128, bos_token_id=255,
                         eos_token_id=255)
        cls, kw = GPT2LMHeadModel, {"use_cache": False}
    else:
        cfg = BertConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                         vocab_size=256, max_position_embeddings=128)
        cls, kw = BertModel, {}
    cfg._attn_implementation = "sdpa"
    return cls(cfg).eval(), kw


def inputs(name: str, seq: int = 16, batch: int = 2) -> dict:
    g = torch.Generator().manual_seed(1)
    d = {"input_ids": torch.randint(0, 256, (batch, seq), generator=g)}
    if name == "bert":
        d["attention_mask"] = torch.ones(batch, seq, dtype=torch.long)
    return d


def run(model, kw, x, grad: bool = False):
    ctx = torch.enable_grad() if grad else torch.inference_mode()
    with ctx:
        out = model(**x, **kw)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


# The patterns the issue names, by structure (kind and ops), per model.
LLAMA_LAYER = [RESIDUAL_RMSNORM, RMSNORM, SWIGLU, ROTARY]
WANTED = {
    "llama": [LLAMA_LAYER],
    "gpt2": [[RESIDUAL_LAYERNORM, TANH_GELU],
             [Structure(kind="epilogue", has=("addmm",) + TANH_GELU.has)]],  # bias+GELU: the addmm epilogue
    "bert": [[RESIDUAL_LAYERNORM, Structure(kind="epilogue", ops=("linear", "gelu"))]],
}


@pytest.fixture(scope="module")
def analyses(tmp_path_factory):
    """One in-process profile + analysis per model (shared by every test here)."""
    out = {}
    for name in WANTED:
        model, kw = tiny(name)
        x = inputs(name)
        a = analyze(profile_calls(lambda: run(model, kw, x), tmp_path_factory.mktemp(name), "cpu", calls=3))
        out[name] = a
    return out


def pick(analysis, structures: list[Structure]) -> list[dict]:
    """Every candidate of each structure (each must have one)."""
    found = []
    for want in structures:
        hits = find_candidates(analysis.doc["candidates"], want)
        assert hits, f"no candidate is {want}: {describe(analysis.doc['candidates'])}"
        found += hits
    return found


def launched(h, key: str) -> int:
    """Launcher calls so far at every site of a pattern (a site counts each call, over all models)."""
    return sum(site.stats["launched"] for site in h.site_objects(key))


def plan_for(analysis, structures, replacement, granularity="occurrence", **kw):
    specs = [spec_from_candidate(c, replacement, **kw) for c in pick(analysis, structures)]
    return build_plan(specs, analysis.doc, occurrence_modules(analysis), granularity), specs


@pytest.mark.parametrize("replacement", ["subgraph", "program"])
@pytest.mark.parametrize("name, group", [(n, i) for n, groups in WANTED.items() for i in range(len(groups))])
def test_stand_in_replacement_is_bit_identical(analyses, name, group, replacement):
    a = analyses[name]
    model, kw = tiny(name)
    x = inputs(name)
    ref = run(model, kw, x)
    plan, specs = plan_for(a, WANTED[name][group], replacement)
    h = patch(model, plan)
    run(model, kw, x)
    before = {s.key: launched(h, s.key) for s in specs}
    out = run(model, kw, x)
    for s in specs:
        occ = next(c["occurrences"] for c in a.doc["candidates"] if c["id"] == s.candidate)
        assert launched(h, s.key) - before[s.key] == occ, (s.title, h.rejected(s.key), h.errors())
    assert torch.equal(out, ref)
    assert unpatch(model) == len(h.modules)
    assert torch.equal(run(model, kw, x), ref)


@pytest.mark.parametrize("granularity, modules", [
    ("occurrence", ["embeddings", "encoder.layer.0.attention.output", "encoder.layer.0.output",
                    "encoder.layer.1.attention.output", "encoder.layer.1.output"]),
    ("pattern", ["embeddings", "encoder"]),
    ("root", [""]),
])
def test_granularity_chooses_the_captured_modules(analyses, granularity, modules):
    model, kw = tiny("bert")
    x = inputs("bert")
    ref = run(model, kw, x)
    plan, specs = plan_for(analyses["bert"], [RESIDUAL_LAYERNORM], "program", granularity)
    h = patch(model, plan)
    assert sorted(q for q, _ in patched_modules(model)) == modules
    run(model, kw, x)
    before = {s.key: launched(h, s.key) for s in specs}
    assert torch.equal(run(model, kw, x), ref)
    assert sum(launched(h, s.key) - before[s.key] for s in specs) == 5  # 4 in the layers, 1 in the embeddings


def test_unpatch_restores_forward_and_state(analyses):
    model, kw = tiny("llama")
    x = inputs("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ref = run(model, kw, x)
    plan, _ = plan_for(analyses["llama"], WANTED["llama"][0], "program")
    h = patch(model, plan)
    assert [q for q, _ in patched_modules(model)] == ["model"]
    run(model, kw, x)
    unpatch(model)
    assert not patched_modules(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert model.model.forward.__func__ is type(model.model).forward
    assert torch.equal(run(model, kw, x), ref)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert h.manifest() and all(e["sites"] for e in h.manifest())


def test_backward_gives_unpatched_gradients(analyses):
    model, kw = tiny("llama")
    twin = copy.deepcopy(model)
    x = inputs("llama")
    plan, _ = plan_for(analyses["llama"], WANTED["llama"][0], "program")
    patch(model, plan)
    run(model, kw, x)  # a patched inference call first, so the capture exists
    run(model, kw, x, grad=True).float().pow(2).mean().backward()
    run(twin, kw, x, grad=True).float().pow(2).mean().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), n


def test_guard_falls_back_outside_validated_shapes(analyses):
    model, kw = tiny("llama")
    plan, specs = plan_for(analyses["llama"], [SWIGLU], "program")
    h = patch(model, plan)
    run(model, kw, inputs("llama"))
    site = h.site_objects(specs[0].key)[0]
    base = dict(site.stats)
    assert base["fell_back"] == 0 and base["launched"] % 2 == 0  # one capture, shared by both layers' MLPs
    # A new sequence length recompiles; the program no longer matches there, so the original ops run.
    other = inputs("llama", seq=12)
    with patches_off():
        ref = run(model, kw, other)
    assert torch.equal(run(model, kw, other), ref)
    assert site.stats == base
    # The site's own guard: a call with other strides / dtype / a grad-requiring input runs the original.
    spec = site.inputs[0]
    x = torch.randn(spec.shape, dtype=torch.float32)
    y = torch.randn(spec.shape, dtype=torch.float32)
    assert torch.equal(site(x, y)[0], site.fallback(x, y)[0]) and site.stats["launched"] == base["launched"] + 1
    site(x.transpose(0, 1).contiguous().transpose(0, 1), y)  # same values, other strides
    site(x.double(), y.double())
    site(x.requires_grad_(), y)
    assert site.stats == {"launched": base["launched"] + 1, "fell_back": 3}
    with only(set()):  # a pattern switched off runs its original ops too
        site(x.detach(), y)
    assert site.stats["fell_back"] == 4


def test_patched_model_survives_copy_save_to_and_modes(analyses, tmp_path):
    model, kw = tiny("llama")
    x = inputs("llama")
    ref = run(model, kw, x)
    plan, specs = plan_for(analyses["llama"], WANTED["llama"][0], "subgraph")
    patch(model, plan)
    assert torch.equal(run(model, kw, x), ref)
    twin = copy.deepcopy(model)
    assert patched_modules(twin) and patched_modules(twin)[0][1].module is twin.model
    assert torch.equal(run(twin, kw, x), ref)
    clone = pickle.loads(pickle.dumps(model))
    assert torch.equal(run(clone, kw, x), ref)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    model.load_state_dict(torch.load(buf))
    assert torch.equal(run(model, kw, x), ref)
    model.train()  # no dropout in this config: same outputs, through a new capture
    with torch.no_grad():
        assert torch.equal(model(**x, **kw).logits, ref)
    model.eval()
    model.to(torch.float64)  # outside the validated dtype: the original ops run, in float64
    with patches_off():
        ref64 = run(model, kw, x)
    assert torch.equal(run(model, kw, x), ref64)
    unpatch(twin)
    assert not patched_modules(twin) and patched_modules(model)


@pytest.mark.parametrize("name, structures", [
    ("llama", LLAMA_LAYER),
    ("gpt2", [RESIDUAL_LAYERNORM, TANH_GELU]),
    ("bert", [RESIDUAL_LAYERNORM]),
], ids=["llama", "gpt2", "bert"])
def test_generated_kernels_patch_and_match(analyses, name, structures, tmp_path):
    """The generated Triton kernels (interpreter here): patched at every occurrence, outputs within tolerance."""
    from advisor.validate.outputs import compare_outputs
    from advisor.workflows.kernels import kernel_specs

    a = analyses[name]
    chosen = pick(a, structures)
    doc = {**a.doc, "candidates": chosen}
    specs, records = kernel_specs(doc, len(chosen), "kernel", tmp_path, "cpu")
    assert len(specs) == len(chosen), [(r.title, r.reason) for r in records if not r.validated]
    model, kw = tiny(name)
    x = inputs(name)
    ref = run(model, kw, x)
    h = patch(model, build_plan(specs, a.doc, occurrence_modules(a)))
    run(model, kw, x)  # captures (sites are shared by every model the same plan is patched into)
    before = {s.key: launched(h, s.key) for s in specs}
    out = run(model, kw, x)
    for s in specs:
        sites = h.site_objects(s.key)
        assert sites and all(site.broken is None for site in sites), (s.title, h.rejected(s.key), h.errors())
        assert launched(h, s.key) - before[s.key] == next(c["occurrences"] for c in chosen if c["id"] == s.candidate)
    cmp = compare_outputs(ref, out)
    assert cmp.ok, cmp.reason
    unpatch(model)
    assert torch.equal(run(model, kw, x), ref)


def test_package_is_callable_like_the_function(analyses):
    model, kw = tiny("llama")
    plan, _ = plan_for(analyses["llama"], [SWIGLU], "program")
    h = advisor.patch(model, plan)
    assert patched_modules(model)
    advisor.unpatch(model)
    assert not patched_modules(model) and h.plan is plan


def test_layer_granularity_never_captures_several_layers(analyses):
    """`layer` (optimize's and apply's default): per-layer captures; the occurrences straddling two layers
    (a layer's last residual add + the next one's input RMSNorm) and the model-level mask/rotary math are
    left to one outer capture of the stack, which stays off (the layers run their own captures) until
    selection switches it on, and the plan says which module the layer tier did not capture and why."""
    from advisor.patching.plan import spans_layers

    assert spans_layers("M.model", ["M.model.layers.0.mlp", "M.model.layers.1"])
    assert not spans_layers("M.model.layers.0", ["M.model.layers.0.mlp", "M.model.layers.0.self_attn", "M.model.layers.1"])
    model, kw = tiny("llama")
    x = inputs("llama")
    ref = run(model, kw, x)
    plan, specs = plan_for(analyses["llama"], WANTED["llama"][0], "program", "layer")
    assert plan.skipped and all("repeated layers" in why for why in plan.skipped.values())
    h = patch(model, plan)
    mods = sorted(q for q, f in patched_modules(model) if not f.outer)
    assert mods and all(q.startswith("model.layers.") or q in ("model.norm", "model.rotary_emb") for q in mods), mods
    assert [q for q, f in patched_modules(model) if f.outer] == ["model"] and not h.outer_on
    assert torch.equal(run(model, kw, x), ref)
    assert sum(h.sites(s.key) for s in specs) > 0
    unpatch(model)


def test_a_capture_forgotten_while_the_interpreter_shuts_down_says_nothing(monkeypatch):
    """A class capture's owner collected at interpreter exit (module globals already None) must not print
    "Exception ignored ... AttributeError" after the user's script has finished (seen with BERT and GPT-2
    optimised in one process)."""
    import weakref

    from advisor.patching import forward

    class Entry:
        pass

    entry = Entry()
    monkeypatch.setattr(forward, "_CLASS", None)
    forward._forget_capture(("key",), weakref.ref(entry), None)  # no AttributeError
