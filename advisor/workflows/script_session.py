"""Run a user's script with the plan patched into the models it builds, without touching its files.

How the script's model is reached: for the duration of the run, `torch.nn.Module.__call__` is wrapped.
An outermost module call (no module call in progress on this thread) whose class is a plan root
(the first component of the manifest's module paths, e.g. `LlamaForCausalLM`) patches that instance
in place before it runs (`advisor.patch`), so the very first call is already patched. The first
`compare_calls` calls of each patched instance (unless it has active dropout or batch norm in
training mode) also run with patches off on the same inputs and are compared (`verify.check`): a
pattern that changes the outputs is unpatched there and for every later instance. The last call of
every outermost module class is recorded (module, inputs, grad mode) so the steady-state iteration
can be replayed for timing. When the script ends the wrapper is removed; patched instances stay
patched until `close()`.
"""
from __future__ import annotations

import contextlib
import runpy
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from advisor.collect.runner import script_env
from advisor.errors import AdvisorError
from advisor.patching import Patched, patch, unpatch
from advisor.patching.modules import root_class
from advisor.patching.plan import Plan
from advisor.patching.verify import check, float32_reference, repeatable


@dataclass
class Recorded:
    module: torch.nn.Module
    args: tuple
    kwargs: dict
    grad: bool
    inference: bool

    def replay(self):
        mode = torch.inference_mode() if self.inference else torch.set_grad_enabled(self.grad)
        with mode:
            return self.module(*self.args, **self.kwargs)


@dataclass
class Session:
    plan: Plan
    compare_calls: int = 2
    train: bool = False  # calls needing gradients run the fused kernels with their backwards (`apply --train`)
    handles: list = field(default_factory=list)  # [Patched], one per patched root instance
    checks: list = field(default_factory=list)  # one dict per compared call
    dropped: dict = field(default_factory=dict)  # pattern key -> why it was unpatched
    errors: list = field(default_factory=list)
    recorded: dict = field(default_factory=dict)  # outermost module class name -> Recorded
    _state: "weakref.WeakKeyDictionary" = field(default_factory=weakref.WeakKeyDictionary)

    @property
    def roots(self) -> set:
        return {root_class(t.module) for t in self.plan.targets}

    def root_call(self, m: torch.nn.Module, call, args, kwargs):
        cls = type(m).__name__
        self.recorded[cls] = Recorded(m, args, kwargs, torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        st = self._state.get(m)
        if st is None and cls in self.roots and self.plan.targets:
            st = self._state[m] = {"handle": self._patch(m), "checked": 0}
        if st is None or st["handle"] is None or st["checked"] >= self.compare_calls or not repeatable(m):
            return call(m, *args, **kwargs)
        st["checked"] += 1
        chk = check(lambda: call(m, *args, **kwargs), st["handle"], float32_reference(m, args, kwargs))
        self.checks.append({"module": cls, **chk.as_dict()})
        if chk.dropped:
            self.dropped.update(chk.dropped)
            self.plan = self.plan.without(chk.dropped)
            self.handles[self.handles.index(st["handle"])] = chk.handle
            st["handle"] = chk.handle
        return chk.output

    def _patch(self, m) -> Patched | None:
        try:
            h = patch(m, self.plan)
        except AdvisorError as e:
            self.errors.append(f"{type(m).__name__}: {e}")
            return None
        h.train_fused(self.train)
        self.handles.append(h)
        return h

    def close(self) -> None:
        for h in self.handles:
            unpatch(h.model)


@contextlib.contextmanager
def intercept_roots(session: Session):
    """Route outermost nn.Module calls through `session.root_call` while the block runs."""
    nn_module = torch.nn.Module
    original = nn_module.__call__
    local = threading.local()

    def __call__(self, *args, **kwargs):
        # While dynamo traces a patched forward it inlines submodule calls through here: keep the
        # traced path trivial (no thread-local state), so the capture is the same as without us.
        if torch.compiler.is_compiling() or getattr(local, "depth", 0):
            return original(self, *args, **kwargs)
        local.depth = 1
        try:
            return session.root_call(self, original, args, kwargs)
        finally:
            local.depth = 0

    nn_module.__call__ = __call__
    try:
        yield session
    finally:
        nn_module.__call__ = original


def run_script(script: Path, args: list, device: str) -> None:
    """`python SCRIPT ARGS` in this process (argv, sys.path[0], FUSION_ADVISOR_DEVICE as the collector sets)."""
    try:
        with script_env(script, args, device):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise AdvisorError(f"{script} exited with {e.code} while running patched", exit_code=1) from None
