"""A patched model in its user's hands (issue 15, failure modes 2-6), on real tiny HF models called as
users call them: attention masks padding a row, the KV cache on (the config's default), hooks added
after `optimize`, other shapes afterwards, two widths of one class in one process, no GPU.
(Mode 1, the full-reduction crash, is tests/test_analyze.py's; mode 7, codegen refusals, test_codegen's;
the model zoo runs all of it over many architectures: test_zoo.py.)"""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

import advisor
from advisor.patching import patched_modules
from advisor.patching.forward import EXTRA_OUTPUTS
from advisor.status import Status
from candidates import RESIDUAL_RMSNORM, ROTARY, candidates_of  # (pytest puts tests/ on sys.path)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def llama(layers: int = 2, hidden: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=2 * hidden, vocab_size=256, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()  # use_cache: the config's default (on)


def batch(seq: int = 16, rows: int = 2, pad: int = 3) -> dict:
    g = torch.Generator().manual_seed(seq)
    mask = torch.ones(rows, seq, dtype=torch.long)
    mask[-1, seq - pad:] = 0  # a padded row, as a tokenizer hands it over
    return {"input_ids": torch.randint(0, 256, (rows, seq), generator=g), "attention_mask": mask}


def logits(model, x: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**x).logits


def launches(model) -> int:
    """Launcher calls so far of every site in the model's captures."""
    return sum(n for _, f in patched_modules(model) for (_, _), n in f.log().launches().items())


@pytest.fixture(scope="module")
def optimized(tmp_path_factory):
    model = llama(layers=10)  # more layers than dynamo's recompile limit (8): one cache per layer
    untouched = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = advisor.optimize(model, batch(), out=tmp_path_factory.mktemp("opt"), reuse=False, interpret=True)
    return model, untouched, report, [str(w.message) for w in caught]


def test_every_layer_runs_its_kernels_with_the_kv_cache_on(optimized):
    """Mode 5: HF layers guard on their `layer_idx`; ten layers sharing one dynamo cache hit its
    recompile limit (8) and the last ones silently ran unpatched. Now every layer launches."""
    model, untouched, report, caught = optimized
    assert not [w for w in caught if "recompile_limit" in w], caught
    analysis = json.loads((report.out_dir / "analysis.json").read_text())
    layer_patterns = [p for p, c in zip(report.applied, candidates_of(report.applied, analysis))
                      if RESIDUAL_RMSNORM.matches(c) or ROTARY.matches(c)]
    assert layer_patterns, str(report)
    assert all(p["sites"] == 10 for p in layer_patterns), str(report)  # one per layer, counted by launches
    assert not report.handle.fallbacks(), report.handle.fallbacks()
    before = launches(model)
    torch.testing.assert_close(logits(model, batch()), logits(untouched, batch()), rtol=1e-4, atol=1e-4)
    assert launches(model) - before >= 10 * len(layer_patterns)


def test_patched_forwards_keep_their_signature(optimized):
    """HF `generate` reads `inspect.signature(model.forward)` to decide what to pass; a patched forward that
    read `(*args, **kwargs)` made Gemma-2 generate with other scores (tests/test_zoo.py's generate check)."""
    import inspect

    model, _, _, _ = optimized
    assert patched_modules(model)
    for name, _ in patched_modules(model):
        mod = model.get_submodule(name) if name else model
        want = inspect.signature(type(mod).forward.__get__(mod))
        assert inspect.signature(mod.forward) == want, name


def test_every_status_has_a_code_and_the_true_reason(optimized):
    """Mode 6: "not found in the captured graphs" was said of patterns whose modules were never captured."""
    _, _, report, _ = optimized
    doc = json.loads((report.out_dir / "apply.json").read_text())
    for p in doc["patterns"]:
        code = Status(p["status_code"])  # a known code, whatever the words
        assert p["status"], p
        if code is Status.NOT_CAPTURED:  # its modules are not captured alone, or only the outer capture holds it
            said = p["status"]
            assert "not found in the captured graphs" not in said, p
            assert ("not captured" in said and "holds several repeated layers" in said) or \
                ("holds several captured layers" in said and "fused only by the outer capture" in said), p
        if code is Status.PATCHED:
            assert p["patched"] and p["sites"] > 0


def test_hooks_added_after_optimize_are_honoured(optimized):
    """Mode 2: dynamo does not guard on a submodule's hooks; a hook added later inside a captured layer
    was silently never called."""
    model, untouched, report, _ = optimized
    counts = {"patched": 0, "untouched": 0}
    handles = []
    for name, m in (("patched", model), ("untouched", untouched)):
        mlp = m.model.layers[0].mlp
        handles.append(mlp.gate_proj.register_forward_hook(lambda mod, i, out: out * 1.5))
        handles.append(mlp.up_proj.register_forward_hook(
            lambda mod, i, out, name=name: counts.__setitem__(name, counts[name] + 1)))
    with pytest.warns(RuntimeWarning, match="hooks registered or removed after patching"):
        got = logits(model, batch())
    want = logits(untouched, batch())
    assert counts["patched"] == counts["untouched"] == 1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert "hooks registered or removed after patching" in str(report.handle.fallbacks())
    for h in handles:
        h.remove()
    before = launches(model)  # hooks gone: layer 0 runs its captured graph again
    torch.testing.assert_close(logits(model, batch()), logits(untouched, batch()), rtol=1e-4, atol=1e-4)
    assert launches(model) > before


def test_a_call_asking_for_hidden_states_leaves_later_calls_fused(tmp_path):
    """HF installs its output-capturing hooks inside every layer on the first call asking for
    `output_hidden_states`; they were taken for hooks the user added, and every later call ran the original
    forward (a Mistral's 16 launches per call -> 0 for good). Now only the calls asking for extra outputs do,
    counted in the handle's fallbacks, and their hidden states are the unpatched model's."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                             max_position_embeddings=128)).eval()
    untouched = copy.deepcopy(model)
    x = batch()
    report = advisor.optimize(model, x, out=tmp_path / "opt", reuse=False, interpret=True)

    def launched(**extra) -> tuple[int, object]:
        before = launches(model)
        with torch.no_grad():
            out = model(**x, **extra)
        return launches(model) - before, out

    fused, _ = launched()
    assert fused > 0
    _, out = launched(output_hidden_states=True)
    with torch.no_grad():
        want = untouched(**x, output_hidden_states=True).hidden_states
    assert len(out.hidden_states) == len(want) == 3
    for got, expected in zip(out.hidden_states, want):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert [launched()[0] for _ in range(2)] == [fused, fused]
    assert all(why == {EXTRA_OUTPUTS: 1} for why in report.handle.fallbacks().values()), report.handle.fallbacks()


def test_other_shapes_afterwards_never_wait_for_dynamo(optimized):
    """Mode 5, continued: lengths the user's loop brings later give the unpatched model's results; after
    a small capture budget they run the original forward (said in `fallbacks`), never recompiling forever."""
    model, untouched, report, _ = optimized
    for seq in (9, 11, 13, 17, 21, 23):
        x = batch(seq)
        torch.testing.assert_close(logits(model, x), logits(untouched, x), rtol=1e-4, atol=1e-4)
    compiled = [f for _, f in patched_modules(model) if f._backend]
    assert compiled and all(f._capturing_calls <= f._budget for f in compiled)
    assert any("capture budget" in w for why in report.handle.fallbacks().values() for w in why)


def test_cpu_defaults_leave_the_model_as_it_was(tmp_path):
    """Mode 3: on a CPU the kernels run in Triton's interpreter (90-2,000x slower); by default nothing is
    patched and the report says why, interpret=True patches anyway (checks, tests)."""
    model = llama(layers=1)
    report = advisor.optimize(model, batch(), out=tmp_path, reuse=False)
    assert not patched_modules(model)
    assert report.applied == [] and report.patterns
    validated = [p for p in report.patterns if p["status_code"] == Status.INTERPRETER]
    assert validated, str(report)
    assert all("interpret=True" in p["status"] for p in validated)
    assert "interpreter" in str(report)


def test_two_widths_of_one_class_each_run_their_own_kernels(tmp_path):
    """Mode 4: the second model of one class reused the first one's capture (matched at the first one's
    width), reported "patched" and never launched a kernel."""
    wide, narrow = llama(layers=2, hidden=64), llama(layers=2, hidden=48)  # one row-width class: same pattern ids
    first = advisor.optimize(wide, batch(), out=tmp_path / "wide", reuse=False, interpret=True)
    second = advisor.optimize(narrow, batch(), out=tmp_path / "narrow", reuse=False, interpret=True)
    assert first.applied and second.applied, (str(first), str(second))
    before = launches(narrow)
    logits(narrow, batch())
    assert launches(narrow) - before >= sum(p["sites"] for p in second.applied)


def test_small_doubles_reach_the_kernels_in_full(tmp_path):
    """The execution trace writes doubles with 6 decimals: BERT's LayerNorm eps (1e-12) was recorded as 0.0,
    and its fused kernel computed rsqrt(var + 0): NaN on a constant row where BERT gives 0. The program
    now holds Kineto's full value, and the generated kernel gives eager's result on a constant row."""
    from transformers import BertConfig, BertModel

    from advisor.codegen import generate, load_module

    torch.manual_seed(0)
    cfg = BertConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                     vocab_size=256, max_position_embeddings=64, layer_norm_eps=1e-12)
    report = advisor.optimize(BertModel(cfg).eval(), batch(), out=tmp_path, reuse=False, top=8)
    doc = json.loads((report.out_dir / "analysis.json").read_text())
    cand = next(c for c in doc["candidates"] if [n["op"] for n in c["program"]["nodes"]] == ["aten::add", "aten::layer_norm"])
    eps = [a["value"] for n in cand["program"]["nodes"] for a in n["args"] if isinstance(a.get("value"), float)]
    assert eps == [1e-12], eps  # exactly: 0.0 is what the execution trace holds
    run = load_module(generate(cand["program"]).path).run
    x, zero = torch.full((2, 16, 64), 0.5), torch.zeros(2, 16, 64)  # the residual sum: constant rows
    w, b = torch.ones(64), torch.zeros(64)
    outs = run(x, zero, w, b)
    normed = outs[-1] if isinstance(outs, (tuple, list)) else outs
    want = torch.nn.functional.layer_norm(x + zero, (64,), w, b, 1e-12)
    assert torch.isfinite(normed).all()
    torch.testing.assert_close(normed.reshape(want.shape), want)


def test_models_of_one_class_asking_for_hidden_states_do_not_share_a_capture_budget(tmp_path):
    """Every HF decoder layer's forward runs through decorators whose wrapper code every decorated function
    shares; dynamo compiled it as a frame of its own where the graph broke (hidden states asked for), so its
    recompile limit (8) was spent across models: in one process the third tiny Qwen2 optimized with
    `output_hidden_states=True` got no pattern. Each capture's functions, those its decorators wrap included,
    have code of their own. (HF's output-capturing hook, one function for every model, still shares one
    cache: past four such models the later ones get fewer patterns.)"""
    import transformers

    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    models, applied = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(4):
            torch.manual_seed(i)
            model = transformers.Qwen2ForCausalLM(cfg).eval()
            report = advisor.optimize(model, {"input_ids": ids, "output_hidden_states": True}, interpret=True,
                                      reuse=False, out=tmp_path / f"m{i}")
            models.append(model)
            applied.append(len(report.applied))
    assert applied[0] > 0 and applied == applied[:1] * 4, applied
