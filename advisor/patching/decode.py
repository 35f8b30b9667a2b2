"""Graphed decode for a Hugging Face generation model: `optimize(..., decode=True)`, then the user's own
`model.generate(...)`.

Each decode step is one token against a KV cache that grows by one: a shape no profile saw, which a capture of
ours (specialised to the profiled shapes) runs on the module's own ops, one Python call per op. HF's static
cache keeps every step at one shape (the cache preallocated to the generation's length, written in place at
`cache_position`), and `generate` then compiles its decode step with `torch.compile` (CUDA graphs, on a GPU)
by itself. So `decode=True` sets the model's generation config to the static cache where the user chose none;
the compiled step traces through the patched forwards, which hand a tracer the original forward
(`forward._traced`), so Inductor fuses the step and replays it from CUDA graphs, while the prompt's forward
(prefill, run outside HF's compiled call) runs our captures. What this changed is stored on the model and
undone by `unpatch`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_SAVED = "_fusion_advisor_decode"  # model attribute: the generation-config fields as the user had them
STATIC = "static"


@dataclass(frozen=True)
class DecodeSetup:
    """What `prepare` did to a model's `generate` (apply.json's `decode`)."""

    graphed: bool
    cache: str | None  # the cache implementation `generate` will use (None: HF's default, a dynamic cache)
    decision: str

    def to_json(self) -> dict:
        return {"graphed": self.graphed, "cache": self.cache, "decision": self.decision}


def prepare(model: torch.nn.Module) -> DecodeSetup:
    """Make `model.generate` decode on HF's static cache, compiled (see the module's doc); refuse in a reason
    where the model cannot."""
    config = getattr(model, "generation_config", None)
    can_generate = getattr(type(model), "can_generate", None)
    if config is None or not callable(can_generate) or not can_generate():
        return DecodeSetup(False, None, f"decode=True: {type(model).__name__} has no Hugging Face `generate` "
                           "(a GenerationMixin model with a generation_config); nothing changed")
    if not getattr(model, "_can_compile_fullgraph", False):
        return DecodeSetup(False, config.cache_implementation,
                           f"decode=True: {type(model).__name__} does not support a static cache with "
                           "torch.compile (its `_can_compile_fullgraph` is False): decode steps run the original "
                           "ops, as unpatched")
    chosen = config.cache_implementation
    if chosen not in (None, STATIC):
        return DecodeSetup(False, chosen, f"decode=True: generation_config.cache_implementation is {chosen!r}, "
                           "the user's choice, kept: decode steps are not graphed (set it to 'static', or None "
                           "and optimize again)")
    if config.disable_compile:
        return DecodeSetup(False, chosen, "decode=True: generation_config.disable_compile is set, the user's "
                           "choice, kept: decode steps run op by op")
    if chosen is None:
        model.__dict__.setdefault(_SAVED, {"cache_implementation": None})
        config.cache_implementation = STATIC
    on_gpu = any(p.is_cuda for p in list(model.parameters())[:1])
    how = ("each decode step is one CUDA-graph replay of torch.compile's kernels, over the patched model's "
           "original ops" if on_gpu else
           "HF compiles the step only on a GPU: here the static cache alone, each step op by op")
    whose = "set by optimize" if chosen is None else "the user's"
    return DecodeSetup(on_gpu, STATIC, f"generate(): HF's static cache ({whose}); {how}; the prompt's forward runs "
                       "the fused captures")


def restore(model: torch.nn.Module) -> None:
    """Undo `prepare` on `model` and its submodules (what `unpatch` calls)."""
    for m in model.modules():
        saved = m.__dict__.pop(_SAVED, None)
        if saved is not None and getattr(m, "generation_config", None) is not None:
            for k, v in saved.items():
                setattr(m.generation_config, k, v)


def hint(model: torch.nn.Module, any_shape: bool = False) -> str | None:
    """For a generation model optimised without `decode=True`: what its `generate` will do (`any_shape`: calls at
    shapes past the capture budget run Inductor's dynamic-shape compile, `patching.any_shape`)."""
    can_generate = getattr(type(model), "can_generate", None)
    if _SAVED in model.__dict__ or not callable(can_generate) or not can_generate():
        return None
    if getattr(getattr(model, "generation_config", None), "cache_implementation", None) == STATIC:
        return None
    ran = ("past the capture budget run Inductor's dynamic-shape compile of the original forwards (compiled on the "
           "first such step; no CUDA graph)" if any_shape else "run the original ops")
    return (f"generate(): decode steps (one token against a growing cache) are shapes never profiled and {ran}; "
            "optimize(..., decode=True) decodes on HF's static cache, graphed by torch.compile")
