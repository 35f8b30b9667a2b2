"""The float32 twin `optimize`'s check judges low-precision outputs by is freed as soon as the check is done.

A patched module and its PatchedForward refer to each other, so a deep copy of a patched model is freed only
by a full garbage collection, which a process holding few Python objects but gigabytes of GPU memory may not
run for a long time: on the H100 BERT-base's float32 twin (420 MB) was still allocated after `optimize`
returned, through the user's training steps (bench/train_memory.py). The twin is a copy without the patches.
"""
from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from advisor.patching import verify
from advisor.patching.forward import PatchedForward


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
