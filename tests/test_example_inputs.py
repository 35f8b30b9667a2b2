"""`optimize` never changes the example inputs it was handed: every call it makes with them (profiling, capture,
checks, selection's timing, the training check) runs on a fresh snapshot (`advisor.example_inputs`)."""
from __future__ import annotations

import pytest
import torch

import advisor
from advisor.example_inputs import snapshot

F = torch.nn.functional
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class EditsItsInput(torch.nn.Module):
    """A block that scales its input in place before using it, as some blocks do."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm = torch.nn.Linear(64, 64), torch.nn.LayerNorm(64)

    def forward(self, x):
        x.mul_(0.5)
        x += 1
        return self.norm(F.gelu(self.proj(x), approximate="tanh") + x)


def test_a_forward_editing_its_input_leaves_the_users_tensor_as_it_was(tmp_path):
    """Before: the example came back changed (by up to 5.5 here), and since each call saw the previous one's edits,
    the patched and unpatched calls were compared on different inputs and every pattern was dropped."""
    torch.manual_seed(0)
    model = EditsItsInput().eval()
    x = torch.randn(8, 64)
    kept = x.clone()
    report = advisor.optimize(model, (x,), out=tmp_path / "opt", reuse=False, interpret=True)
    assert torch.equal(x, kept)
    assert report.applied and not report.check["dropped"], report
    # the patched forward still edits its caller's tensor as the original does
    patched_input, original_input = kept.clone(), kept.clone()
    with torch.no_grad():
        out = model(patched_input)
        advisor.unpatch(model)
        want = model(original_input)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(patched_input, original_input)


def test_the_training_check_calls_on_snapshots_labels_included():
    """The training check's calls (its probe and each timed step) run on snapshots: an input requiring a gradient
    gets none, and labels a loss masks in place stay as handed over."""
    from advisor.workflows import training

    class MasksItsLabels(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 4)

        def forward(self, x, labels=None):
            x.mul_(2)
            logits = self.proj(x)
            if labels is None:
                return logits
            labels[labels == 0] = -100  # as some losses mask padding
            return type("Out", (), {"loss": F.cross_entropy(logits, labels, ignore_index=-100), "logits": logits})()

    torch.manual_seed(0)
    model = MasksItsLabels()
    x, labels = torch.randn(8, 16), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    x_kept, labels_kept = x.clone(), labels.clone()
    step = training.training_call(model, (x,), {}, labels)
    step()
    step()
    assert torch.equal(x, x_kept) and torch.equal(labels, labels_kept)


def test_a_snapshot_copies_tensors_and_containers_and_keeps_their_sharing():
    x = torch.randn(4, requires_grad=True)
    with torch.inference_mode():
        frozen = torch.ones(3)
    cache = {"k": [x]}

    class Cache:  # an object holding one of the inputs, as a KV cache holds tensors
        def __init__(self, t):
            self.t = t

    inputs = ((x, frozen), {"cache": cache, "other": Cache(x), "n": 3, "dtype": torch.float16})
    (a, b), kw = snapshot(inputs)
    assert a is not x and torch.equal(a, x) and a.is_leaf and a.requires_grad
    assert b.is_inference() and torch.equal(b, frozen)
    assert kw["cache"]["k"][0] is a and kw["other"].t is a  # one tensor shared stays one
    assert kw["n"] == 3 and kw["dtype"] is torch.float16
    with torch.no_grad():
        a.add_(1)
    assert not torch.equal(a, x)


def test_a_static_kv_cache_among_the_example_inputs_is_handed_back_unused(tmp_path):
    """`generate()`'s first forward passes a cache object; optimize called the model many times with that one
    object, and a `StaticCache` was written past its end (IndexError from `index_copy_`). Each call now gets a
    deep copy: the user's cache is untouched, ready for their own first call."""
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=256, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    cache = StaticCache(config=cfg, max_cache_len=26)
    example = {"input_ids": torch.randint(0, 256, (1, 10)), "past_key_values": cache, "use_cache": True,
               "cache_position": torch.arange(10)}
    report = advisor.optimize(model, example, out=tmp_path / "opt", reuse=False, interpret=True)
    assert report.applied, report
    assert example["past_key_values"] is cache and cache.get_seq_length() == 0
    assert all(not getattr(layer, "is_initialized", False) or not layer.keys.any() for layer in cache.layers)
