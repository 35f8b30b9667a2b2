"""Qualified nn.Module names in the trace.

The python tracer names module calls by class and instance count (`LlamaMLP_1`), which says neither
which layer it is nor how to reach the module from the model. While profiling, global forward hooks
wrap every module call in a record_function `nn.Module::<RootClass>.<qualified.name>` (for example
`nn.Module::LlamaForCausalLM.model.layers.0.mlp`): the analyzer reads module paths from these, and
the patcher finds the module with `root.get_submodule("model.layers.0.mlp")`.
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch
from torch.nn.modules import module as nn_module

PREFIX = "nn.Module::"


@contextlib.contextmanager
def module_scopes():
    names: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
    local = threading.local()

    def stack() -> list:
        if not hasattr(local, "stack"):
            local.stack = []
        return local.stack

    def name_of(mod: torch.nn.Module) -> str:
        name = names.get(mod)
        if name is not None:
            return name
        calls = stack()
        if calls:  # a module its root does not own (made inside forward, or shared): name it by its caller
            return f"{calls[-1][0]}.{type(mod).__name__}"
        root = type(mod).__name__
        for qual, sub in mod.named_modules():
            names.setdefault(sub, f"{root}.{qual}" if qual else root)
        return names[mod]

    def enter(mod, args):
        name = name_of(mod)
        stack().append((name, torch.ops.profiler._record_function_enter_new(PREFIX + name, None)))

    def leave(mod, args, out):
        calls = stack()
        if calls:
            torch.ops.profiler._record_function_exit._RecordFunction(calls.pop()[1])

    pre = nn_module.register_module_forward_pre_hook(enter)
    post = nn_module.register_module_forward_hook(leave, always_call=True)
    try:
        yield
    finally:
        pre.remove()
        post.remove()
