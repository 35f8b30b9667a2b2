"""Calls at shapes past a capture's budget, run by Inductor's dynamic-shape compile of the module's original forward.

A patched forward captures the shapes `optimize` checked and `forward.EXTRA_CAPTURES` more (each a dynamo trace, a
rewrite and a CUDA-graph recording: 3.6-6.7 s for an 8-layer Llama on the H200, `reports/new-shapes`). Past that, a
call at a new shape ran the module's own ops, unfused: a serving loop at random batch and length ran 184 of its 200
requests so (`reports/serving`). `AnyShape` compiles the original forward once with `torch.compile(dynamic=True)`:
batch, sequence and cache lengths symbolic, so one graph (and dynamo's own specialisations of sizes 0 and 1) serves
every later shape, fused by Inductor (what the Inductor route leaves to Inductor: the pointwise, reduction and norm
ops between the matmuls and the attention). Patched modules inside it are transparent (dynamo inlines their
original forwards: `PatchedForward.__call__`), so none of our kernels runs there; nor a CUDA graph (one recording
per shape would hold memory per shape).

Calls run as `no_grad` calls outside inference mode, inference tensors as normal tensors over the same memory (as
the captures run them): one graph serves both modes. Dynamo's recompile limit reached inside is noted, as in the
captures (the frame then runs uncompiled), and a compile that fails is said once: that forward's later calls at new
shapes run the original forward, as before.
"""
from __future__ import annotations

import threading
import warnings
from typing import Callable

import torch

from advisor.errors import exception_reason
from advisor.fast_paths import module_level_paths
from advisor.patching.attention_layout import lay_out_attention_inputs
from advisor.patching.gemm_epilogues import fuse_gemm_epilogues
from advisor.patching.compiled import _as_normal_inputs, cached_graphs, compile_fresh, dynamo_limits_noted

COMPILED = "Inductor's dynamic-shape compile of the original forward"


class AnyShape:
    """One patched forward's any-shape compile: made on its first call, counted, given up on its first failure."""

    def __init__(self, target: Callable):
        self._target = target  # the function compiled (the module's original forward, unbound)
        self._compiled: Callable | None = None
        self._lock = threading.Lock()
        self.calls = 0  # calls it ran
        self.failed: str | None = None

    def _compile(self) -> Callable:
        with self._lock:
            if self._compiled is None:  # (its dynamo state goes with this object: unpatched, the model lets go)
                self._compiled = compile_fresh(self._target, laid_out_inductor, holder=self, dynamic=True)
            return self._compiled

    def graphs(self) -> int:
        """Graphs dynamo compiled for it so far (a recompile storm would show here; dynamo stops at its recompile
        limit, and the frame then runs uncompiled, noted)."""
        return (cached_graphs(self._compiled) or 0) if self._compiled is not None else 0

    def __call__(self, lead: tuple, args: tuple, kwargs: dict, name: str, note: Callable[[str], None]):
        """The call's outputs, or `NotImplemented` where the compile failed (now or before): the caller then runs
        the original forward. `note`: told each recompile limit dynamo reached inside (a frame run uncompiled)."""
        if self.failed:
            return NotImplemented
        try:
            fn = self._compile()
            with torch.inference_mode(False), torch.no_grad(), module_level_paths(), dynamo_limits_noted() as noted:
                out = fn(*lead, *_as_normal_inputs(args), **_as_normal_inputs(kwargs))
        except Exception as e:  # noqa: BLE001  (dynamo or Inductor could not compile it: the original runs it)
            self.failed = f"{COMPILED} failed: {exception_reason(e)}"
            warnings.warn(f"fusion-advisor: patched {name}.forward: {self.failed}; calls at shapes past its capture "
                          "budget run the original forward", RuntimeWarning, stacklevel=4)
            return NotImplemented
        with self._lock:
            self.calls += 1
        for why in noted:
            note(why)
        return out


def laid_out_inductor(gm: torch.fx.GraphModule, example_inputs) -> Callable:
    """Inductor, after the attention inputs whose layout alone sends SDPA to its math backend are laid out and the
    linears that pay for it get their activation in cuBLASLt's epilogue, as in the captures (`attention_layout`,
    `gemm_epilogues`)."""
    from torch._inductor.compile_fx import compile_fx

    lay_out_attention_inputs(gm)
    fuse_gemm_epilogues(gm)
    return compile_fx(gm, example_inputs)
