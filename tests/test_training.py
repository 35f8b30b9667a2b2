"""Training through fused kernels (issue 19): each fused program's backward derived, generated as Triton
kernels (interpreter here), validated against autograd in float64 before use, and used by a patched
model under autograd; a tiny HF Llama trained patched and unpatched follows the same loss curve."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from advisor.codegen import generate, load_module
from advisor.codegen.record import record_program
from advisor.patching import autograd as ag
from advisor.patching import backward

F = torch.nn.functional
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path_factory.getbasetemp() / "kernel-cache"))
    monkeypatch.setattr(ag, "_BACKWARDS", {})  # every test derives and validates afresh


def rms(x, w):
    v = x.float().pow(2).mean(-1, keepdim=True)
    return w * (x.float() * torch.rsqrt(v + 1e-6)).to(x.dtype)


def add_rms(x, r, w):
    h = x + r
    return rms(h, w), h


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


def rotary(q, cos, sin):
    """HF Llama's apply_rotary_pos_emb on one tensor: the slices' gradients are zero-padded (a cat with
    aten::full blocks), the cat's is sliced back."""
    return q * cos + rotate_half(q) * sin


FAMILIES = {  # name: (function, input shapes, expected kernel kind of the backward)
    "rmsnorm": (rms, [(5, 24), (24,)], "rows"),
    "rmsnorm-odd-width": (rms, [(2, 7, 13), (13,)], "rows"),  # 3-d, weight grad summed over two dims
    "residual+rmsnorm": (add_rms, [(5, 24), (5, 24), (24,)], "rows"),
    "layernorm": (lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5), [(5, 24), (24,), (24,)], "rows"),
    "softmax": (lambda x: torch.softmax(x.float() * 0.125, -1).to(x.dtype), [(5, 24)], "rows"),
    "tanh-gelu": (lambda x: F.gelu(x, approximate="tanh"), [(5, 24)], "pointwise"),
    "swiglu": (lambda a, b: F.silu(a) * b, [(5, 24), (5, 24)], "pointwise"),
    "bias+relu": (lambda x, b: torch.relu(x + b), [(5, 13), (13,)], "pointwise"),  # odd width, broadcast grad
    "rotary": (rotary, [(2, 3, 5, 16), (5, 16), (5, 16)], "pointwise"),  # cos and sin get grads too here
    "select+slice": (lambda x: x[..., 1] * x[..., 4] + x[..., 2:3].squeeze(-1), [(5, 3, 7)], "pointwise"),
}


def trainable(fn, xs):
    prog = record_program(fn, *xs)
    mod = load_module(generate(prog).path)
    return prog, ag.Trainable(prog, ag.module_forward(mod.run, prog))


def eager_grads(fn, xs, gouts):
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return torch.autograd.grad(outs, leaves, gouts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_backward_is_generated_validated_and_matches_autograd(name, dtype):
    fn, shapes, kind = FAMILIES[name]
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    prog, t = trainable(fn, xs)
    leaves = [x.clone().requires_grad_() for x in xs]
    bw = t.backward_for(leaves)
    assert bw.validated, bw.reason
    assert generate(bw.derived.program).kind == kind
    assert {s["id"] for s in bw.derived.program["inputs"]} <= {f"in{k}" for k in range(len(xs) + 2)}
    # Saved: forward inputs only (intermediates are recomputed), never more than what eager keeps.
    assert bw.derived.saved_bytes <= max(bw.derived.eager_saved_bytes, sum(x.numel() * x.element_size() for x in xs))
    outs = t(leaves)
    gouts = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs]
    got = torch.autograd.grad(outs, leaves, gouts)
    want = eager_grads(fn, xs, gouts)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 4e-2}
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), **tol)
    # validation covered the real shape, odd row counts and one row
    assert len(bw.errors["shapes"]) >= 2


@pytest.mark.parametrize("fused_ms, used", [(2.0, False), (0.5, True)], ids=["slower", "faster"])
def test_a_backward_slower_than_the_original_ops_is_not_used(monkeypatch, fused_ms, used):
    # on a GPU each validated backward is timed against the original ops (forward + backward) at the call's
    # shapes; the slower one keeps the site on its original ops. Here the timing is stood in for.
    monkeypatch.setattr(ag, "timing_meaningful", lambda device: True)
    timed = []

    def time_both(forward, original, bw, xs, needs):
        assert needs == (True, True, True)  # which inputs take a gradient, one flag per input
        timed.append(original(*xs))  # the site's original ops, called on the same inputs
        return fused_ms, 1.0

    monkeypatch.setattr(ag, "time_both", time_both)
    ag._BACKWARDS.clear()
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g), torch.randn(32, generator=g)]
    prog = record_program(add_rms, *xs)
    t = ag.Trainable(prog, ag.module_forward(load_module(generate(prog).path).run, prog), original=add_rms)
    leaves = [x.clone().requires_grad_() for x in xs]
    outs = t(leaves)
    assert (outs is not None) == used and len(timed) == 1
    [entry] = [e for e in ag.summary() if e["used"] == used]
    assert entry["validated"] and entry["fused_ms"] == fused_ms and entry["eager_ms"] == 1.0
    t(leaves)
    assert len(timed) == 1  # timed once per key


def test_backward_timing_runs_and_a_failing_one_never_breaks_the_site(monkeypatch):
    monkeypatch.setattr(ag, "timing_meaningful", lambda device: True)
    monkeypatch.setattr(ag, "time_call", lambda fn, device, **kw: (fn(), type("T", (), {"median_ms": 1.0}))[1])
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g), torch.randn(32, generator=g)]
    prog = record_program(add_rms, *xs)
    run = ag.module_forward(load_module(generate(prog).path).run, prog)
    for original, used in ((add_rms, False), (None, True)):  # equal times: not faster, so not used
        ag._BACKWARDS.clear()
        t = ag.Trainable(prog, run, original=original)
        assert (t([x.clone().requires_grad_() for x in xs]) is not None) == used
    ag._BACKWARDS.clear()

    def broken(*xs):
        raise RuntimeError("boom")

    t = ag.Trainable(prog, run, original=broken)
    assert t([x.clone().requires_grad_() for x in xs]) is None  # not timed: the original ops, no exception
    [entry] = ag.summary()
    assert entry["validated"] and not entry["used"] and "not timed" in entry["reason"]


def test_only_inputs_needing_grads_get_one():
    x, w = torch.randn(4, 16), torch.randn(16)
    _, t = trainable(rms, [x, w])
    xs = [x.clone().requires_grad_(), w]  # a frozen weight: no partial product, no column sum
    bw = t.backward_for(xs)
    assert bw.validated and [g.input for g in bw.derived.grads] == [0]
    assert len(bw.derived.program["outputs"]) == 1


def test_save_or_recompute_is_decided_by_bytes():
    """Residual add + RMSNorm: reading the sum `h` (an output) keeps one tensor between the passes instead
    of both addends; where an output may be written in place later, the backward recomputes from inputs."""
    xs = [torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)]
    prog, t = trainable(add_rms, xs)
    leaves = [x.clone().requires_grad_() for x in xs]
    bw = t.backward_for(leaves)
    assert bw.validated and bw.derived.saved_outputs == [1] and bw.derived.saved == [2]  # h and the weight
    assert bw.derived.saved_bytes == (4 * 16 + 16) * 4
    mod = load_module(generate(prog).path)
    strict = ag.Trainable(prog, ag.module_forward(mod.run, prog), keep_outputs=False)
    bw2 = strict.backward_for(leaves)
    assert bw2.validated and bw2.derived.saved_outputs == [] and bw2.derived.saved == [0, 1, 2]
    assert bw2.derived.saved_bytes > bw.derived.saved_bytes


def test_planted_wrong_derivative_is_caught(monkeypatch):
    """A wrong rule for tanh's derivative: the derived kernel computes it faithfully, validation against
    autograd in float64 rejects it, and the call runs the original ops (the Trainable returns None)."""
    aten = torch.ops.aten
    fn = lambda x, y: torch.tanh(x) * y  # noqa: E731
    xs = [torch.randn(6, 10), torch.randn(6, 10)]
    _, t = trainable(fn, xs)
    leaves = [x.clone().requires_grad_() for x in xs]
    assert t.backward_for(leaves).validated  # the true rule validates

    real = backward.rules

    def planted():
        table = dict(real())
        table[aten.tanh_backward.default] = lambda grad, y: grad * (1 - y)  # should be 1 - y**2
        return table

    monkeypatch.setattr(backward, "rules", planted)
    monkeypatch.setattr(ag, "_BACKWARDS", {})
    bw = t.backward_for(leaves)
    assert not bw.validated and "grad of input 0" in bw.reason, bw.reason
    assert t(leaves) is None


def test_gradients_keep_their_outputs_layout():
    """q as HF lays it out for attention ((B, H, S, D) over (B, S, H, D) memory): its rotary output, and the
    gradient that comes back for it (flash attention's dq is laid out as q), share that layout. The backward
    kernel takes that gradient as it comes (it was copied into a dense one: one more pass over it on a GPU)
    and writes q's gradient in the layout eager's own ops give it."""
    q = torch.randn(2, 5, 3, 16).transpose(1, 2)
    cos, sin = torch.randn(5, 16), torch.randn(5, 16)
    _, t = trainable(rotary, [q, cos, sin])
    leaf, twin = q.detach().requires_grad_(), q.detach().clone().requires_grad_()
    out = t([leaf, cos, sin])[0]
    g = torch.randn(2, 5, 3, 16).transpose(1, 2)
    assert out.stride() == g.stride() == q.stride()
    bw, seen = t.backward_for([leaf, cos, sin]), []
    kernel = bw.module.run
    bw.module = type("Spy", (), {"run": staticmethod(lambda *a: seen.append((a, kernel(*a))) or seen[-1][1])})
    out.backward(g)
    (args, res), = seen
    assert any(a.data_ptr() == g.data_ptr() for a in args)  # the gradient itself, not a copy
    want, = torch.autograd.grad(rotary(twin, cos, sin), twin, g)  # eager's, before any accumulation
    assert res[0].stride() == want.stride()
    torch.testing.assert_close(leaf.grad, want)


def test_planted_wrong_slice_padding_is_caught(monkeypatch):
    """The zero padding of a slice's gradient placed one column off: validation against autograd in float64
    rejects the rotary backward built with it."""
    real = backward.rules

    def planted():
        table = dict(real())
        good = table[torch.ops.aten.slice_backward.default]
        table[torch.ops.aten.slice_backward.default] = \
            lambda g, sizes, dim, start, end, step: good(g, sizes, dim, max(start - 1, 0) if start else 1,
                                                         end, step)
        return table

    monkeypatch.setattr(backward, "rules", planted)
    xs = [torch.randn(2, 3, 5, 16), torch.randn(5, 16), torch.randn(5, 16)]
    _, t = trainable(rotary, xs)
    bw = t.backward_for([xs[0].clone().requires_grad_(), xs[1], xs[2]])
    assert not bw.validated and "grad of input 0" in (bw.reason or ""), bw.reason


def test_forward_views_differentiate_as_view_ops():
    """The derivation reads a program's slices, selects and permutes through the view ops themselves (their
    backwards pad or permute), not through `as_strided` (whose backward scatters into a zero buffer in place,
    which no kernel computes); a view that is no box of its source still reads through `as_strided`."""
    base = torch.arange(2 * 5 * 8.0).reshape(2, 5, 8)
    spec = {"shape": [2, 5, 8], "strides": [40, 8, 1], "storage_offset": 0}
    for view in (base[:, 1:4, 2:], base[:, 2], base[1, :, 3:5].t(), base[:, None, 1:2].expand(2, 3, 1, 8)):
        ref = {"shape": list(view.shape), "strides": list(view.stride()), "storage_offset": view.storage_offset()}
        got = backward.index_view(base, spec, ref)
        assert torch.equal(got, view) and got.grad_fn is None
        leaf = base.clone().requires_grad_()
        assert "AsStrided" not in type(backward.index_view(leaf, spec, ref).grad_fn).__name__
    merged = base.view(10, 8)  # merges dims: as_strided, as the reference reads it
    ref = {"shape": [10, 8], "strides": [8, 1], "storage_offset": 0}
    assert torch.equal(backward.index_view(base, spec, ref), merged)


def test_unsupported_backward_says_why():
    """A backward that needs what the generator cannot compute (a strided slice's gradient interleaves zeros:
    a scatter in place): no kernel, a reason, and the site's original ops run."""
    fn = lambda x: torch.cat([x[..., 1::2] * 2, x[..., ::2]], -1).neg()  # noqa: E731
    _, t = trainable(fn, [torch.randn(3, 8)])
    bw = t.backward_for([torch.randn(3, 8, requires_grad=True)])
    assert not bw.validated and bw.reason.startswith("no backward:"), bw.reason


class TinyViT(torch.nn.Module):
    """A ViT built from torch only (no timm here): patch conv, class token, pre-norm blocks with
    nn.MultiheadAttention and a GELU MLP, final LayerNorm, a head on the class token."""

    class Block(torch.nn.Module):
        def __init__(self, d: int, heads: int):
            super().__init__()
            self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
            self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

        def forward(self, x):
            y = self.norm1(x)
            x = x + self.attn(y, y, y, need_weights=False)[0]
            return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))

    def __init__(self, d: int = 64, heads: int = 4, depth: int = 2, patch: int = 8, side: int = 32):
        super().__init__()
        self.patch = torch.nn.Conv2d(3, d, patch, patch)
        self.cls = torch.nn.Parameter(torch.zeros(1, 1, d))
        self.pos = torch.nn.Parameter(torch.randn(1, (side // patch) ** 2 + 1, d) * 0.02)
        self.blocks = torch.nn.Sequential(*[self.Block(d, heads) for _ in range(depth)])
        self.norm, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, 10)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


def tiny(name: str):
    """(model, example inputs): a tiny suite model with random weights; dropout off so that patched and eager
    runs see the same masks. HF models take input_ids (and train on them as labels), the ViT images."""
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    if name == "vit":
        return TinyViT(), (torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)),)
    if name == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                             max_position_embeddings=128, use_cache=False))
    elif name == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))
    else:
        model = BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                           intermediate_size=128, vocab_size=256, hidden_dropout_prob=0.0,
                                           attention_probs_dropout_prob=0.0))
    return model, {"input_ids": ids}


def loss_of(model, example):
    if isinstance(example, tuple):
        return model(*example).float().pow(2).mean()
    return model(**example, labels=example["input_ids"]).loss


def train(model, example, steps: int) -> list:
    """Losses of `steps` SGD steps (not Adam: its update divides by the gradient's own size, so a gradient that
    is zero in exact arithmetic, the attention key bias's, would turn rounding noise into full-size steps)."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = loss_of(model, example)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# name: the patterns with a fused forward whose backward must be generated, validated and used (a matmul
# with a pointwise epilogue trains its epilogue so, the matmul by PyTorch; padded GEMMs have no derived
# backward: autograd differentiates their padded ops)
SUITE = {"llama": ["RMSNorm", "Residual add + RMSNorm", "Rotary embedding"],
         "gpt2": ["GELU", "Residual add + LayerNorm"],
         "bert": ["Residual add + LayerNorm", "LayerNorm", "linear epilogue (GELU, dense)"],  # the embeddings'
         # (add, add, LayerNorm), the layers' residual ones, the MLM head's LayerNorm, the intermediate GELU
         "vit": ["Residual add + LayerNorm", "linear epilogue (GELU, fc1)"]}


@pytest.mark.parametrize("name", list(SUITE))
def test_tiny_model_trains_through_fused_kernels_like_eager(name, tmp_path):
    """Every fused pattern of the suite's models but the padded GEMM trains through a generated, validated
    backward (a matmul's epilogue apart from its matmul): Llama's RMSNorm, residual add + RMSNorm and
    rotary embedding (slices: zero-padded gradients), GPT-2's tanh-GELU and residual add + LayerNorm,
    BERT's residual add + LayerNorm (whose training graph holds LayerNorm's unused mean/rstd outputs,
    which an inference pattern never does; the embeddings' position table broadcast over the batch) and
    its intermediate GELU epilogue, the ViT's; losses and weights as eager's."""
    import advisor

    model, example = tiny(name)
    twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = advisor.optimize(model, example, out=tmp_path, reuse=False, interpret=True, train=True)
    assert report.applied, str(report)
    patched = train(model, example, 6)
    eager = train(twin, example, 6)
    torch.testing.assert_close(torch.tensor(patched), torch.tensor(eager), rtol=1e-4, atol=1e-4)
    assert patched[-1] < patched[0]
    used = ag.summary()
    assert all(b["validated"] for b in used), [(b["pattern"], b["reason"]) for b in used]
    trained = {b["pattern"].split(" ", 1)[1].split(":")[0] for b in used if b["launches"] >= 6}  # every step
    assert trained == set(SUITE[name]), used
    assert not report.handle.fallbacks(), report.handle.fallbacks()  # every captured module trained fused
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4, msg=n)


def test_by_default_training_runs_the_original_forward(tmp_path):
    """Without `train=True` a call needing gradients runs the original forward (eager's time and memory:
    the fused training path measured 0.79x eager on the H100's Llama), and no fused backward launches."""
    import advisor
    from advisor.patching import rewrite

    model, example = tiny("llama")
    twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = advisor.optimize(model, example, out=tmp_path, reuse=False, interpret=True)
    assert report.applied, str(report)
    before = rewrite.fused_runs()
    torch.testing.assert_close(torch.tensor(train(model, example, 2)), torch.tensor(train(twin, example, 2)))
    assert rewrite.fused_runs() == before
    report.handle.train_fused(True)  # asked for later: the same model trains fused from then on
    train(model, example, 1)
    assert rewrite.fused_runs() > before


class Rotate(torch.nn.Module):
    """A rotate-every-two + scale + residual (GPT-J's rotary layout): strided slices, whose gradient
    interleaves zeros, which no generated kernel computes (a contiguous half's does, see `rotary`)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16))

    def forward(self, x):
        return torch.cat([x[..., 1::2].neg(), x[..., ::2]], -1) * self.w + x


def test_a_pattern_without_a_backward_trains_at_eager_cost(tmp_path):
    """Only the weight needs a gradient: its backward (a column sum of g * rotated x) is generated and used.
    Once the input needs one too, its strided slices' backward has no kernel: that call and every later one run the
    original forward, each counted in `fallbacks()`, with eager's gradients."""
    import advisor
    from advisor.patching.forward import NO_BACKWARD

    model = Rotate()
    twin = copy.deepcopy(model)
    x = torch.randn(4, 32, 16)
    report = advisor.optimize(model, (x,), out=tmp_path, reuse=False, interpret=True, train=True)
    assert report.applied, str(report)
    before = [b["launches"] for b in ag.summary() if b["validated"]]  # (optimize counts one training step of its own)
    model(x).pow(2).mean().backward()
    twin(x).pow(2).mean().backward()
    torch.testing.assert_close(model.w.grad, twin.w.grad, rtol=1e-5, atol=1e-5)
    assert [b["launches"] - n for b, n in zip([b for b in ag.summary() if b["validated"]], before)] == [1]
    assert not report.handle.fallbacks()
    xg = x.clone().requires_grad_()
    for _ in range(2):
        model(xg).pow(2).mean().backward()
    assert report.handle.fallbacks() == {"Rotate": {NO_BACKWARD: 2}}, report.handle.fallbacks()
    xt = x.clone().requires_grad_()
    twin(xt).pow(2).mean().backward()
    twin(xt).pow(2).mean().backward()
    torch.testing.assert_close(xg.grad, xt.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused_ms, peaks, kept, allowed",
                         [(8.0, None, True, 0.0), (10.0, None, False, 0.0), (8.0, (100, 150), False, 0.0),
                          (8.0, (100, 102), False, 0.0), (8.0, (100, 102), True, 0.01)],
                         ids=["faster", "not-faster", "heavier", "heavier-by-2%", "heavier-by-2%-allowed"])
def test_fused_training_is_kept_only_where_a_whole_call_measures_faster_and_no_heavier(
        monkeypatch, tmp_path, fused_ms, peaks, kept, allowed):
    """`optimize(train=True)` on a GPU times a training call (forward + backward) through the fused path and
    through the original forwards, interleaved, with each one's peak memory: fused training stays only when
    faster and no heavier (beyond what `train_memory` allows), else training runs the original forwards, and a
    refusal for memory alone names the `train_memory` that would keep it. The clocks and the memory probe are
    stood in for here; the states they time, the model's modes and the user's gradients are real."""
    import advisor
    from advisor.measure.timing import Timing
    from advisor.patching import rewrite
    from advisor.workflows import training

    model, example = tiny("llama")
    twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = advisor.optimize(model, example, out=tmp_path, reuse=False, interpret=True, train=True,
                                  select=False)
    model.eval()
    grads = {n: torch.full_like(p, 0.5) for n, p in model.named_parameters()}  # the user's, mid-accumulation
    for n, p in model.named_parameters():
        p.grad = grads[n]
    ran = []

    def time_configs(call, configs, device, iters=20, rounds=5):
        for name, make in configs.items():
            with make():
                before = rewrite.fused_runs()
                call()
                ran.append((name, rewrite.fused_runs() > before))
        ms = {"original": 9.0, "fused": fused_ms}
        return {k: Timing(ms[k], 5, "perf_counter", [ms[k]] * 5, 0.0, [ms[k]] * 5) for k in configs}

    monkeypatch.setattr(training.timing, "timing_meaningful", lambda device: True)
    monkeypatch.setattr(training.timing, "time_configs", time_configs)
    if peaks:
        it = iter(peaks)
        monkeypatch.setattr(training, "peak_bytes", lambda step, device: (step(), next(it))[1])
    out = training.keep_faster_training(model, report.handle, (), example, "cpu", allowed=allowed)
    assert out["kept"] == kept, out
    assert ran == [("original", False), ("fused", True)]  # each state ran as its name says
    assert ("fused training kept" in out["decision"]) == kept, out["decision"]
    if peaks and not kept:
        assert "heavier in memory" in out["decision"]
        need = "0.01" if peaks[1] == 102 else "0.49"  # 2% heavier, 1% of it the allocator's rounding
        assert f"train_memory={need})" in out["decision"], out["decision"]
    assert not any(m.training for m in model.modules())  # left as found: eval mode, the user's gradients
    assert all(p.grad is grads[n] for n, p in model.named_parameters())
    assert not report.handle.fallbacks(), report.handle.fallbacks()  # its own unfused calls are not the user's
    for p in model.parameters():
        p.grad = None
    before = rewrite.fused_runs()
    torch.testing.assert_close(torch.tensor(train(model, example, 3)), torch.tensor(train(twin, example, 3)),
                               rtol=1e-4, atol=1e-4)
    assert (rewrite.fused_runs() > before) == kept


def test_the_training_comparison_leaves_the_model_and_inputs_as_it_found_them(monkeypatch):
    """The comparison trains (train mode, BatchNorm statistics move, gradients accumulate, dropout draws
    random numbers) but hands back the modes, buffers, gradients (the parameters' and an input's that
    collects one), `requires_grad` flags and RNG state it found; a frozen model is compared with its
    parameters trainable; a call with nothing that could need a gradient is not compared."""
    from advisor.measure.timing import Timing
    from advisor.workflows import training

    class Handle:  # the one thing the comparison asks of a patched model's handle
        def __init__(self):
            self.states = []

        def train_fused(self, on):
            self.states.append(on)

    def time_configs(call, configs, device, iters=20, rounds=5):
        for make in configs.values():
            with make():
                call()
        return {k: Timing(1.0, 1, "perf_counter", [1.0], 0.0, [1.0]) for k in configs}

    monkeypatch.setattr(training.timing, "timing_meaningful", lambda device: True)
    monkeypatch.setattr(training.timing, "time_configs", time_configs)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5)).eval()
    x = torch.randn(4, 8, requires_grad=True)
    x.grad = torch.ones(4, 8)
    model[0].weight.grad = torch.full((8, 8), 2.0)
    stats = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    handle = Handle()
    out = training.keep_faster_training(model, handle, (x,), {}, "cpu")
    assert not out["kept"] and "not faster" in out["decision"]  # equal clocks
    assert handle.states[-1] is False and True in handle.states  # both states ran; the slower one is not kept
    assert not any(m.training for m in model.modules())
    assert torch.equal(x.grad, torch.ones(4, 8)) and torch.equal(model[0].weight.grad, torch.full((8, 8), 2.0))
    assert model[0].bias.grad is None
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), stats))
    assert torch.equal(torch.get_rng_state(), rng)
    # handed over frozen (an inference-built model its loop unfreezes later): compared as it will train,
    # its parameters trainable for the comparison only
    probe = Handle()
    frozen = training.keep_faster_training(model.requires_grad_(False), probe, (x.detach(),), {}, "cpu")
    fused_state_ran = True in probe.states  # train_fused(True) was among the states compared
    assert fused_state_ran and "made trainable for the comparison" in frozen["decision"], frozen
    assert not any(p.requires_grad for p in model.parameters())
    assert all(p.grad is None for p in model.parameters() if p is not model[0].weight)
    # nothing that could need a gradient: not compared
    nothing = training.keep_faster_training(torch.nn.ReLU(), Handle(), (x.detach(),), {}, "cpu")
    assert not nothing["kept"] and "needs a gradient" in nothing["decision"]


def test_a_site_reading_outside_its_input_view_is_not_substituted_where_the_graph_trains(tmp_path):
    """GPT-NeoX's partial rotary: the matched ops can bind their input to the pass-through slice of q and
    read the rotated slice before it (a kernel reads memory, so the inference site is right). Under
    autograd the gradient of what lies outside the site's input view had nowhere to go: the first training
    call's gradients were wrong (up to 0.07 on the layer input). Such a match now keeps its original ops
    in a graph that trains; every step's gradients are eager's."""
    import sys
    from pathlib import Path

    import advisor
    from advisor.patching.capture import READS_OUTSIDE

    sys.path.insert(0, str(Path(__file__).parent))
    from zoo_models import BY_NAME

    arch = BY_NAME["gpt_neox"]
    model = arch.model()
    twin = copy.deepcopy(model)
    inputs = arch.inputs(*arch.example)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = advisor.optimize(model, inputs, out=tmp_path, reuse=False, interpret=True, train=True)
    assert report.applied, str(report)
    model.train(), twin.train()
    for _ in range(2):
        for m in (model, twin):
            m(**inputs).logits.float().pow(2).mean().backward()
        for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=n)
        model.zero_grad(), twin.zero_grad()
    rejected = [why for f in report.handle.forwards.values() for whys in f.log().rejected.values() for why in whys]
    assert READS_OUTSIDE in rejected


@pytest.mark.parametrize("view, rel, whole, inside", [
    (((2, 4, 16, 4), (3072, 48, 192, 1)), -4, ((2, 4, 16, 12), (3072, 48, 192, 1)), False),  # rotated half before
    (((2, 4, 16, 4), (3072, 48, 192, 1)), 0, ((2, 4, 16, 16), (3072, 48, 192, 1)), True),  # the pass-through input,
    (((2, 4, 16, 12), (3072, 48, 192, 1)), 4, ((2, 4, 16, 16), (3072, 48, 192, 1)), True),  # both halves of a head
    (((2, 4, 16, 13), (3072, 48, 192, 1)), 4, ((2, 4, 16, 16), (3072, 48, 192, 1)), False),  # one column past the end
    (((4, 32, 8), (512, 16, 2)), 1, ((4, 32, 16), (512, 16, 1)), True),  # x[..., 1::2]
    (((4, 32, 9), (512, 16, 2)), 0, ((4, 32, 16), (512, 16, 1)), False),  # a step past the end
    (((26, 13), (13, 1)), 0, ((2, 13, 13), (169, 13, 1)), True),  # a flattened read of a contiguous input
    (((26, 13), (13, 1)), 13, ((2, 13, 13), (169, 13, 1)), False),  # ... one row too far
    (((5, 24), (0, 1)), 0, ((24,), (1,)), True),  # a broadcast read
], ids=["before", "first-half", "second-half", "past-end", "step-2", "step-past-end", "flattened", "flattened-past",
        "broadcast"])
def test_view_inside(view, rel, whole, inside):
    from advisor.patching.rewrite import view_inside

    assert view_inside(*view, rel, *whole) == inside


@pytest.mark.parametrize("recordable", [True, False], ids=["replayed", "not-recordable"])
def test_a_site_inside_a_replayed_layer_is_timed_by_its_gpu_work(monkeypatch, recordable):
    """Inside a layer whose training graphs are replayed from CUDA graphs the host's time does not count: each
    variant (fused, original) is recorded REPLAYED_CALLS times in one graph and its replays timed, per call.
    A variant that cannot be recorded is timed as its calls run. (The clock and the recording are stood in
    for: the Function, the original ops and their backward run for real.)"""
    from advisor.patching import rewrite

    ran = []

    def replayed(fn):
        if not recordable:
            raise RuntimeError("operation not permitted when stream is capturing")
        fn()
        ran.append("recorded")
        return lambda: ran.append("replay")

    monkeypatch.setattr(ag, "_replayed", replayed)
    monkeypatch.setattr(ag, "time_call", lambda fn, device, **kw: (fn(), type("T", (), {"median_ms": 8.0}))[1])
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g), torch.randn(32, generator=g)]
    prog = record_program(add_rms, *xs)
    run = ag.module_forward(load_module(generate(prog).path).run, prog)
    bw = ag.build(prog, ag.Trainable(prog, run).key([x.clone().requires_grad_() for x in xs]), xs[0].device, run)
    assert bw.validated, bw.reason
    with rewrite.recording_replayed_graph():
        fused_ms, eager_ms = ag.time_both(run, add_rms, bw, xs, (True, True, True))
    per = ag.REPLAYED_CALLS if recordable else 1
    assert fused_ms == eager_ms == 8.0 / per
    assert bw.timed_by == ("CUDA-graph replays" if recordable else "calls (not recordable: RuntimeError)")
    assert ("replay" in ran) == recordable and not rewrite.in_replayed_graph()


def test_a_model_handed_over_in_training_mode_with_dropout_is_checked_in_eval_mode(tmp_path):
    """A training user calls `optimize(model, batch, train=True)` on a model in training mode: its dropout
    drew a new mask per call, so the patched-vs-unpatched check saw every pattern differ and nothing was
    patched. optimize now profiles, checks and times it in eval mode and hands the modes back."""
    import advisor
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                       intermediate_size=128, vocab_size=256)).train()  # dropout 0.1
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = advisor.optimize(model, {"input_ids": ids}, out=tmp_path, reuse=False, interpret=True,
                                  train=True, select=False)
    assert report.applied, str(report)
    assert report.check["ok"] and not report.check["dropped"], report.check
    assert all(m.training for m in model.modules())  # the user's modes, as handed over
    assert report.modes and "eval mode" in str(report)
    loss = model(input_ids=ids, labels=ids).loss  # and it trains, dropout on, through the patched model
    loss.backward()
    assert torch.isfinite(loss) and model.bert.embeddings.word_embeddings.weight.grad is not None


def test_random_ops_no_module_type_shows_are_found_in_the_call():
    """OPT and many HF models call `F.dropout(x, p, training=self.training)`, SegFormer's drop path draws
    `torch.rand`: no module type shows them, so the ops one call runs decide (the registry's random ops);
    a deterministic model in training mode is left as it is."""
    from advisor.patching.verify import eval_if_unrepeatable

    class Functional(torch.nn.Module):
        def __init__(self, p, drop_path=False):
            super().__init__()
            self.lin, self.p, self.drop_path = torch.nn.Linear(8, 8), p, drop_path

        def forward(self, x):
            h = self.lin(x)
            if self.drop_path and self.training:  # stochastic depth: a whole sample's branch kept or dropped
                keep = torch.floor(1 - self.p + torch.rand(x.shape[0], 1, dtype=x.dtype, device=x.device))
                return x + h / (1 - self.p) * keep
            return torch.nn.functional.dropout(h, self.p, training=self.training)

    x = torch.randn(4, 8)
    for p, drop_path, switched in ((0.5, False, True), (0.1, True, True), (0.0, False, False)):
        model = Functional(p, drop_path).train()
        with eval_if_unrepeatable(model, lambda: model(x)) as note:
            assert bool(note) == switched and model.training != switched, (p, drop_path)
            assert torch.equal(model(x), model(x))  # repeatable inside, either way
        assert model.training  # handed back as found


def test_a_matmul_epilogue_splits_into_pytorchs_matmul_and_a_fused_tail():
    """SwiGLU (silu(x @ W^T) * up): the linear by PyTorch, the tail a program of its own reading the
    matmul's output and `up`; a matmul whose own output is returned, or whose epilogue holds a row op,
    is not split (it keeps its original ops under autograd)."""
    import torch.nn.functional as F

    from advisor.patching.epilogue import split
    from advisor.patching.program import run_program

    x, w, up = torch.randn(3, 5, 8), torch.randn(12, 8), torch.randn(3, 5, 12)
    prog = record_program(lambda x, w, up: F.silu(F.linear(x, w)) * up, x, w, up)
    anchor, tail, sources = split(prog)
    assert [n["op"] for n in anchor["nodes"]] == ["aten::mm"]  # (as recorded: the linear's matmul over flattened rows)
    assert [n["op"] for n in tail["nodes"]] == ["aten::silu", "aten::mul"]
    assert sources == [("input", 2), ("anchor", 0)]
    assert anchor["reads"] == [0, 1]  # x and W: the matmul's operands
    (a,) = run_program(anchor, (x, w))
    (out,) = run_program(tail, [(x, w, up)[i] if k == "input" else a for k, i in sources])
    torch.testing.assert_close(out, F.silu(F.linear(x, w)) * up)
    assert split(record_program(lambda x, w: (F.linear(x, w), F.gelu(F.linear(x, w))), x, w)) is None
    assert split(record_program(lambda x, w: torch.softmax(F.linear(x, w), -1), x, w)) is None


def test_an_epilogue_that_does_not_generate_keeps_the_sites_original_ops(monkeypatch):
    """The tail is generated and validated at the first call that trains; where that fails the site runs
    its original ops (None), says why, and does not try again."""
    import torch.nn.functional as F

    from advisor.codegen import Unsupported
    from advisor.patching import epilogue

    x, w = torch.randn(4, 8), torch.randn(6, 8, requires_grad=True)
    prog = record_program(lambda x, w: F.gelu(F.linear(x, w)), x, w)
    tries = []

    def refuse(program, *a, **k):
        tries.append(program)
        raise Unsupported("planted")

    monkeypatch.setattr("advisor.codegen.generate", refuse)
    site = epilogue.EpilogueTrainable(epilogue.split(prog), "c1 test")
    assert site((x, w)) is None and site((x, w)) is None
    assert len(tries) == 1 and "planted" in site.reason


def test_attention_with_its_own_dropout_is_found_by_its_argument():
    """Fused attention draws its dropout inside the kernel (`dropout_p` in training mode): no random op
    runs, the argument says it. An op of that signature with dropout_p 0 is deterministic."""
    from advisor.patching.verify import draws_random

    @torch.library.custom_op("advisor_test::attention", mutates_args=())
    def attention(q: torch.Tensor, dropout_p: float) -> torch.Tensor:
        return q.clone()

    q = torch.randn(2, 3)
    assert draws_random(lambda: torch.ops.advisor_test.attention(q, 0.1)) == "advisor_test::attention"
    assert draws_random(lambda: torch.ops.advisor_test.attention(q, 0.0)) is None


def test_the_training_check_computes_its_loss_in_float32_as_a_real_step_does():
    """The check's training call ends in a float32 loss over the outputs (their dot product with fixed random
    weights), as a real step's loss is computed (HF's LMs upcast the logits before cross-entropy): those float32
    copies, made while every activation is alive, are where eager's step peaks, and a check without them judged
    Llama's fused training heavier where the training loop measured it 0.59 GB lighter. The gradients are those
    of a backward from the weights themselves."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from advisor.workflows import training

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 64)).to(torch.bfloat16)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    step = training.training_call(model, (x,), {})

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor):
                self.seen.append((tuple(out.shape), out.dtype))
            return out

    with Casts() as casts:
        step()
    assert ((8, 64), torch.float32) in casts.seen  # the output, upcast for the loss
    step()  # the step leaves no gradient behind (as zero_grad does): recompute them by hand to compare
    with torch.enable_grad():
        out = model(x)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=out.dtype)
        loss = (out.float() * weights.float()).sum()
        got = torch.autograd.grad(loss, list(model.parameters()))
        want = torch.autograd.grad(model(x), list(model.parameters()), weights)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("bad", [-0.1, 5, "5%", True, None])
def test_train_memory_out_of_range_is_one_clear_error(bad):
    """`train_memory` is a fraction of the original forwards' peak: anything else is refused in one line, before
    any work (5 would be 500%, a user meaning 5%)."""
    import advisor
    from advisor.errors import AdvisorError

    with pytest.raises(AdvisorError, match=r"train_memory .* fraction from 0 to 1 .*got") as e:
        advisor.optimize(torch.nn.Linear(2, 2), (torch.randn(1, 2),), train=True, train_memory=bad)
    assert "\n" not in str(e.value)


def test_a_whole_stack_capture_switched_on_trains_as_one_graph_like_eager(tmp_path, monkeypatch):
    """Where selection handed the model back with its whole stack as one capture (`set_outer`), training calls
    go through that capture too (on a GPU: one forward and one backward replay for the stack, not one per
    layer with the host's work between them): losses and weights as eager's, the layers' own captures
    making no training graph."""
    import advisor
    from advisor.patching import capture
    from advisor.patching.causal_masks import fold_causal_masks

    model, example = tiny("llama")
    twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = advisor.optimize(model, example, out=tmp_path, reuse=False, interpret=True, train=True)
    handle = report.handle
    assert handle.outer, "the tiny Llama's decoder stack has an outer capture"
    handle.set_outer(True)
    captures = {q: f._backend.captures for q, f in handle.forwards.items() if f._backend is not None}
    folded = []
    monkeypatch.setattr(capture, "fold_causal_masks", lambda g: folded.append(fold_causal_masks(g)) or folded[-1])
    patched = train(model, example, 4)
    eager = train(twin, example, 4)
    torch.testing.assert_close(torch.tensor(patched), torch.tensor(eager), rtol=1e-4, atol=1e-4)
    after = {q: f._backend.captures for q, f in handle.forwards.items() if f._backend is not None}
    outer = [q for q, f in handle.forwards.items() if f.outer]
    assert all(after[q] > captures.get(q, 0) for q in outer), (captures, after)  # the stack's training graph
    assert all(after[q] == captures[q] for q in captures if q not in outer), (captures, after)
    assert not handle.fallbacks(), handle.fallbacks()
    # HF builds the causal mask from positions while dynamo traces the stack: both layers' attention runs causal
    # without it (`patching.causal_masks`), as it does with the mask HF skips outside a capture
    assert 2 in folded, folded
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4, msg=n)


def test_a_training_capture_that_fails_leaves_the_inference_capture_in_use(tmp_path, monkeypatch):
    """A capture failing for a training call (the whole stack's, say) sends training calls to the original
    forward; inference calls keep the capture that served them."""
    import advisor
    from advisor.patching import capture

    model, example = tiny("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = advisor.optimize(model, example, out=tmp_path, reuse=False, interpret=True, train=True)
    handle = report.handle
    handle.set_outer(True)
    with torch.no_grad():
        model(**example)  # the whole stack's inference capture
    stack = next(f for f in handle.forwards.values() if f.outer)

    def broken(self, gm, example_inputs):
        raise RuntimeError("planted")

    monkeypatch.setattr(capture.Backend, "training", broken)
    model.train()
    with pytest.warns(RuntimeWarning, match="could not train fused"):
        loss_of(model, example).backward()
    assert stack.failed is None and not stack.trains
    assert any("training capture failed" in why for why in stack.fallbacks), stack.fallbacks
    fallbacks, ran = dict(stack.fallbacks), capture.graphs_run()
    with torch.no_grad():
        model(**example)
    assert capture.graphs_run() > ran and stack.fallbacks == fallbacks  # the stack's inference capture ran it
