"""The user's example inputs are never handed to their model by `optimize`: every call it makes gets a fresh
snapshot of them (`snapshot`).

Why: `optimize` calls the model dozens of times (profiling, capture, checks, selection's timing, the training
check). A forward that edits its input in place (`x.mul_(0.5); x += 1`), a loss that masks its labels in place,
or a KV cache that each call appends to (HF's `DynamicCache`, `StaticCache` as `generate()` passes them) would
otherwise come back changed by those calls, each call would see the previous one's edits (so the patched and
unpatched outputs were compared on different inputs), and a `StaticCache` was written past its end (an
`IndexError` from `index_copy_`).
"""
from __future__ import annotations

import copy

import torch


def snapshot(inputs):
    """A copy of `inputs` the model may change freely: every tensor cloned (a leaf with the same `requires_grad`,
    an inference tensor where the original is one), tuples, lists and dicts rebuilt, any other object (a KV cache)
    deep-copied. Objects shared between inputs stay shared in the copy (one memo for the whole walk), and an
    object that cannot be deep-copied is handed over as it is (as before snapshots existed)."""
    return _copied(inputs, {})


def _copied(x, memo: dict):
    if id(x) in memo:
        return memo[id(x)]
    if isinstance(x, torch.Tensor):
        out = _cloned(x)
    elif type(x) in (tuple, list):
        out = type(x)(_copied(v, memo) for v in x)
    elif type(x) is dict:
        out = {k: _copied(v, memo) for k, v in x.items()}
    elif isinstance(x, (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)):
        return x
    else:
        try:
            out = copy.deepcopy(x, memo)  # the memo maps the tensors cloned so far: an object sharing one keeps it
        except Exception:  # noqa: BLE001  (not copyable: a lock, a generator; used as is, as before)
            out = x
    memo[id(x)] = out
    return out


def _cloned(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in memory of their own, with its strides (`clone` keeps a dense tensor's), as a leaf."""
    with torch.inference_mode(t.is_inference()), torch.no_grad():
        out = t.clone()
    return out.requires_grad_(t.requires_grad) if out.is_floating_point() or out.is_complex() else out
