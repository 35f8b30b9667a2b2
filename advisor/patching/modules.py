"""Module paths from a trace, resolved against a live model.

Two spellings reach us. The collector's qualified names, `LlamaForCausalLM.model.layers.0.mlp` (root
class, then `named_modules` name), resolve with `get_submodule`; a module its root does not own is
named after its caller (`...self_attn.RotaryHelper`) and resolves to that caller, which contains the
call. Older traces carry the python tracer's instance chains, `LlamaForCausalLM_0/LlamaModel_0/
LlamaDecoderLayer_1/LlamaMLP_1`, where `_N` counts instances of a class in the order the profile
first saw them: we take the N-th module of that class in the root's `named_modules()` order, which is
the call order for models whose modules run in registration order (true of HF transformers), and
check that each step descends from the previous one.
"""
from __future__ import annotations

import logging
import re

import torch

_INSTANCE = re.compile(r"^(?P<cls>[A-Za-z_]\w*?)_(?P<n>\d+)$")
log = logging.getLogger(__name__)


def under_compile(model: torch.nn.Module) -> torch.nn.Module:
    """The module a `torch.compile` wrapper (`OptimizedModule`) calls, else `model` itself. The wrapper's own
    `forward` is dynamo's frame, which cannot be profiled or captured again (our module hooks, traced by the
    user's dynamo, failed an assertion in its side-effect tracking); the module underneath can. The wrapper keeps
    working over it: a patched forward is transparent while dynamo traces, so the wrapper compiles (or keeps)
    the original forwards and its outputs stay eager's; the fused kernels run when the module itself is called."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # another torch's internals: hand the model on as it is
        return model
    if not isinstance(model, OptimizedModule):
        return model
    inner = model._orig_mod
    log.info("fusion-advisor: the model is a torch.compile wrapper: patching the %s underneath (`._orig_mod`); "
             "calls through the wrapper run torch.compile's graph of the original forwards, calls of `._orig_mod` "
             "run the fused kernels", type(inner).__name__)
    return inner


def is_instance_chain(path: str) -> bool:
    return "/" in path or (bool(_INSTANCE.match(path)) and "." not in path)


def root_class(path: str) -> str:
    if is_instance_chain(path):
        first = path.split("/", 1)[0]
        m = _INSTANCE.match(first)
        return m.group("cls") if m else first
    return path.split(".", 1)[0]


def root_path(path: str) -> str:
    """The path of the root module itself, in the same spelling."""
    return path.split("/", 1)[0] if is_instance_chain(path) else path.split(".", 1)[0]


def lca(paths: list[str]) -> str | None:
    """The innermost module containing every path (same spelling throughout); None if no common root."""
    paths = [p for p in paths if p]
    if not paths:
        return None
    sep = "/" if is_instance_chain(paths[0]) else "."
    parts = [p.split(sep) for p in paths]
    common = []
    for items in zip(*parts):
        if len(set(items)) != 1:
            break
        common.append(items[0])
    return sep.join(common) if common else None


def resolve(root: torch.nn.Module, path: str) -> tuple[str, torch.nn.Module] | None:
    """(qualified name in root, module) for a trace path, or None if it does not fit this model."""
    if root_class(path) != type(root).__name__:
        return None
    if is_instance_chain(path):
        return _resolve_chain(root, path)
    parts = path.split(".")[1:]
    while True:
        qual = ".".join(parts)
        try:
            return qual, root.get_submodule(qual) if qual else root
        except AttributeError:
            if not parts:
                return None
            parts = parts[:-1]  # a module the root does not own: its caller contains the call


def _resolve_chain(root: torch.nn.Module, path: str) -> tuple[str, torch.nn.Module] | None:
    by_class: dict[str, list[tuple[str, torch.nn.Module]]] = {}
    for qual, mod in root.named_modules():
        by_class.setdefault(type(mod).__name__, []).append((qual, mod))
    qual_now = ""
    for comp in path.split("/")[1:]:
        m = _INSTANCE.match(comp)
        if not m:
            return None
        found = by_class.get(m.group("cls"), [])
        n = int(m.group("n"))
        if n >= len(found):
            return None
        qual, _ = found[n]
        if qual_now and not qual.startswith(qual_now + "."):
            return None  # not nested as the trace says: the registration-order guess does not hold here
        qual_now = qual
    return qual_now, root.get_submodule(qual_now) if qual_now else root


def called_ancestor(root: torch.nn.Module, qual: str) -> str:
    """`qual`, or its nearest ancestor that has a forward (a ModuleList is never called itself)."""
    while qual:
        if type(root.get_submodule(qual)).forward is not torch.nn.Module.forward:
            return qual
        qual = qual.rsplit(".", 1)[0] if "." in qual else ""
    return qual


def qualified(root: torch.nn.Module, qual: str) -> str:
    return f"{type(root).__name__}.{qual}" if qual else type(root).__name__


def outermost(quals: list[str]) -> list[str]:
    """Drop every name nested inside another one of the list (the outer capture contains it)."""
    keep = []
    for q in sorted(set(quals), key=lambda s: (s.count(".") if s else -1, s)):
        if not any(k == "" or q == k or q.startswith(k + ".") for k in keep):
            keep.append(q)
    return keep


def contains(outer: str, inner: str) -> bool:
    return outer == "" or inner == outer or inner.startswith(outer + ".")
