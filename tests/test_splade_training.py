"""The SPLADE head in training (issue 19): `advisor.kernels.splade_head`'s Function (real Triton kernels, in
the interpreter here) gives eager's output and gradients without ever allocating the B x L x V logits;
its validation catches a planted wrong backward; a patched BERT MLM head + max-pool trained with
`optimize(..., train=True)` gets eager's gradients through it."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from advisor.kernels import splade_head as sh
from advisor.patching import splade

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def _fresh(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path_factory.getbasetemp() / "kernel-cache"))
    monkeypatch.setattr(splade, "_RECORDS", {})  # every test validates afresh


def inputs(B, L, D, V, dtype=torch.float32, bias=True, seed=0):
    """Continuous draws (no two chain values tie), about half the logits positive, batch row 1 fully masked."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, L, D, generator=g)
    weight = torch.randn(V, D, generator=g) / D ** 0.5
    b = torch.randn(V, generator=g) * 0.5 if bias else None
    mask = (torch.rand(B, L, generator=g) > 0.3).float()
    mask[1] = 0.0
    return [t.to(dtype) if t is not None else None for t in (hidden, weight, b)] + [mask.to(dtype)[..., None]]


def grads(fn, xs, gout, needs=(True, True, True)):
    leaves = [x.detach().clone().requires_grad_(n) if x is not None else None for x, n in zip(xs[:3], needs)]
    out = fn(*leaves, xs[3])
    want = [t for t, n in zip(leaves, needs) if n and t is not None]
    return out, torch.autograd.grad(out, want, gout)


@pytest.mark.parametrize("bias,bucketed", [(True, True), (False, True), (True, False)])
def test_function_matches_eager_on_odd_shapes(bias, bucketed, monkeypatch):
    """L = 19 and V = 37 leave a tail in every tile (the interpreter's tiles are 16-32 wide); D = 24 too.
    dhidden walks each sequence tile's own columns (bucketed, what L > BLOCK_L gets) or every column."""
    config = sh.dhidden_config
    monkeypatch.setattr(sh, "dhidden_config", lambda *a: dict(config(*a), BUCKETED=bucketed))
    xs = inputs(3, 19, 24, 37, bias=bias)
    gout = torch.randn(3, 37, generator=torch.Generator().manual_seed(1))
    out, got = grads(sh.SpladeHeadFunction.apply, xs, gout)
    ref, want = grads(sh.splade_head_reference, xs, gout)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert len(got) == (3 if bias else 2)
    for a, b, name in zip(got, want, ("hidden", "weight", "bias")):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    assert (got[0][1] == 0).all()  # the fully masked row gets no gradient, as under eager's amax


def test_function_in_bf16_is_closer_to_fp64_than_tolerance():
    xs = inputs(2, 21, 32, 45, torch.bfloat16)
    gout = torch.randn(2, 45, generator=torch.Generator().manual_seed(1))
    out, got = grads(sh.SpladeHeadFunction.apply, xs, gout.bfloat16())
    xs64 = [x.double() if x is not None else None for x in xs]
    ref, want = grads(sh.splade_head_reference, xs64, gout.double())
    assert out.dtype == torch.bfloat16 and all(t.dtype == torch.bfloat16 for t in got)
    for a, b in zip([out, *got], [ref, *want]):
        assert (a.double() - b).norm() / b.norm() < 2e-2


def test_only_the_gradients_asked_for():
    xs = inputs(2, 9, 16, 20)
    gout = torch.randn(2, 20)
    (dw,) = grads(sh.SpladeHeadFunction.apply, xs, gout, needs=(False, True, False))[1]
    (want,) = grads(sh.splade_head_reference, xs, gout, needs=(False, True, False))[1]
    torch.testing.assert_close(dw, want, rtol=1e-5, atol=1e-5)


def test_ties_at_zero_give_eager_gradient():
    """The one place ties are common: a column whose logits are all <= 0 (or a fully masked row) has max 0
    at every position. Eager splits the gradient among them, the kernel gives it to the first; both are 0
    because relu's derivative there (and a masked position's) is 0. Strictly positive ties would differ
    (eager averages the tied rows): continuous data never has them, see the module's docstring."""
    hidden, weight, bias, mask = inputs(2, 11, 16, 24)
    bias = bias.clone()
    bias[:5] = -100.0  # columns 0-4: every logit negative, every position ties at 0
    xs = [hidden, weight, bias, mask]
    gout = torch.randn(2, 24)
    out, got = grads(sh.SpladeHeadFunction.apply, xs, gout)
    ref, want = grads(sh.splade_head_reference, xs, gout)
    assert (ref[:, :5] == 0).all()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert (got[1][:5] == 0).all() and (got[2][:5] == 0).all()


PROGRAM_SHAPES = (2, 13, 32, 101)  # B, L, D, V: B*L*V = 2626 is no other tensor's size here


def head_program(B, L, D, V, dtype=torch.float32):
    from advisor.codegen.record import record_program

    xs = inputs(B, L, D, V, dtype)
    return record_program(lambda h, w, b, m: torch.amax(torch.log1p(torch.relu(torch.nn.functional.linear(h, w, b)))
                                                        * m, dim=1), *xs), xs


def test_the_head_program_is_recognised_and_others_are_not():
    prog, _ = head_program(*PROGRAM_SHAPES)
    roles = splade.head_roles(prog)
    assert roles == splade.HeadRoles(hidden=0, weight=1, bias=2, mask=3)
    from advisor.codegen.record import record_program

    xs = inputs(*PROGRAM_SHAPES)
    other = record_program(lambda h, w, b, m: torch.amax(torch.log1p(torch.relu(torch.nn.functional.linear(h, w, b)))
                                                         * m, dim=2), *xs)  # a max over the vocabulary
    assert splade.head_roles(other) is None


def test_the_traced_candidate_is_recognised():
    """What `optimize` patches: the matmul_reduction candidate the analyzer finds in a profiled SPLADE head
    (aten::linear as the trace records it, the mask as a B x L x 1 view), and none of its sub-chains."""
    from pathlib import Path

    from advisor.analysis.api import analyze

    doc = analyze(Path(__file__).resolve().parents[1] / "sample_traces" / "cpu" / "splade").doc
    found = {c["kind"]: splade.head_roles(c["program"]) for c in doc["candidates"]}
    assert found.pop("matmul_reduction") == splade.HeadRoles(hidden=0, weight=1, bias=2, mask=3)
    assert set(found.values()) == {None}


def test_planted_wrong_backward_is_caught(monkeypatch):
    """A forward that records each winner one position late (a forgotten tile offset, say): output right,
    gradients wrong. Validation rejects it, and the site's trainable answers None (eager's ops run)."""
    prog, xs = head_program(*PROGRAM_SHAPES)
    t = splade.SpladeTrainable(prog, splade.head_roles(prog), "splade")
    leaves = [x.clone().requires_grad_() for x in xs[:3]] + [xs[3]]
    assert t.record_for(*leaves).validated  # the real kernels validate

    real = sh.splade_head_forward

    def off_by_one(hidden, weight, bias, mask):
        out, winner, slope = real(hidden, weight, bias, mask)
        return out, (winner + 1).clamp(max=hidden.shape[1] - 1), slope

    monkeypatch.setattr(sh, "splade_head_forward", off_by_one)
    monkeypatch.setattr(splade, "_RECORDS", {})
    rec = t.record_for(*leaves)
    assert not rec.validated and "grad of hidden" in rec.reason, rec.reason
    assert t(leaves) is None


class Allocations:
    """The byte sizes of the CPU allocations made inside the block (the profiler's memory events: it sees the
    allocator, so unlike a TorchDispatchMode it leaves dynamo's capture alone)."""

    def __enter__(self):
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        self.prof.__exit__(*exc)
        self.sizes = {e.cpu_memory_usage for e in self.prof.events() if e.cpu_memory_usage > 0}


class BertSplade(torch.nn.Module):
    """transformers' BERT MLM head (dense, GELU, LayerNorm, decoder to the vocabulary) and SPLADE's max-pool."""

    def __init__(self, D, V):
        super().__init__()
        from transformers import BertConfig
        from transformers.models.bert.modeling_bert import BertOnlyMLMHead

        torch.manual_seed(0)
        self.mlm = BertOnlyMLMHead(BertConfig(hidden_size=D, num_attention_heads=2, intermediate_size=2 * D,
                                              vocab_size=V))

    def forward(self, hidden, mask):
        return torch.amax(torch.log1p(torch.relu(self.mlm(hidden))) * mask.unsqueeze(-1), dim=1)


def step(model, hidden, mask, opt):
    """A SPLADE training step: the FLOPS regulariser (squared mean activation per vocabulary entry) as the loss."""
    h = hidden.clone().requires_grad_()
    loss = model(h, mask).mean(0).pow(2).sum()
    loss.backward()
    # (this transformers' head also holds an unused `predictions.bias`: no gradient in either model)
    grads = [h.grad] + [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    return loss.item(), grads


def test_patched_bert_splade_head_trains_like_eager_without_the_logits(tmp_path):
    import advisor
    from advisor.patching import autograd as ag
    from advisor.patching import rewrite

    B, L, D, V = PROGRAM_SHAPES
    model = BertSplade(D, V)
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    hidden, mask = torch.randn(B, L, D, generator=g), (torch.rand(B, L, generator=g) > 0.3).float()
    mask[1, 5:] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = advisor.optimize(model, (hidden, mask), out=tmp_path, reuse=False, interpret=True, train=True)
    assert any(p["title"].startswith("Matmul + reduction") for p in report.applied), str(report)
    model.train(), twin.train()
    opt, opt_twin = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin))
    fused = rewrite.fused_runs()
    launched = {b["program"]: b["launches"] for b in ag.summary()}  # (optimize counts a training step of its own)
    for _ in range(2):
        with Allocations() as seen:
            loss, got = step(model, hidden, mask, opt)
        want_loss, want = step(twin, hidden, mask, opt_twin)
        assert abs(loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss))
        assert [a is None for a in got] == [b is None for b in want]
        for a, b in zip(got, want):
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert B * L * V * 4 not in seen.sizes  # neither pass allocated the logits (nor anything of their size)
    assert rewrite.fused_runs() >= fused + 2
    (rec,) = [b for b in ag.summary() if b["program"] == "splade_head"]
    assert rec["validated"] and rec["launches"] - launched.get("splade_head", 0) == 2 and \
        rec["saved_bytes"] < rec["eager_saved_bytes"] / 10, rec
    assert not report.handle.fallbacks(), report.handle.fallbacks()
    with Allocations() as seen:  # the check itself can fail: the same step unpatched allocates the logits
        step(twin, hidden, mask, opt_twin)
    assert B * L * V * 4 in seen.sizes
