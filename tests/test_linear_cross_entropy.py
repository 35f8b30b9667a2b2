"""Linear + cross-entropy without the logits (issue 19): `advisor.kernels.linear_cross_entropy` (its Triton
loss-and-gradient kernel in the interpreter here) against eager, and an HF causal LM trained through it."""
from __future__ import annotations

import copy

import pytest
import torch

from advisor.kernels import linear_cross_entropy as lce

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def operands(N, D, V, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g) / D ** 0.5
    b = torch.randn(V, generator=g) if bias else None
    labels = torch.randint(0, V, (N,), generator=g)
    labels[3] = labels[10:14] = -100  # ignored rows: no loss, no gradient
    return hidden, weight, b, labels


def loss_and_grads(fn, hidden, weight, bias, labels, dtype, divisor=None):
    xs = [t.to(dtype).requires_grad_() if t is not None else None for t in (hidden, weight, bias)]
    loss = fn(*xs, labels, -100, divisor)
    grads = torch.autograd.grad(loss * 1.7, [x for x in xs if x is not None])  # the incoming gradient scales them
    return loss, grads


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("divisor", [None, 23.0])
def test_matches_eager_on_odd_shapes(bias, divisor, monkeypatch):
    """N = 37 rows in chunks of 8 (the last one short), V = 101 over 64-wide column blocks, D = 24."""
    monkeypatch.setattr(lce, "MIN_CHUNK_ROWS", 8)  # several chunks at this size (GPU shapes take 2048 rows a chunk)
    xs = operands(37, 24, 101, bias)
    assert lce.chunk_rows(37, 101, 24) == 8
    loss, got = loss_and_grads(lce.LinearCrossEntropyFunction.apply, *xs, torch.float32, divisor)
    ref, want = loss_and_grads(lce.linear_cross_entropy_reference, *xs, torch.float32, divisor)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert (got[0][[3, 10, 11, 12, 13]] == 0).all()


def test_bf16_within_tolerance_of_fp64():
    xs = operands(29, 32, 77, True, seed=1)
    loss, got = loss_and_grads(lce.LinearCrossEntropyFunction.apply, *xs, torch.bfloat16)
    ref, want = loss_and_grads(lce.linear_cross_entropy_reference, *xs, torch.float64)
    assert loss.dtype == torch.float32 and abs(loss.item() - ref.item()) < 1e-2 * abs(ref.item())
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16
        assert (a.double() - b).norm() / b.norm() < 2e-2


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128, vocab_size=200,
                                        max_position_embeddings=128, use_cache=False))


def test_hf_causal_lm_trains_like_eager_without_the_logits(monkeypatch):
    from test_splade_training import Allocations

    monkeypatch.setattr(lce, "MIN_CHUNK_ROWS", 8)  # 32 rows in chunks: never N x V at once

    model = tiny_llama()
    twin = copy.deepcopy(model)
    lce.fused_causal_lm_loss(model)
    V = 200  # N x V x 4 bytes = 25600: no other tensor here has that size (the MLP's 128 x 64 would collide with 256)
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    N = ids.numel()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin)]
    for step in range(3):
        losses = []
        for m, opt in zip((model, twin), opts):
            with Allocations() as seen:
                out = m(input_ids=ids, labels=ids)
                out.loss.backward()
            losses.append(out.loss.item())
            fused = m is model
            assert (N * V * 4 in seen.sizes) is not fused  # eager holds the fp32 logits, the fused loss never does
            logits = out.logits  # the fused output's computed now, at the first read: eager's values
            if fused:
                fused_logits = logits
            else:
                torch.testing.assert_close(fused_logits, logits, rtol=1e-4, atol=1e-5)
            if fused:
                grads = {n: p.grad.clone() for n, p in m.named_parameters()}
            else:
                for n, p in m.named_parameters():
                    torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)
            opt.step()
            opt.zero_grad()
        assert abs(losses[0] - losses[1]) < 1e-5, losses
    with torch.no_grad():  # no gradients wanted: the original forward, logits and all
        assert model(input_ids=ids, labels=ids).logits.shape == (2, 16, V)


def test_heads_that_rescale_logits_are_refused():
    model = tiny_llama()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="changed after the projection"):
        lce.fused_causal_lm_loss(model)


def test_logits_are_computed_only_when_read_and_train_as_eagers():
    """The fused loss's output: loss by attribute, key and index without the head running again; logits at
    the first read (attribute, key, index, iteration), in eager's order and values, and a loss over them
    backpropagates as eager's does; read after an optimizer step, they say so."""
    model = tiny_llama()
    twin = copy.deepcopy(model)
    lce.fused_causal_lm_loss(model)
    heads = []
    model.lm_head.register_forward_hook(lambda *a: heads.append(1))
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    out, ref = model(input_ids=ids, labels=ids), twin(input_ids=ids, labels=ids)
    assert out.loss is out["loss"] is out[0] and not heads
    assert list(out.keys()) == list(ref.keys()) == ["loss", "logits"] and len(heads) == 1
    assert out[1] is out.logits is out["logits"] and len(heads) == 1
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-5)
    assert [t.shape for t in out.to_tuple()] == [t.shape for t in ref.to_tuple()]
    (out.loss + out.logits.pow(2).mean()).backward()
    (ref.loss + ref.logits.pow(2).mean()).backward()
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=n)
    late = model(input_ids=ids, labels=ids)
    late.loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    with pytest.warns(RuntimeWarning, match="after its head's weights changed"):
        late.logits
    assert model(input_ids=ids, labels=ids, return_dict=False)[1].shape == (2, 16, 200)  # asked for a tuple: eager's
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast decides the head's dtype per call: eager's loss
        assert type(model(input_ids=ids, labels=ids)).__name__ != "LazyLogits"


def test_the_fused_loss_goes_with_unpatch_copies_and_pickles_with_its_model():
    import io
    import weakref

    import advisor

    model = lce.fused_causal_lm_loss(tiny_llama())
    twin = copy.deepcopy(model)
    assert twin.forward.model is twin  # the copy's loss runs the copy, not the original
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.forward.model is loaded
    assert advisor.unpatch(model) == 1 and "forward" not in model.__dict__
    gone = weakref.ref(twin)
    del twin
    assert gone() is None  # held weakly: freed without a garbage collection
