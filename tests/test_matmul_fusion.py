"""Matmul-anchored kernels (issue 10): tiled matmul + generated epilogue, flash-style attention, and
matmul + reduction over leading dims, each validated like every generated kernel (fp64 reference,
dtype tolerances, recorded / odd / all-ones shapes). Shapes here are small and odd (M, N, K never a
multiple of a block) so CI runs them in Triton's interpreter; planted wrong kernels must be rejected,
and the committed CPU sample traces' anchored candidates must validate or say why not."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from advisor.codegen import load_module
from advisor.codegen.anchored import detect_kind, generate_anchored
from advisor.codegen.cache import atomic_write
from advisor.codegen.conv import CONV_REASON
from advisor.codegen.record import record_program
from advisor.ops import lowering
from advisor.ops.lowering import Unsupported
from advisor.validate import validate
from advisor.workflows.generate import validate_alternatives
from candidates import ATTENTION, ROTARY, Structure, find_candidates  # (pytest puts tests/ on sys.path)

ROOT = Path(__file__).resolve().parents[1]
CPU_SAMPLES = ROOT / "sample_traces" / "cpu"
DEV = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _env(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path_factory.getbasetemp() / "kernel-cache"))
    torch.set_default_device(DEV)  # tensors made in a test live where kernels run
    yield
    torch.set_default_device(None)


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def generated(fn, *args, kind=None, use_cache=True):
    gen = generate_anchored(record_program(fn, *args), kind, use_cache=use_cache)
    return gen, load_module(gen.path)


def check(gen, mod):
    v = validate(gen, mod)
    assert v.validated, v.reason
    assert [s["case"] for s in v.errors["shapes"]] == ["recorded", "odd", "ones"]
    return v


def planted(gen, tmp_path, old, new):
    """The generated module with one line changed: a wrong kernel for validation to catch."""
    assert old in gen.code, old
    return load_module(atomic_write(tmp_path / f"planted_{abs(hash(new))}.py", gen.code.replace(old, new)))


# ------------------------------------------------------------------------------------------ epilogues
def _conv1d_gelu(x, w, b):
    """GPT-2's Conv1D + tanh GELU: addmm on the flattened rows, viewed back to (B, L, N)."""
    h = torch.addmm(b, x.view(-1, x.shape[-1]), w).view(x.shape[0], x.shape[1], -1)
    return 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0))))


EPILOGUES = {
    # name: (function, argument shapes)
    "linear+gelu": (lambda x, w, b: F.gelu(F.linear(x, w, b)), [(3, 37, 45), (29, 45), (29,)]),
    "mm*scale+residual": (lambda h, w, x: x + torch.mm(h, w) * 0.5, [(37, 45), (45, 29), (37, 29)]),
    "conv1d+gelu_tanh": (_conv1d_gelu, [(2, 19, 45), (45, 29), (29,)]),
    "bmm+relu": (lambda q, k: torch.matmul(q, k.transpose(-1, -2)).relu(), [(2, 3, 17, 20), (2, 3, 19, 20)]),
    "swiglu": (lambda x, w, u: F.silu(F.linear(x, w)) * u, [(2, 19, 45), (29, 45), (2, 19, 29)]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", list(EPILOGUES))
def test_epilogue_validates(name, dtype):
    fn, shapes = EPILOGUES[name]
    gen, mod = generated(fn, *[rand(*s, dtype=dtype) for s in shapes])
    assert gen.kind == "epilogue" and "tl.dot(" in gen.code
    assert gen.code.count("tl.store(") == 1  # the matmul output is never written, only the epilogue's
    check(gen, mod)
    assert gen.memory_saved_bytes > 0


def test_epilogue_reads_the_bias_once_per_column():
    gen, _ = generated(*(lambda f, s: (f, *[rand(*x) for x in s]))(*EPILOGUES["linear+gelu"]))
    assert "mask=col_mask)" in gen.code  # a [1, BLOCK_N] load, not one per tile element


def test_planted_wrong_epilogue_is_rejected(monkeypatch):
    good = lowering.TABLE["aten::gelu"]
    monkeypatch.setitem(lowering.TABLE, "aten::gelu", lowering.Lowering(
        good.op, good.kind, lambda a: f"0.5 * {a.self} * (1.0 + tl.erf({a.self} * 0.7))", good.promote, good.operands))
    fn, shapes = EPILOGUES["linear+gelu"]
    gen, mod = generated(fn, *[rand(*s) for s in shapes], use_cache=False)
    v = validate(gen, mod)
    assert not v.validated and "exceeds" in v.reason, v.reason


def test_validation_times_the_configs_at_the_recorded_shape_only():
    """A matmul kernel tunes (times its eight tile configs) at each new shape; validation lets it do so at
    the recorded shape only (what warms Triton's cache for the model's own first call) and runs the odd and
    all-ones shapes at the default config: on the H100 a matmul epilogue's job was ~24 compiles, the
    longest of an empty-cache generate."""
    fn, shapes = EPILOGUES["linear+gelu"]
    gen, mod = generated(fn, *[rand(*s) for s in shapes])
    seen, run = [], mod.run

    def spy(*args):
        seen.append(mod.TUNE)
        return run(*args)
    mod.run = spy
    try:
        check(gen, mod)
    finally:
        mod.run = run
    assert seen == [mod.TUNE, False, False] and mod.TUNE  # and the module's own setting is left as it was


def test_a_call_that_times_nothing_leaves_no_config_decided_for_a_tuned_call(monkeypatch):
    """A validation first runs its kernel's launch code untuned on meta tensors (to start its compiles,
    `launch_signatures`), at the recorded shape's key: that call must not pin the default config there, or
    the recorded case (and the patched model's first call) would never time the configs."""
    fn, shapes = EPILOGUES["linear+gelu"]
    _, mod = generated(fn, *[rand(*s) for s in shapes])
    key, configs = (64, 96, 32, torch.bfloat16), mod.CONFIGS
    assert mod._tuned(key, lambda cfg: None, False, configs, configs[0]) == configs[0]
    fastest = configs[-1]
    monkeypatch.setattr(mod.triton.testing, "do_bench", lambda f, **kw: 1.0 if f.__defaults__[0] == fastest else 2.0)
    monkeypatch.setattr(mod, "TUNE", True)
    assert mod._tuned(key, lambda cfg: None, True, configs, configs[0]) == fastest
    assert mod._tuned(key, lambda cfg: None, False, configs, configs[0]) == fastest  # decided once timed


def test_compile_jobs_are_the_compiles_validation_makes(monkeypatch):
    """Issue 17: a tuned kernel's validation compiles every tile config at the recorded shape, then the
    default config at each other shape; those are the jobs the compile workers run ahead of it."""
    import advisor.validate as validation

    fn, shapes = EPILOGUES["linear+gelu"]
    gen, mod = generated(fn, *[rand(*s) for s in shapes])
    assert validation.compile_jobs(gen, mod) == []  # the interpreter compiles nothing
    monkeypatch.setattr(validation, "interpreted", lambda: False)
    monkeypatch.setattr(validation, "memo_key", lambda *a: "key")  # (the real one names the GPU)
    monkeypatch.setattr(validation, "recall", lambda key: None)
    assert validation.compile_jobs(gen, mod) == [("recorded", i) for i in range(len(mod.CONFIGS))] + \
        [("odd", None), ("ones", None)]
    monkeypatch.setattr(mod, "TUNE", False)  # FUSION_ADVISOR_TUNE=0: validation times nothing
    assert validation.compile_jobs(gen, mod) == []
    monkeypatch.setattr(mod, "TUNE", True)
    monkeypatch.setattr(validation, "recall", lambda key: {"rel_l2": 0.0})  # memoised: the kernel will not run
    assert validation.compile_jobs(gen, mod) == []


def test_compile_ahead_launches_the_config_asked_and_leaves_the_module_as_found():
    from advisor.validate import compile_ahead

    fn, shapes = EPILOGUES["linear+gelu"]
    gen, mod = generated(fn, *[rand(*s) for s in shapes])
    name = next(k for k in vars(mod) if k.endswith("_kernel"))  # the @triton.jit function the launcher calls
    real, launched = getattr(mod, name), []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append(tuple(kw[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps",
                                                      "num_stages")))
                return real[grid](*args, **kw)
            return launch

    config, tune = mod._config, mod.TUNE
    setattr(mod, name, Spy())
    compile_ahead(gen, mod, "odd", len(mod.CONFIGS) - 1)
    assert launched == [mod.CONFIGS[-1]]  # the tile asked for, not the interpreter's small one
    assert mod._config is config and mod.TUNE == tune
    compile_ahead(gen, mod, "ones", None)  # the default: what `_config` picks untuned (the interpreter's tile)
    assert len(launched) == 2 and launched[1] != mod.CONFIGS[-1] and launched[1][:3] == (64, 16, 16)


def test_matmul_skipping_the_last_k_block_is_rejected(tmp_path):
    fn, shapes = EPILOGUES["mm*scale+residual"]
    gen, _ = generated(fn, *[rand(*s) for s in shapes])
    v = validate(gen, planted(gen, tmp_path, "for k0 in range(0, K, BLOCK_K):", "for k0 in range(0, K - BLOCK_K, BLOCK_K):"))
    assert not v.validated, "a matmul missing its K tail validated"


def test_epilogue_skipping_the_last_row_is_caught_by_poisoning(tmp_path):
    fn, shapes = EPILOGUES["swiglu"]
    gen, _ = generated(fn, *[rand(*s) for s in shapes])
    v = validate(gen, planted(gen, tmp_path, "row_mask = m < M", "row_mask = m < M - 1"))
    assert not v.validated and "NaN/Inf" in v.reason, v.reason


def test_conv_epilogue_other_than_norm_add_relu_is_refused_with_reason():
    # cuDNN's fused conv applies a ReLU only: a conv followed by another activation stays with its pointwise kernel
    prog = record_program(lambda x, w: F.hardswish(F.conv2d(x, w)), rand(1, 3, 8, 8), rand(4, 3, 3, 3))
    with pytest.raises(Unsupported, match=re.escape(CONV_REASON)):
        generate_anchored(prog, "epilogue")


def test_conv_epilogue_folds_batchnorm_and_a_planted_wrong_fold_is_caught(tmp_path):
    """ResNet-50's conv -> BatchNorm (eval) -> residual add -> ReLU from the CPU sample trace: one module, the
    BatchNorm folded into the conv's weight and bias, validated at the recorded batch and two others; a fold that
    forgets the running mean fails validation."""
    from advisor.analysis.api import analyze

    doc = analyze(CPU_SAMPLES / "tv_resnet50" / "trace").doc
    c = find_candidates(doc["candidates"], Structure(kind="epilogue", ops=("conv2d", "batch_norm", "add_", "relu_")))[0]
    gen = generate_anchored(c["program"])
    assert "_fold(" in gen.code and "cudnn_convolution_add_relu" in gen.code and "triton" not in gen.code
    v = check(gen, load_module(gen.path))
    assert [s["inputs"][0][0] for s in v.errors["shapes"]] != [v.errors["shapes"][0]["inputs"][0][0]] * 3  # the batch varies
    wrong = planted(gen, tmp_path, "shift = -mean.float() * scale", "shift = 0 * mean.float()")
    assert not validate(gen, wrong).validated


def test_epilogue_that_is_not_elementwise_is_refused():
    # rotate-half (rotary embeddings) reads the matmul output at another column
    def rotary(x, w, cos, sin):
        h = F.linear(x, w).view(2, 9, 4, 8)
        rot = torch.cat([-h[..., 4:], h[..., :4]], -1)
        return h * cos + rot * sin
    prog = record_program(rotary, rand(2, 9, 16), rand(32, 16), rand(9, 1, 8), rand(9, 1, 8))
    with pytest.raises(Unsupported, match="matmul output"):
        generate_anchored(prog, "epilogue")


# ------------------------------------------------------------------------------------------ attention
def _causal(n: int, dtype) -> torch.Tensor:
    return torch.zeros(1, n, n, dtype=dtype).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1),
                                                         torch.finfo(dtype).min)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_attention_with_causal_mask_validates(dtype):
    def attn(q, k, v, mask):  # eager GPT-2 style: scores * scale + additive mask, softmax, @ v
        return torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * 0.25 + mask, -1) @ v
    gen, mod = generated(attn, rand(6, 37, 16, dtype=dtype), rand(6, 37, 16, dtype=dtype),
                         rand(6, 37, 16, dtype=dtype), _causal(37, dtype))
    assert gen.kind == "attention" and gen.alternatives == ("sdpa",)
    assert gen.code.count("tl.store(") == 1  # neither the scores nor the probabilities are written
    check(gen, mod)
    assert validate_alternatives(gen, mod)["sdpa"]["validated"]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_attention_without_mask_keys_and_value_dims_differ(dtype):
    def attn(q, k, v):  # BERT style without a mask: / sqrt(d); Lk != Lq and dv != d
        return torch.softmax(torch.bmm(q, k.transpose(-1, -2)) / 4.0, -1) @ v
    gen, mod = generated(attn, rand(6, 21, 16, dtype=dtype), rand(6, 41, 16, dtype=dtype), rand(6, 41, 24, dtype=dtype))
    check(gen, mod)
    assert validate_alternatives(gen, mod)["sdpa"]["validated"]


class _DeviceScalar(torch.Tensor):
    """A 0-dim tensor that says it lives on a GPU and refuses to be read on the host (a sync there cannot
    be recorded in a CUDA graph: `float()` of it failed a patched BERT's capture on the H100)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self):
        return torch.device("cuda")

    def __float__(self):
        raise AssertionError("a device scalar was read on the host")


@pytest.mark.parametrize("divide", [False, True], ids=["mul", "div"])
def test_sdpa_alternative_never_reads_a_device_scale_on_the_host(divide):
    def attn(q, k, v, mask, scale):
        s = torch.matmul(q, k.transpose(-1, -2))
        return torch.softmax((s / scale if divide else s * scale) + mask, -1) @ v
    q, k, v = (rand(6, 19, 16) for _ in range(3))
    mask, scale = _causal(19, torch.float32), torch.tensor(4.0 if divide else 0.25, dtype=torch.float64)
    gen, mod = generated(attn, q, k, v, mask, scale)
    assert "scale=scale)" in gen.code and "float(" in gen.code  # the scale is an input here, not a literal
    ref = attn(q, k, v, mask, scale)
    host = mod.run_sdpa(*[q, k, v, mask, scale])[0]
    dev = mod.run_sdpa(*[q, k, v, mask, scale.as_subclass(_DeviceScalar)])[0]
    assert torch.allclose(host, ref, atol=1e-5) and torch.allclose(dev, ref, atol=1e-5)


def test_decode_step_attention_one_query():
    def attn(q, k, v):
        return torch.softmax(torch.bmm(q, k.transpose(-1, -2)) * 0.125, -1) @ v
    gen, mod = generated(attn, rand(4, 1, 16), rand(4, 33, 16), rand(4, 33, 16))
    check(gen, mod)


def test_attention_skipping_the_last_key_block_is_rejected(tmp_path):
    def attn(q, k, v, mask):
        return torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * 0.25 + mask, -1) @ v
    gen, _ = generated(attn, rand(2, 37, 16), rand(2, 37, 16), rand(2, 37, 16), _causal(37, torch.float32))
    bad = planted(gen, tmp_path, "for start_n in range(0, LK, BLOCK_N):", "for start_n in range(0, LK - BLOCK_N, BLOCK_N):")
    assert not validate(gen, bad).validated


def test_attention_chain_that_sdpa_cannot_express_has_no_alternative():
    def attn(q, k, v, bias):  # mask added before the scale: (s + m) * c is not SDPA's s * c + m
        return torch.softmax((torch.bmm(q, k.transpose(-1, -2)) + bias) * 0.25, -1) @ v
    gen, mod = generated(attn, rand(3, 17, 8), rand(3, 17, 8), rand(3, 17, 8), rand(3, 17, 17))
    assert gen.alternatives == ()
    check(gen, mod)


def _as_dtype(program: dict, dtype: str) -> dict:
    """A trace's program with its float32 tensors in another dtype (0-dim float64 scalars stay)."""
    conv = lambda spec: dict(spec, dtype=dtype) if spec.get("dtype") == "float32" else spec  # noqa: E731
    return dict(program, inputs=[conv(i) for i in program["inputs"]],
                nodes=[dict(n, outputs=[conv(o) for o in n["outputs"]]) for n in program["nodes"]])


# ------------------------------------------------------------------------------------- matmul + reduction
def _splade(h, w, b, mask):
    return torch.amax(torch.log1p(torch.relu(F.linear(h, w, b))) * mask.unsqueeze(-1), dim=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_splade_matmul_reduction_validates(dtype):
    h, w, b = rand(3, 37, 45, dtype=dtype), rand(203, 45, dtype=dtype), rand(203, dtype=dtype)
    mask = (torch.rand(3, 37) > 0.3).to(dtype)
    gen, mod = generated(_splade, h, w, b, mask)
    assert gen.kind == "matmul_reduction"
    assert gen.code.count("tl.store(") == 1  # only the B x V result: the logits are never written
    check(gen, mod)
    logits = 3 * 37 * 203 * dtype.itemsize
    assert gen.memory_saved_bytes >= logits and "never allocated" in gen.note


@pytest.mark.parametrize("reduce", ["mean", "sum_keepdim", "amin"])
def test_other_leading_reductions(reduce):
    fns = {"mean": lambda x, w: torch.mean(torch.tanh(torch.matmul(x, w)), dim=1),
           "sum_keepdim": lambda x, w: torch.sum(F.linear(x, w) * 2.0, dim=1, keepdim=True),
           "amin": lambda x, w: torch.amin(torch.sigmoid(F.linear(x, w)), dim=1)}
    shapes = {"mean": [(2, 21, 13), (13, 27)]}.get(reduce, [(2, 21, 13), (27, 13)])
    gen, mod = generated(fns[reduce], *[rand(*s) for s in shapes])
    assert gen.kind == "matmul_reduction"
    check(gen, mod)


def test_matmul_reduction_skipping_a_row_is_rejected(tmp_path):
    gen, _ = generated(_splade, rand(2, 21, 13), rand(27, 13), rand(27), torch.ones(2, 21))
    bad = planted(gen, tmp_path, "row_mask = m < M", "row_mask = m < M // 2")  # a max over half the rows
    assert not validate(gen, bad).validated


def test_kind_is_detected_from_the_program():
    prog = record_program(_splade, rand(2, 5, 7), rand(11, 7), rand(11), torch.ones(2, 5))
    assert detect_kind(prog) == "matmul_reduction"
    prog = record_program(lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2), -1) @ v, *[rand(2, 5, 4)] * 3)
    assert detect_kind(prog) == "attention"


# ------------------------------------------------------------------------------------------ sample traces
# CPU sample traces: the anchored candidates that must validate, and the stated reasons for the others (by
# kind and ops: an epilogue's ops are its matmul's and the chain's it absorbs, in execution order).
def _epilogue(*ops: str) -> Structure:
    return Structure(kind="epilogue", ops=ops)


VALIDATE = {
    "hf_gpt2_eager": [ATTENTION, Structure(kind="epilogue", has=("addmm", "pow", "tanh")),  # bias + tanh GELU
                      _epilogue("matmul", "clone")],
    "hf_bert_eager": [ATTENTION, _epilogue("linear", "gelu"), _epilogue("matmul", "clone"),
                      _epilogue("linear", "tanh")],
    "splade": [Structure(kind="matmul_reduction"), _epilogue("linear", "relu", "log1p", "mul")],
    "mlp_block": [_epilogue("linear", "gelu"), _epilogue("linear", "add")],
    "hf_llama": [Structure(kind="epilogue", has=("linear", "silu", "mul"))],  # gate_proj's and up_proj's SwiGLU
    "timm_vit": [_epilogue("linear", "gelu")],
    "tv_resnet50": [Structure(kind="epilogue", ops=("conv2d", "batch_norm", "relu_")),  # cuDNN's fused conv
                    Structure(kind="epilogue", ops=("conv2d", "batch_norm", "add_", "relu_"))],
}
REFUSED = {"hf_llama": [Structure(kind="epilogue", has=("linear",) + ROTARY.has)]}  # q/k projection + rotary


def test_conv_epilogues_offered_only_where_cudnn_runs_them():
    """ResNet-50's downsample block (BatchNorm twice before the add: the branch's and the block's) has no conv
    epilogue cuDNN runs: the analysis offers none, and the pointwise group stays a candidate of its own."""
    from advisor.analysis.api import analyze
    from advisor.ops.registry import conv_epilogue_fits

    cands = analyze(CPU_SAMPLES / "tv_resnet50" / "trace").doc["candidates"]
    convs = [c for c in cands if c["kind"] == "epilogue" and "conv" in c["ops"][0]]
    assert convs and all(conv_epilogue_fits(c["ops"]) for c in convs), [c["ops"] for c in convs]
    assert find_candidates(cands, Structure(kind="norm", ops=("batch_norm", "batch_norm", "add_", "relu_")))
    assert not conv_epilogue_fits(["aten::conv2d", "aten::batch_norm", "aten::hardswish_"])
    assert not conv_epilogue_fits(["aten::conv2d", "aten::batch_norm", "aten::add_"])
    assert conv_epilogue_fits(["aten::conv2d", "aten::relu"])


@pytest.fixture(scope="module")
def sample_results(tmp_path_factory):
    """Per workload, each anchored candidate's generate record with the candidate's kind and ops."""
    from advisor.analysis.api import analyze
    from advisor.records import Kind
    from advisor.workflows.generate import generate_candidates

    out = {}
    for w in sorted(set(VALIDATE) | set(REFUSED)):
        doc = analyze(CPU_SAMPLES / w).doc
        doc = dict(doc, candidates=[c for c in doc["candidates"] if Kind(c["kind"]).anchored])
        res = generate_candidates(doc, tmp_path_factory.mktemp(w))
        cands = {c["id"]: c for c in doc["candidates"]}
        out[w] = [dict(p, kind=cands[p["candidate"]]["kind"], ops=cands[p["candidate"]]["ops"])
                  for p in res["patterns"]]
    return out


@pytest.mark.parametrize("workload", sorted(set(VALIDATE) | set(REFUSED)))
def test_sample_trace_anchored_candidates(sample_results, workload):
    pats = sample_results[workload]
    for want in VALIDATE.get(workload, []):
        hits = find_candidates(pats, want)
        # a later rival of a validated kernel (up_proj's SwiGLU beside gate_proj's) is not generated:
        # test_rival_generated_when_the_first_fails generates it
        assert hits and all(p["validated"] or "fuses the same group at every site" in p["reason"] for p in hits) \
            and any(p["validated"] for p in hits), (want, [(p["title"], p["reason"]) for p in hits])
    for want in REFUSED.get(workload, []):
        hits = find_candidates(pats, want)
        assert hits and all(not p["validated"] and p["kernel_file"] is None for p in hits), want
        assert all(p["reason"].startswith(CONV_REASON) or "not elementwise" in p["reason"]
                   or "not an elementwise epilogue" in p["reason"] for p in hits), \
            [p["reason"] for p in hits]
    for p in pats:  # every anchored candidate: validated, or refused with a reason (never a failed kernel)
        assert p["validated"] or (p["kernel_file"] is None and p["reason"]
                                  and not p["reason"].startswith("generator error")), (p["title"], p["reason"])
        if p["validated"]:
            assert p["memory_saved_bytes"] > 0
        if p["kind"] == "attention":
            assert p["alternatives"]["sdpa"]["validated"]


def test_rival_generated_when_the_first_fails(tmp_path, monkeypatch):
    """Llama's SwiGLU is two epilogues of one group (gate_proj's, up_proj's) at the same sites: only the first
    in rank order can be patched, so up_proj's is generated only when gate_proj's kernel fails validation,
    and then it is (a second batch), validated on its own."""
    from advisor.analysis.api import analyze
    from advisor.records import candidates_of
    from advisor.workflows import generate as gen_mod

    cands = candidates_of(analyze(CPU_SAMPLES / "hf_llama").doc)
    gate, up = (next(c for c in cands if f"SwiGLU, {m}" in c.title) for m in ("gate_proj", "up_proj"))
    base = next(c for c in cands if c.id == gate.extends == up.extends)
    assert gen_mod.rivals([gate, up, base], cands) == {up.id: gate}
    failing = {gate.id}
    monkeypatch.setattr(gen_mod, "_job", (lambda job: lambda c, out: (
        gen_mod.pattern_record(c, validated=False, reason="planted failure") if c.id in failing else job(c, out)))(gen_mod._job))
    res = {r.candidate: r for r in gen_mod.generate_results([gate, up], tmp_path, every=cands)}
    assert res[gate.id].reason == "planted failure"
    assert res[up.id].validated, res[up.id].reason
    failing.clear()  # gate_proj's validates: up_proj's is not generated, and says why
    res = {r.candidate: r for r in gen_mod.generate_results([gate, up], tmp_path, every=cands)}
    assert res[gate.id].validated and not res[up.id].validated and res[up.id].kernel_file is None
    assert res[up.id].reason.startswith(f"not generated: {gate.id} (linear epilogue (SwiGLU, gate_proj))")


@pytest.mark.parametrize("workload", ["hf_gpt2_eager", "hf_bert_eager", "splade"])
def test_sample_trace_programs_in_bf16(workload):
    """The recorded attention and SPLADE programs (4-d, the trace's own strides and offsets) in bf16."""
    from advisor.analysis.api import analyze

    doc = analyze(CPU_SAMPLES / workload).doc
    (c,) = [c for c in doc["candidates"] if c["kind"] in ("attention", "matmul_reduction")]
    gen = generate_anchored(_as_dtype(c["program"], "bfloat16"), c["kind"])
    mod = load_module(gen.path)
    v = check(gen, mod)
    assert v.errors["dtype"] == "bfloat16"
    if c["kind"] == "attention":
        assert validate_alternatives(gen, mod)["sdpa"]["validated"]


def test_the_faster_validated_alternative_becomes_run(sample_results, tmp_path):
    """On a GPU attention's kernel and SDPA are timed alone after validation; the faster one is what the
    written module's `run` is, so the patcher needs no other path. (Here: the choice with given times.)"""
    from advisor.records import PatternResult
    from advisor.workflows.generate import choose_launcher

    (att,) = [p for p in sample_results["hf_gpt2_eager"] if p["kind"] == "attention"]
    entry = PatternResult.from_json({k: v for k, v in att.items() if k not in ("kind", "ops")} |
                                    {"kernel_file": str(atomic_write(tmp_path / "att.py", att["source"]))})
    slow = choose_launcher(entry, {"kernel": 0.15, "sdpa": 0.2})
    assert slow.launcher == "run" and load_module(Path(slow.kernel_file), "att_keep").run.__name__ == "run"
    fast = choose_launcher(entry, {"kernel": 0.2, "sdpa": 0.15})
    mod = load_module(Path(fast.kernel_file), "att_sdpa")
    assert fast.launcher == "run_sdpa" and mod.run is mod.run_sdpa and mod.run_kernel.__name__ == "run"
    assert fast.launcher_ms == {"kernel": 0.2, "sdpa": 0.15} and "Measured faster" in fast.source
    assert entry.launcher is None and "Measured faster" not in entry.source  # the record given is left as it was
