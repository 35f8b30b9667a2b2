"""PyTorch's eager-only fused paths, switched off wherever the profile must see what a capture runs.

In inference (grad off or no parameter requiring it, eval mode, batch_first, ...) `nn.MultiheadAttention`
and `nn.TransformerEncoderLayer` run one fused native op (`torch._native_multi_head_attention`,
`torch._transformer_encoder_layer_fwd`) when `torch.backends.mha.get_fastpath_enabled()`. The profiler sees
that op's internals (in-place residual adds, `layer_norm`), a capture sees the op itself, opaque: no
candidate found inside it can be matched in the captured graph, so a LayerNorm the report ranks was never
patched. With the fast path off both see the same module-level ops (linear, attention, add, layer_norm):
the profile is taken and the captured layers run under `module_level_paths()`, so what is ranked is what
can be patched, and the numbers are those of the path the patched model runs. The unpatched model keeps
its fast path: a selection timing the two compares the fused slow path with PyTorch's fused op.

The same flag gates `nn.TransformerEncoder`'s nested-tensor path (a `src_key_padding_mask` in inference packs
its layers' inputs into a nested tensor): the profile sees padded tensors, which PyTorch's execution-trace
observer can record (a nested tensor made it disable itself, and the profiler's next region crashed the
interpreter). A patched layer handed a nested tensor by an encoder running outside the block runs its original
forward on the caller's flags (`forward.NESTED_INPUT`).

One global flag (it is PyTorch's), shared by every thread: the first block entered switches it off, the last
one left puts back what the first found. Per-block save and restore would leave it off for good when two threads'
blocks overlap (the second saves the first's "off"), and switch it back on under a thread still inside, whose
capture's guards (they read the flag) would then refuse it. A thread calling an unpatched module meanwhile runs
the slow path: same numbers, PyTorch's own ops.
"""
from __future__ import annotations

import contextlib
import threading

_LOCK = threading.Lock()
_INSIDE = [0, True]  # blocks open now, in every thread; the flag as the first of them found it


@contextlib.contextmanager
def module_level_paths():
    import torch

    mha = torch.backends.mha
    with _LOCK:
        if _INSIDE[0] == 0:
            _INSIDE[1] = mha.get_fastpath_enabled()
            mha.set_fastpath_enabled(False)
        _INSIDE[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _INSIDE[0] -= 1
            if _INSIDE[0] == 0:
                mha.set_fastpath_enabled(_INSIDE[1])
