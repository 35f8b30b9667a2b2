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


def underneath(model: torch.nn.Module) -> torch.nn.Module:
    """The module a wrapper calls (through nested wrappers), else `model` itself; the wrapper keeps working over it.

    - `torch.compile`'s `OptimizedModule`: its own `forward` is dynamo's frame, which cannot be profiled or captured
      again (our module hooks, traced by the user's dynamo, failed an assertion in its side-effect tracking). A
      patched forward is transparent while dynamo traces, so the wrapper compiles (or keeps) the original forwards
      and its outputs stay eager's; the fused kernels run when the module itself is called.
    - `DistributedDataParallel`: its forward prepares the gradient all-reduce (buckets, autograd hooks) and may
      broadcast buffers, collectives every rank must make alike; the module underneath (`.module`) is profiled,
      checked and patched without them, and the wrapper's forward then calls it patched, its hooks and bucketing
      in place. (FSDP2's `fully_shard` wraps nothing: it hooks the module itself, which is patched as it is.)"""
    while True:
        inner = _wrapped(model)
        if inner is None:
            return model
        log.info("fusion-advisor: the model is a %s wrapper: patching the %s underneath", type(model).__name__,
                 type(inner).__name__)
        model = inner


def _wrapped(model: torch.nn.Module) -> torch.nn.Module | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # another torch's internals: no compile wrapper to see through
        OptimizedModule = ()
    if OptimizedModule and isinstance(model, OptimizedModule):
        return model._orig_mod
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else None


def at_rest(model: torch.nn.Module) -> None:
    """Every `fully_shard`-ed (FSDP2) module under `model` resharded, as `fully_shard` left it: its sharded
    parameters registered again. A forward leaves the root unsharded (it keeps its gathered parameters for the
    backward); `model.parameters()` would then be the gathered copies, not the sharded ones an optimizer steps and
    FSDP2's reduce-scatter writes gradients into."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2: nothing is sharded
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


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
