"""The float32 twin `optimize`'s check judges low-precision outputs by is freed as soon as the check is done.

A patched module and its PatchedForward refer to each other, so a deep copy of a patched model is freed only
by a full garbage collection, which a process holding few Python objects but gigabytes of GPU memory may not
run for a long time: on the H100 BERT-base's float32 twin (420 MB) was still allocated after `optimize`
returned, through the user's training steps (train_memory, docs/EXPERIMENTS.md). A PatchedForward holds its module weakly.
"""
from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from advisor.patching import verify
from advisor.patching.forward import PatchedForward
from test_graphs import _Block  # noqa: E402  (pytest puts tests/ on sys.path)


def test_the_float32_twin_is_freed_when_its_call_returns(monkeypatch):
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).to(torch.bfloat16)
    for layer in (model[0], model[2]):
        layer.forward = PatchedForward(layer, [])  # what `patch` leaves: module <-> forward, a cycle
    copies = []
    deepcopy = verify.copy.deepcopy

    def watched(obj, *a, **k):
        twin = deepcopy(obj, *a, **k)
        if obj is model:  # (`copy.deepcopy` itself is replaced: the copy's own recursive calls pass here too)
            copies.extend(weakref.ref(t) for t in twin.parameters())  # what holds the memory
        return twin

    monkeypatch.setattr(verify.copy, "deepcopy", watched)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    exact = verify.float32_reference(model, (x,), {})
    gc.disable()  # only reference counting frees it, as between the collector's rare full passes
    try:
        out = exact()
        assert out.dtype == torch.float32 and out.shape == (4, 8)
        assert copies and all(ref() is None for ref in copies)
    finally:
        gc.enable()
    torch.testing.assert_close(out, model.float()(x.float()), rtol=0, atol=0)
    assert isinstance(model[0].__dict__["forward"], PatchedForward)  # the user's model keeps its patches


def test_a_patched_model_let_go_of_is_freed_without_a_garbage_collection(tmp_path):
    """The same cycle in the user's own model: once they drop their last reference to a model `optimize`
    patched (and called), its parameters are freed, as an unpatched model's are, not at some later full
    collection. Its copies (an EMA teacher made by `copy.deepcopy`) work and are freed alike."""
    import copy

    import advisor
    from advisor.patching import patched_modules

    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block()).eval()
    x = torch.randn(4, 8, 32)
    with torch.no_grad():
        want = model(x)
    report = advisor.optimize(model, (x,), interpret=True, reuse=False, out=tmp_path)
    assert patched_modules(model) and report.applied
    teacher = copy.deepcopy(model)
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(teacher(x), want, rtol=1e-5, atol=1e-5)
    params = [weakref.ref(p) for m in (model, teacher) for p in m.parameters()]
    del report
    gc.collect()  # what optimize itself left for the collector is not the point here
    gc.disable()
    try:
        del model, teacher
        assert all(ref() is None for ref in params)
    finally:
        gc.enable()


def test_a_model_that_cannot_be_copied_is_judged_without_a_twin():
    """FSDP2's sharded modules refuse `copy.deepcopy` (an AssertionError); the H200 run of bench/distributed.py
    lost `optimize` on them to it. The check then has no float32 answer and judges by the tolerance alone."""
    class Sharded(nn.Linear):
        def __deepcopy__(self, memo):
            raise AssertionError("FSDP does not support deepcopy. Please use state dict for serialization.")

    model = Sharded(8, 4).to(torch.bfloat16)
    exact = verify.float32_reference(model, (torch.randn(2, 8, dtype=torch.bfloat16),), {})
    assert exact is not None and exact() is None
