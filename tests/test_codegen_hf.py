"""Patterns of real models the generator used to refuse, on real profiles: tiny Hugging Face models
(random weights, nothing downloaded) or minimal modules with the same ops, profiled and analysed like
`advisor.optimize` does, each candidate generated and validated against PyTorch (Triton's interpreter
on the CPU). A test finds its candidate by the ops it fuses, so it checks the analyzer's real program,
views and strides as recorded, not a hand-written one."""
import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path_factory.getbasetemp() / "kernel-cache"))


def candidates(model, inputs: dict, tmp_path) -> list:
    """The analyzer's candidates for one profiled call of `model(**inputs)`."""
    from advisor.analysis.api import analyze
    from advisor.collect.in_process import profile_calls

    model.eval()

    def call():
        with torch.inference_mode():
            return model(**inputs)

    return analyze(profile_calls(call, tmp_path, "cpu", 1)).doc["candidates"]


def find(cands: list, ops: list) -> list:
    """The candidates fusing exactly `ops` (aten names without the namespace), in order."""
    hits = [c for c in cands if [o.split("::")[-1] for o in c["ops"]] == ops]
    assert hits, f"no candidate fuses {ops}: {[c['ops'] for c in cands]}"
    return hits


def generated(c: dict, tmp_path) -> dict:
    """The apply.json record `optimize` writes for a candidate: generated, validated (or why not)."""
    from advisor.records import Candidate
    from advisor.workflows.generate import _job

    return _job(Candidate.from_json(dict(c, id=c.get("id", "c"))), tmp_path).to_json()


def assert_validated(c: dict, tmp_path) -> dict:
    entry = generated(c, tmp_path)
    assert entry.get("validated"), f"{c['title']}: {entry.get('reason')}"
    return entry


def token_inputs(batch=2, seq=16, vocab=128, padded=False) -> dict:
    """Token ids; `padded`: with an attention mask that pads the second row's last four tokens."""
    torch.manual_seed(0)
    ids = torch.randint(1, vocab, (batch, seq))
    if not padded:
        return {"input_ids": ids}
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    return {"input_ids": ids, "attention_mask": mask}


# ------------------------------------------------------------------- views that merge or split dims
def test_opt_residual_layer_norm_through_a_reshape(tmp_path):
    """OPT adds the residual on [B * S, H] and normalises [B, S, H] (and the other way round): the
    norm reads the sum through a view that splits (merges) the rows."""
    cfg = transformers.OPTConfig(hidden_size=64, num_hidden_layers=1, ffn_dim=128, num_attention_heads=4,
                                 vocab_size=128, max_position_embeddings=64)
    cands = find(candidates(transformers.OPTForCausalLM(cfg), token_inputs(), tmp_path), ["add", "layer_norm"])
    shapes = set()
    for c in cands:
        assert_validated(c, tmp_path)
        prog = c["program"]
        shapes.add((len(prog["inputs"][0]["shape"]), len(prog["nodes"][1]["args"][0]["shape"])))
    assert {(2, 3), (3, 2)} <= shapes  # both directions were profiled


def test_deberta_scaled_query_through_head_split(tmp_path):
    """DeBERTa scales the query after viewing [B, H, S, D] as [B * H, S, D]: one view merges two dims;
    as the query projection's epilogue, the store inverts that merge (and the head split before it)."""
    cfg = transformers.DebertaV2Config(hidden_size=64, num_hidden_layers=1, intermediate_size=128,
                                       num_attention_heads=4, vocab_size=128, max_position_embeddings=64)
    cands = candidates(transformers.DebertaV2Model(cfg), token_inputs(), tmp_path)
    for c in find(cands, ["clone", "mul", "sqrt", "div"]) + find(cands, ["linear", "clone", "mul", "sqrt", "div"]):
        assert_validated(c, tmp_path)


def test_gptj_rotary_reads_interleaved_pairs(tmp_path):
    """GPT-J's rotate-every-two: a [.., D/2, 2] value read as [.., D] (a merge), cat with the pass-through half."""
    cfg = transformers.GPTJConfig(n_embd=64, n_layer=1, n_head=4, vocab_size=128, n_positions=64, rotary_dim=8)
    cands = [c for c in candidates(transformers.GPTJForCausalLM(cfg), token_inputs(), tmp_path)
             if "aten::cat" in c["ops"] and "aten::mul" in c["ops"]]
    assert cands
    for c in cands:
        assert_validated(c, tmp_path)


class WindowMerge(torch.nn.Module):
    """Swin's patch merging after a residual: [B, H * W, C] viewed [B, H, W, C], the four strided
    2 x 2 neighbours concatenated, then normalised (the view splits a dim and steps over it)."""

    def __init__(self, c=16):
        super().__init__()
        self.norm = torch.nn.LayerNorm(4 * c)

    def forward(self, x, y):
        h = x + y
        b, n, c = h.shape
        h = h.view(b, 8, 8, c)
        h = torch.cat([h[:, 0::2, 0::2], h[:, 1::2, 0::2], h[:, 0::2, 1::2], h[:, 1::2, 1::2]], -1)
        return self.norm(h.view(b, -1, 4 * c))


def test_swin_patch_merging_strided_windows(tmp_path):
    torch.manual_seed(0)
    inputs = {"x": torch.randn(2, 64, 16), "y": torch.randn(2, 64, 16)}
    (c,) = find(candidates(WindowMerge(), inputs, tmp_path), ["add", "cat", "layer_norm"])
    assert_validated(c, tmp_path)


def test_strided_view_of_a_value_validates_and_of_a_permuted_input_is_refused():
    """Any view of a value (dense in memory) is read through its memory order; an input's merge is
    refused when its dims are merged out of their logical order (the kernel reads inputs through their
    run-time strides, which need not be the recorded ones), with what to do about it."""
    from advisor.codegen import Unsupported, generate, load_module
    from advisor.codegen.record import record_program
    from advisor.validate import validate

    x = torch.randn(4, 6)
    gen = generate(record_program(lambda x: (x * 2).as_strided((3, 4), (5, 1)) + 1, x), use_cache=False)
    assert validate(gen, load_module(gen.path)).validated
    xt = torch.randn(6, 4).t()
    with pytest.raises(Unsupported, match="in another order than their logical one .*contiguous"):
        generate(record_program(lambda x: x.as_strided((2, 12), (12, 1)) * 2, xt), use_cache=False)


# ------------------------------------------------------------- booleans of scalars in the interpreter
def test_bloom_alibi_pow_chain(tmp_path):
    """BLOOM's ALiBi slopes: pow(a 0-dim base, per-head exponents) times the mask's cumulative positions;
    `_pow` used to `|` a scalar's comparison with a block's, which Triton's interpreter cannot do."""
    cfg = transformers.BloomConfig(hidden_size=64, n_layer=1, n_head=4, vocab_size=128)
    cands = candidates(transformers.BloomForCausalLM(cfg), token_inputs(padded=True), tmp_path)
    (c,) = find(cands, ["full", "pow", "sub", "mul", "mul"])  # aten::full (a constant) lowers: it joins the chain
    assert_validated(c, tmp_path)


class ScalarGate(torch.nn.Module):
    """A block of booleans combined with a scalar's: or, and, xor, logical and bitwise."""

    def forward(self, x, s):
        a, b = x > 0, s > 0.5
        return torch.where((a | b) ^ (a & ~b) | torch.logical_and(a, b), x, -x)


def test_bool_ops_with_a_scalar_comparison(tmp_path):
    torch.manual_seed(0)
    cands = candidates(ScalarGate(), {"x": torch.randn(4, 32), "s": torch.tensor(0.7)}, tmp_path)
    c = max(cands, key=lambda c: len(c["ops"]))
    assert {"aten::bitwise_or", "aten::bitwise_xor", "aten::logical_and"} <= set(c["ops"]), c["ops"]
    assert_validated(c, tmp_path)


# ------------------------------------------------------------------------------ index reductions
def test_clip_text_eos_pooling_argmax(tmp_path):
    """CLIP's text pooling: `(input_ids == eos).int().argmax(-1)`, a last-dim reduction returning an index."""
    cfg = transformers.CLIPTextConfig(hidden_size=64, num_hidden_layers=1, intermediate_size=128,
                                      num_attention_heads=4, vocab_size=128, max_position_embeddings=64,
                                      eos_token_id=5)
    inputs = token_inputs()
    inputs["input_ids"][:, 7] = 5  # an end-of-text token: the argmax has a winner and ties elsewhere
    cands = candidates(transformers.CLIPTextModel(cfg), inputs, tmp_path)
    (c,) = [c for c in cands if c["ops"][-1] == "aten::argmax"]
    assert_validated(c, tmp_path)


class ArgExtremes(torch.nn.Module):
    def forward(self, x):
        y = torch.tanh(x) * 3.0
        return torch.argmax(y, -1), torch.argmin(y, dim=-1, keepdim=True)


def test_float_argmax_argmin_validate(tmp_path):
    torch.manual_seed(0)
    cands = candidates(ArgExtremes(), {"x": torch.randn(6, 40)}, tmp_path)
    ops = {o for c in cands for o in c["ops"]}
    assert {"aten::argmax", "aten::argmin"} <= ops, [c["ops"] for c in cands]
    for c in cands:
        if {"aten::argmax", "aten::argmin"} & set(c["ops"]):
            assert_validated(c, tmp_path)


@pytest.mark.parametrize("variant", ["persistent", "looped"])
def test_argmax_first_of_ties_and_nan(variant):
    """torch's argmax: the first maximum; a NaN is the maximum (the first NaN). Both kernel variants."""
    from advisor.codegen import generate, load_module
    from advisor.codegen.record import record_program

    x = torch.zeros(3, 50)
    x[0, [9, 30]] = 2.0
    x[1, [12, 40]] = float("nan")
    x[2] = -1.0
    fn = lambda x: (torch.argmax(x * 1.0, -1), torch.argmin(x * 1.0, -1))  # noqa: E731
    mod = load_module(generate(record_program(fn, x)).path)
    if variant == "looped":
        mod.MAX_PERSISTENT_N, mod.LOOP_BLOCK_N = 0, 16
    got = mod.run(x)
    assert [t.tolist() for t in got] == [t.tolist() for t in fn(x)] == [[9, 12, 0], [0, 12, 0]]


# ------------------------------------------------------------------- row outputs in another order
def test_qwen3_qk_norm_then_rotary(tmp_path):
    """Qwen3 RMS-normalises q and k per head on [B, S, H, D], transposes to [B, H, S, D] and applies
    the rotary embedding: the row kernel writes its rows through the permutation."""
    cfg = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=1, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128, head_dim=16)
    cands = [c for c in candidates(transformers.Qwen3ForCausalLM(cfg), token_inputs(), tmp_path)
             if "aten::rsqrt" in c["ops"] and "aten::cat" in c["ops"]]
    assert len(cands) >= 2, "q and k norms"
    for c in cands:
        assert_validated(c, tmp_path)


# ------------------------------------------------------------------------------------------ attention
def test_bloom_baddbmm_attention_with_alibi_and_head_split_mask(tmp_path):
    """BLOOM: scores = baddbmm(alibi, q, k^T, beta=1, alpha=1/sqrt(d)) on [B * H, L, L], viewed as
    [B, H, L, L] for the padding mask, softmax, viewed back for P @ V. One flash-style kernel."""
    cfg = transformers.BloomConfig(hidden_size=64, n_layer=1, n_head=4, vocab_size=128)
    cands = candidates(transformers.BloomForCausalLM(cfg), token_inputs(padded=True), tmp_path)
    (c,) = [c for c in cands if c["kind"] == "attention" and "aten::baddbmm" in c["ops"]]
    entry = assert_validated(c, tmp_path)
    assert "pid_b // 4" in entry["source"]  # the mask's (batch, head) from the grid's batch x heads
    assert "run_sdpa" not in entry["source"]  # SDPA has no slot for baddbmm's own bias and scale


def test_deberta_attention_builds_its_mask_in_the_kernel(tmp_path):
    """DeBERTa: bmm scores on [B * H, L, L], masked_fill on [B, H, L, L] with ~mask.bool() (ops on the
    mask alone, broadcast to the scores), softmax, bmm."""
    cfg = transformers.DebertaV2Config(hidden_size=64, num_hidden_layers=1, intermediate_size=128,
                                       num_attention_heads=4, vocab_size=128, max_position_embeddings=64)
    cands = candidates(transformers.DebertaV2Model(cfg), token_inputs(padded=True), tmp_path)
    (c,) = [c for c in cands if c["kind"] == "attention"]
    assert {"aten::bitwise_not", "aten::masked_fill"} <= set(c["ops"])
    assert_validated(c, tmp_path)
