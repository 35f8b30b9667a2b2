"""The patched `forward`: `PatchedForward`, what it compiles and when it runs the original code instead.

A patched forward whose patterns cannot have a backward (stand-ins, matmul anchors other than the SPLADE
head's, `splade.py`) runs the original code whenever autograd needs it, as does any forward until training
is fused (`Patched.train_fused`, `optimize(..., train=True)`).

Modules of one class with one plan capture once (`ClassCapture`): the first one to run (the owner)
compiles a function shared by the class; every other instance calls it under dynamo's
`fail_on_recompile` stance, so it is served by the owner's graph exactly when dynamo's guards accept it
(parameters are graph inputs, `inline_inbuilt_nn_modules`), and costs no trace: N identical layers,
one dynamo trace, one AOTAutograd, one rewrite. An instance every shared capture of its class refuses
(another shape or structure: a ResNet stage's first block; HF layers guard on their integer `layer_idx`
when they index a KV cache; train mode) owns a new one, which later instances like it join (never
recompiling one cache: 32 layers in one would exhaust dynamo's recompile limit of 8 and later layers
would silently run unpatched); one that has hooks or instance-level forwards inside (dynamo does not
guard on hooks: `HookWatch.plain`) gets its own compiled function, as does every instance when the
owner's capture had a graph break (a refusal in a resumed frame would come after side effects). Each
compiled function's dynamo state goes with its holder (`compile_fresh`): a deleted model takes its graphs
with it.
A call in inference mode runs the capture a `no_grad` call made (its inference tensors passed as normal
tensors over the same memory, `PatchedForward._call_as_no_grad`): dynamo's guards would otherwise tell
the two modes apart and trace every module once per mode.
A forward captures at most `EXTRA_CAPTURES` more graphs after `optimize` has checked it (new shapes,
train mode): later new shapes run the original forward instead of recompiling inside the user's loop, or, where
`optimize` asked (`settle(any_shape=True)`), Inductor's one dynamic-shape compile of it (`any_shape`). One
compiled function holds at most `GRAPHS_PER_CAPTURE` graphs, within dynamo's recompile limit, whose warning
would otherwise reach the user's terminal (a module called at many shapes within `optimize`'s own calls); a
limit dynamo reaches inside a capture anyway (a frame compiled where the graph breaks) is noted as a fallback
reason (`dynamo_limits_noted`). A call handed a nested tensor (`nn.TransformerEncoder`'s nested-tensor fast
path) runs the original forward on the caller's fast paths: dynamo cannot capture it (`NESTED_INPUT`).
An outer capture (`outer=True`: a module holding several patched layers, e.g. a decoder stack) runs
only when switched on (`Patched.set_outer`, chosen by selection's timing): its one graph holds every
layer, so it fuses across them (layer N's residual add with layer N+1's norm) and replays the whole
stack as one CUDA graph. A patched forward reached while dynamo traces (inside an outer capture, or
inside the user's own `torch.compile`) is transparent: dynamo inlines the original forward.
Hooks registered (or removed) after patching on any module inside a captured one, and instance
forwards replaced there, are not seen by dynamo's guards: `HookWatch` sees them and the module then
runs its original forward, which honours them (said once). HF's output-capturing hooks, installed inside
every layer by the first call asking for `output_hidden_states`, are dormant in other calls: only the calls
asking for extra outputs run the original forward (`HookWatch`, `dormant_hook`). Nothing unpicklable is stored
on the module.
"""
from __future__ import annotations

import copy
import functools
import inspect
import logging
import sys
import threading
import warnings
import weakref
from typing import Callable

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from advisor.errors import exception_reason
from advisor.fast_paths import module_level_paths
from advisor.kernels import derived
from advisor.patching import rewrite
from advisor.patching.any_shape import AnyShape
from advisor.patching.capture import Backend, CaptureLog, graphs_run, log_for, plan_digest, trainable
from advisor.patching.compiled import _as_normal_inputs, cached_graphs, compile_fresh, dynamo_limits_noted
from advisor.patching.graphs import drop_recordings_reading, release_pool
from advisor.patching.plan import PatternSpec
from advisor.patching.train_graphs import release_unused_pool


# ------------------------------------------------------------------------------------ the forward
SPENT = "new input shapes or modes after the capture budget"
EXTRA_CAPTURES = 2  # graphs a forward may still capture after `optimize` checked it (see `settle`)
REFUSALS_TO_STOP = 4  # guard refusals in a row after which a captured shape's calls run the original forward unasked
GRAPHS_PER_CAPTURE = 8  # graphs one compiled function holds (dynamo's recompile limit, when that is lower)
FULL = (f"new input shapes or modes past the graphs one capture holds (at most {GRAPHS_PER_CAPTURE}, within dynamo's "
        "recompile limit): its ops ran unfused, as dynamo runs a frame it does not compile")
TRAINING_CALL = ("a call needing gradients: the original forward runs it, as by default (torch.no_grad() or "
                 "torch.inference_mode() for inference; optimize(..., train=True) trains through the fused kernels)")
UNPROFILED = ("inputs at shapes never profiled, where no pattern matches (row and pointwise kernels serve any batch and "
              "sequence; matmul, attention, GroupNorm and pooling kernels only the profiled shapes), so its new capture "
              "runs the module's own ops (optimize with these inputs to fuse them)")
NO_BACKWARD = ("no fused backward validated (or faster than the original ops) here: calls needing gradients run the "
               "original forward")
NESTED_INPUT = ("a nested-tensor input (PyTorch's nested-tensor fast path: nn.TransformerEncoder called in inference with a "
                "src_key_padding_mask packs its layers' inputs): a capture cannot follow it, so the original forward ran "
                "it, on PyTorch's fast path (enable_nested_tensor=False feeds the layers padded tensors, which run fused)")


class GradientCalls:
    """Whether a patched model has said that its calls with gradients enabled run the original forward: its
    forwards share one, so the warning comes once per model (evaluation scripts often call without `no_grad`,
    and then never ran a fused kernel without a word)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.said = False

    def say(self, why: str) -> None:
        if self.said or _checking():
            return
        self.said = True
        if why == TRAINING_CALL:
            fix = ("call it under torch.no_grad() or torch.inference_mode() for inference, or optimize(..., train=True) "
                   "(apply --train) to train through the fused kernels")
        else:
            fix = ("no fused backward validated for it, so calls that train run the original ops; call it under "
                   "torch.no_grad() or torch.inference_mode() for inference")
        warnings.warn(f"fusion-advisor: calls of the patched {self.model_name} with gradients enabled (a parameter or "
                      f"an input requires grad) run its original forward, not the fused kernels: {fix} "
                      "(report.handle.fallbacks() counts these calls; said once per model)", RuntimeWarning,
                      stacklevel=5)


_CHECKS = threading.local()


def _checking() -> bool:
    return getattr(_CHECKS, "on", False)


def checking():
    """Inside: `optimize`'s own calls (its training comparison's runs through the original forwards), which say nothing."""
    return rewrite.thread_flag(_CHECKS, "on", True)


class PatchedForward:
    """`module.forward` while patched. Holds plain data only (module, specs, the forward it replaced);
    its compiled function and hook watch are made on first use and never pickled or deep-copied."""

    def __init__(self, module: torch.nn.Module, specs: list[PatternSpec], saved: Callable | None = None,
                 outer: bool = False, inductor: bool | str = False):
        # Held weakly: the module holds this object as its `forward`, so a strong reference back would make a
        # cycle, and a patched model the caller lets go of would stay on the GPU until a full garbage
        # collection, which a process holding few Python objects and gigabytes of tensors may not run for
        # minutes (optimize's float32 twin of BERT-base, 420 MB, outlived it into training on the H100).
        self._module = weakref.ref(module)
        self.outer = outer  # holds other patched modules; runs its capture only while switched on
        self.inductor = inductor  # its inference graphs compiled by Inductor around the sites, in this mode (`stacked`)
        self.active = not outer
        self.specs = specs
        self.saved = saved  # an instance-level forward that was there before us (None: the class's)
        self.failed: str | None = None
        self.rejected: str | None = None  # an outer capture whose check failed: never switched on
        self.fallbacks: dict[str, int] = {}  # why calls ran the original forward -> how many
        self._compiled: Callable | None = None
        self._backend: Backend | None = None
        self._watch: HookWatch | None = None
        self._owns: ClassCapture | None = None  # the class's shared capture, compiled by this instance
        self._via: ClassCapture | None = None  # the class's shared capture, called without compiling
        self._budget: int | None = None  # calls allowed to capture, in total (None: until `settle`)
        self._capturing_calls = 0  # calls that made dynamo capture at least one graph
        self._captured_shapes: set = set()  # `_shapes_of` the calls that captured: past the budget, any other
        # call's shapes are refused by the guards (dynamic=False), so it runs the original forward unasked
        self._refusals: dict = {}  # captured shapes -> calls in a row the guards refused at them (`_may_serve`)
        self.any_shape: AnyShape | None = None  # what runs calls past the budget at new shapes (None: the original)
        self.enabled: frozenset | None = None  # patterns whose launchers run (None: all; see Patched.enable)
        self.train_fused = False  # see `trains`
        self.gradient_calls = GradientCalls(type(module).__name__)  # shared by the model's forwards (`patch`)
        # Its bookkeeping (what it compiled, which capture serves it, its counts), as threads calling the module at
        # once make it: a first call in two threads compiled two captures, one of them kept by nobody; the calls
        # themselves run unlocked, as the module's own forward would
        self._lock = threading.RLock()

    @property
    def module(self) -> torch.nn.Module:
        m = self._module()
        if m is None:
            raise ReferenceError("fusion-advisor: the module this forward was patched into no longer exists")
        return m

    @property
    def trains(self) -> bool:
        """Calls that need gradients go through the capture (sites with a generated backward) when asked
        (`Patched.train_fused`) and a pattern may have one; else they run the original forward, at eager's
        cost (the default: measured slower than eager on the H100's Llama, see reports/train/host-bound-step.md)."""
        return self.train_fused and self._may_train

    @functools.cached_property
    def _may_train(self) -> bool:
        return any(trainable(s) for s in self.specs)

    def kernels_written(self) -> None:
        """The kernel modules exist now (this forward was captured while they compiled): whether it may train,
        which reads them (a padded GEMM's module says it is differentiable), is asked again."""
        self.__dict__.pop("_may_train", None)
        if self._backend is not None:
            self._backend.trains = self._may_train

    @property
    def keys(self) -> tuple:
        return tuple(s.key for s in self.specs)

    @functools.cached_property
    def digest(self) -> str:
        """`plan_digest` of the specs, which never change (a JSON dump of every program: worth computing once)."""
        mode = "" if self.inductor is True else f"={self.inductor}"
        return plan_digest(self.specs) + (f":inductor{mode}" if self.inductor else "")  # captures shared only alike

    def _target(self) -> tuple[Callable, tuple]:
        """The function that gets captured and the arguments that go before the caller's."""
        return (self.saved, ()) if self.saved is not None else (type(self.module).forward, (self.module,))

    def log(self) -> CaptureLog:
        """What the rewriter did in the captures this forward runs (shared with same-class modules)."""
        return log_for((self._target()[0], self.digest))

    def original(self) -> Callable:
        return self.saved if self.saved is not None else type(self.module).forward.__get__(self.module)

    @property
    def __signature__(self) -> inspect.Signature:
        """The original forward's: callers read it (HF `generate` passes `position_ids` and `logits_to_keep`
        only to a forward that names them; with `(*args, **kwargs)` Gemma-2 generated other scores)."""
        return inspect.signature(self.original())

    def settle(self, any_shape: bool = False) -> None:
        """Called once `optimize` has checked the model: from now on at most `EXTRA_CAPTURES` more calls
        may capture (new shapes, modes; one call can capture several graphs where dynamo breaks the
        forward up); beyond that a call that would recompile runs the original forward, so a decoding
        loop whose lengths grow never waits for dynamo, or, with `any_shape`, Inductor's one dynamic-shape
        compile of it (`AnyShape`: fused at every later shape, for one compile)."""
        self._budget = self._capturing_calls + EXTRA_CAPTURES
        fn, _ = self._target()
        self.any_shape = AnyShape(fn) if any_shape else None

    def _compile(self) -> Callable:
        """The function this instance calls: its class's shared capture where there is one to join (or
        to own), else its own."""
        with self._lock:
            if self._compiled is not None:  # (another thread's first call made it meanwhile)
                return self._compiled
            return self._compile_now()

    def _compile_now(self) -> Callable:
        self._watch = self._watch or HookWatch(self.module)
        if self._shares_class():
            joinable = self._joinable()
            if joinable:
                self._join(joinable[0])  # tried on the first call; the others after it if it refuses
                return self._compiled
            return self._found()
        if self._owns is None:
            return self._own()
        return self._compiled

    def _shares_class(self) -> bool:
        """Whether this instance may join (or own) one of its class's shared captures: the class's own forward,
        no outer capture, and hook-free (dynamo does not guard on hooks, `skip_nnmodule_hook_guards`)."""
        return self.saved is None and not self.outer and self._watch.plain()

    def _class_key(self) -> tuple:
        return self._target()[0], self.digest

    def _joinable(self, but=None) -> list:
        """The class's shared captures this instance may ask to serve it (owner alive, no graph break, not
        refusing everyone), `but` one already asked."""
        with _CLASS_LOCK:
            entries = list(_CLASS.get(self._class_key(), ()))
        return [e for e in entries if e is not but and e.owner() is not None and not e.breaks and not e.diverges]

    def _join(self, entry: "ClassCapture") -> None:
        self._via, self._backend, self._compiled = entry, entry.backend, entry.compiled

    def _found(self) -> Callable:
        """A new shared capture of the class, owned by this instance (the class's others refuse it: another
        shape or structure, ResNet's first block of a stage), or its own where the class has `MAX_CLASS_CAPTURES`."""
        with self._lock, _CLASS_LOCK:
            entries = _CLASS.setdefault(self._class_key(), [])
            if sum(e.owner() is not None for e in entries) >= MAX_CLASS_CAPTURES:
                return self._own()
            backend = Backend(self.specs, self.log(), self.digest, self._may_train, self.inductor)
            self._owns = ClassCapture(self._target()[0], backend, self, self._class_key())
            entries.append(self._owns)
            self._via, self._backend, self._compiled = None, backend, self._owns.compiled
            return self._compiled

    def _own(self) -> Callable:
        """This instance's own compiled function (its own dynamo cache)."""
        with self._lock:
            self._via = None
            self._backend = Backend(self.specs, self.log(), self.digest, self._may_train, self.inductor)
            self._compiled = compile_fresh(self._target()[0], self._backend, holder=self, graphs=graphs_per_capture())
            return self._compiled

    def _served_by_class(self, lead, args, kwargs):
        """The call served by the capture it joined, else by another of the class's it may join (which it joins
        from now on); `_NOT_SERVED` when every one of them refuses it."""
        via = self._via
        for entry in [via, *self._joinable(but=via)]:
            out = _served(entry.compiled, lead, args, kwargs)
            if out is not _NOT_SERVED:
                entry.served += 1
                self._join(entry)
                return out
            entry.refused += 1
        return _NOT_SERVED

    def _spent_on(self, args, kwargs) -> bool:
        """Whether this call, at shapes no capture of this forward was made at, comes past its capture budget (its
        own capture: one shared with the class decides by its guards)."""
        if self._budget is None or self._capturing_calls < self._budget or self.failed or \
                (self._via is not None and not self._via.breaks):
            return False
        return self._written_off(_shapes_of(args, kwargs))

    def _written_off(self, shapes: tuple) -> bool:
        """Whether no graph of this forward is asked to take calls at `shapes`: none was captured at them, or its
        guards refused them `REFUSALS_TO_STOP` times in a row (`_may_serve`)."""
        return shapes not in self._captured_shapes or self._refusals.get(shapes, 0) >= REFUSALS_TO_STOP

    def _may_serve(self, fn: Callable, lead: tuple, args, kwargs) -> bool:
        """Whether a graph `fn` holds may take this call (asked where no new one is made): its shapes are among those
        captured and dynamo's guards accept it. Guards that refused a call's shapes `REFUSALS_TO_STOP` times in a row
        are not asked again for them: asking cost ~100 us per layer call on the H200 (every entry's guards, and the
        call's arguments bound to the frame's), paid by every decode step of `generate`, whose top-level shapes
        repeat while the KV cache inside grows (generate() ran 0.90x eager on it)."""
        shapes = _shapes_of(args, kwargs)
        if self._written_off(shapes):
            return False
        if _guards_accept(fn, lead, args, kwargs) is False:
            with self._lock:
                self._refusals[shapes] = self._refusals.get(shapes, 0) + 1
            return False
        if shapes in self._refusals:
            with self._lock:
                self._refusals.pop(shapes, None)
        return True

    def _fall_back(self, why: str, args, kwargs, any_shape: bool = False):
        """The original forward runs the call, noted under `why`; with `any_shape` (an inference call past the
        budget at new shapes), Inductor's dynamic-shape compile of it where there is one (`AnyShape`)."""
        if any_shape and self.any_shape is not None:
            out = self.any_shape(self._target()[1], args, kwargs, type(self.module).__name__, self._note)
            if out is not NotImplemented:
                return out
            why = self.any_shape.failed or why
        self._note(why)
        return self.original()(*args, **kwargs)

    def _note(self, why: str) -> None:
        """One more call that ran the original forward because of `why`."""
        with self._lock:
            self.fallbacks[why] = self.fallbacks.get(why, 0) + 1

    @property
    def refused(self) -> str | None:
        """Why this capture may not run (a failed capture, or an outer capture its check rejected), else None."""
        return self.rejected or self.failed

    def on(self) -> bool:
        if self.rejected:
            return False
        forced = rewrite.outer_override() if self.outer else None
        return self.active if forced is None else forced

    @property
    def __code__(self):
        """The original forward's code: `torch.export` names its trace after `module.forward.__code__`."""
        return self.original().__code__

    def __call__(self, *args, **kwargs):
        if _traced(self.module):  # an outer capture, torch.compile, torch.export, jit.trace: inlined
            # (a plain call, as `_target` spells it: dynamo cannot trace `function.__get__`, and a graph
            # break inside the outer capture's layer loop made dynamo skip the whole stack's frame)
            fn, lead = self._target()
            return fn(*lead, *args, **kwargs)
        m = self.module
        if m.training:  # BatchNorm's train-mode forward updates its statistics without bumping their versions:
            derived.stale_all()  # a fold of them (a conv epilogue's) is recomputed when next read
        grad = _needs_autograd(m, args, kwargs)
        if grad:
            self._release_inference()
        # An outer capture switched on trains as one graph too (one forward and one backward replay for the
        # whole stack, not one per layer with the host's work between them).
        off = rewrite.patches_are_off() or not self.on()
        if not off and _nested_input(args, kwargs):
            # Dynamo cannot capture a (strided) nested tensor, and with the fast paths off (`_call`) PyTorch's own
            # layers refuse one: the original forward runs it as the caller's flags have it, as unpatched.
            self._note(NESTED_INPUT)
            return self.original()(*args, **kwargs)
        if off or (grad and not self.trains):
            if grad and not off and not _checking():
                why = NO_BACKWARD if self.train_fused else TRAINING_CALL
                self._note(why)
                self.gradient_calls.say(why)
            return self.original()(*args, **kwargs)
        if grad:
            if getattr(self._backend, "trains_nothing", False):  # a module sharing this capture found no site fused
                self._may_train = False
                self._note(NO_BACKWARD)
                self.gradient_calls.say(NO_BACKWARD)
                return self.original()(*args, **kwargs)
            fused = rewrite.fused_runs()
            out = self._call(m, args, kwargs, training=True)
            if rewrite.fused_runs() == fused:
                # No site here has a validated backward for these inputs: the capture would only replay
                # eager's ops op by op, so training calls run the original forward from now on.
                self._may_train = False
                self._note(NO_BACKWARD)
                if self._backend is not None:
                    self._backend.trains_nothing = True  # the layers sharing it need not record to find out
                    for graphed in self._backend.train_graphs:
                        graphed.recordings.clear()  # eager's ops replayed: memory for nothing (BERT: 6 GB)
                release_unused_pool()
            return out
        if self._spent_on(args, kwargs):
            # Past the budget at shapes no capture was made at: the original forward, before any of the capture's
            # own bookkeeping (a growing KV cache makes every decode step such a call, in every layer).
            return self._fall_back(SPENT, args, kwargs, any_shape=True)
        if torch.is_inference_mode_enabled():
            return self._call_as_no_grad(m, args, kwargs)
        if torch.is_grad_enabled():
            # Nothing requires a gradient (a frozen model called without no_grad): no autograd would be recorded,
            # so it runs as a no_grad call, served by that capture (dynamo guards on the grad mode: each mode had
            # cost a trace of its own, out of the capture budget). (The grad mode set by hand: `no_grad()` costs 3 us.)
            torch._C._set_grad_enabled(False)
            try:
                return self._call(m, args, kwargs)
            finally:
                torch._C._set_grad_enabled(True)
        return self._call(m, args, kwargs)

    def _release_inference(self) -> None:
        """A call needing gradients: this capture's inference recordings (each layer's static inputs and outputs,
        the whole stack's) are dropped, and their pool handed back once no model keeps any, so that training
        holds no more memory than eager does (BERT trained after `optimize` peaked 0.8 GB above eager on the
        H100, its training running the original forwards: reports/train/host-bound-step.md). Only the recordings that read
        this module's weights: another model sharing the capture (an EMA teacher) keeps its own. The next
        inference call records again."""
        kept = self._backend.inference_graphs if self._backend is not None else ()
        if any(g.recordings for g in kept) and drop_recordings_reading(
                kept, {t.data_ptr() for t in (*self.module.parameters(), *self.module.buffers())}):
            release_pool("inference")

    def _call_as_no_grad(self, m, args, kwargs):
        """A call in inference mode, run as a `no_grad` call: the same capture serves both. Dynamo's tensor
        guards hold each tensor's dispatch keys as the thread's dispatch state sees them, and inference mode
        changes them for every tensor (it excludes the autograd keys; inference tensors lack them too), so
        each mode would cost a trace of its own (measured: an 8-layer Llama's stack, 1.7-1.9 s on a 2-core CPU).
        Inference tensors among the inputs are passed as normal tensors over the same memory (no copy, so
        in-place writes reach the caller's tensor); no autograd is recorded either way. The outputs are then
        normal tensors that do not require grad, where eager would hand out inference tensors."""
        with torch.inference_mode(False), torch.no_grad():
            return self._call(m, _as_normal_inputs(args), _as_normal_inputs(kwargs))

    def _call(self, m, args, kwargs, training: bool = False):
        # The captured graph holds what the profile saw only with PyTorch's eager fast paths off (the profile
        # runs under the same block): dynamo's guards read the flag, so every call of a capture runs under it.
        with module_level_paths():
            return self._call_captured(m, args, kwargs, training)

    def _call_captured(self, m, args, kwargs, training: bool):
        if self.failed:
            return self._fall_back(self.failed, args, kwargs)
        fn = self._compiled or self._compile()
        if self._via is not None and self._via.breaks:
            fn = self._own()
        changed = self._watch.changed()
        if changed:
            if changed not in self.fallbacks and changed != EXTRA_OUTPUTS:
                warnings.warn(f"fusion-advisor: {changed} inside the patched {type(m).__name__}: it runs its "
                              "original forward, which honours them (optimize again to fuse with them)",
                              RuntimeWarning, stacklevel=2)
            return self._fall_back(changed, args, kwargs)
        ran, captures, unfused = graphs_run(), self._backend.captures, self._backend.unfused_graphs
        spent = self._budget is not None and self._capturing_calls >= self._budget
        full = not spent and _full(fn, self._backend.captures)
        lead = self._target()[1]
        own = self._via is None or self._via.breaks
        if (spent or full) and own and not self._may_serve(fn, lead, args, kwargs):
            # Past its budget (or holding all the graphs one capture may), a capture that would recompile runs the
            # original forward, asked of the guards directly: through dynamo's eager_on_recompile stance each such
            # call cost ~140 us of dynamo's Python per layer on the H200 (a growing KV cache makes every decode step
            # a new shape: generate() ran 0.88x eager). An outer capture steps aside for its layers' captures: under
            # that stance (global) they would run eager too, and find no site fused.
            return self._fall_back(SPENT if spent else FULL, args, kwargs, any_shape=not training)
        caller = rewrite.set_caller(id(self))
        scoped = self.enabled is not None and rewrite.enabled_keys() is None  # an `only()` block decides itself
        if scoped:
            rewrite.set_enabled(self.enabled)
        breaks = _graph_breaks() if self._owns is not None else None
        noted: list = []
        try:
            out = _NOT_SERVED
            if self._via is not None:
                out = self._served_by_class(lead, args, kwargs)
                if out is _NOT_SERVED:  # every shared capture of the class refuses it: a new one, owned by it
                    fn = self._found() if self._shares_class() else self._own()
                    captures, unfused = self._backend.captures, self._backend.unfused_graphs
                    breaks = _graph_breaks() if self._owns is not None else None
                    full = not spent and _full(fn, self._backend.captures)
            if out is _NOT_SERVED and (spent or full):
                # No new graph: dynamo runs the frame from a graph its guards accept, else eagerly (never reaching
                # its own recompile limit, whose warning would be the user's to read).
                with torch.compiler.set_stance("eager_on_recompile"), dynamo_limits_noted() as noted:
                    out = fn(*lead, *args, **kwargs)
            elif out is _NOT_SERVED:
                with dynamo_limits_noted() as noted:
                    out = fn(*lead, *args, **kwargs)
            for why in noted:
                self._note(why)
        except Exception as e:
            if _refused_by_context(e):
                # The caller's context refused the capture before it ran (another torch.compile region around this
                # call, as under TORCH_CUDA_SANITIZER): this call runs the original forward, later calls capture.
                return self._fall_back(f"{CONTEXT_REFUSED}: {exception_reason(e, named=(m,))}", args, kwargs)
            if training:
                # A training call's capture: training runs the original forward from now on, inference keeps
                # its capture (an outer one's whole stack, say).
                self._may_train = False
                why = f"training capture failed: {exception_reason(e, named=(m,))}"
                warnings.warn(f"fusion-advisor: patched {type(m).__name__}.forward could not train fused ({why}); "
                              "its training calls run the original forward", RuntimeWarning, stacklevel=2)
                return self._fall_back(why, args, kwargs)
            # A capture that cannot run (dynamo limitation, launcher import error, ...): say so once,
            # then behave exactly like the unpatched module.
            self.failed = f"capture failed: {exception_reason(e, named=(m,))}"
            warnings.warn(f"fusion-advisor: patched {type(m).__name__}.forward failed ({self.failed}); "
                          "running the original forward", RuntimeWarning, stacklevel=2)
            return self._fall_back(self.failed, args, kwargs)
        finally:
            rewrite.set_caller(caller)
            if scoped:
                rewrite.set_enabled(None)
        if self._backend.captures > captures:
            with self._lock:
                self._capturing_calls += 1
                shapes = _shapes_of(args, kwargs)
                self._captured_shapes.add(shapes)
                self._refusals.pop(shapes, None)
            if self._backend.unfused_graphs > unfused:
                self._note(UNPROFILED)
            if breaks is not None and _graph_breaks() > breaks:
                self._owns.breaks = True  # the other instances compile their own from now on
        if graphs_run() == ran:  # dynamo ran the frame without our graph (recompile limit, skipped frame)
            why = SPENT if spent else FULL if full else "dynamo ran it without a captured graph"
            self._note(why)
        return out

    def __deepcopy__(self, memo):
        new = PatchedForward(copy.deepcopy(self.module, memo), self.specs, copy.deepcopy(self.saved, memo), self.outer,
                             self.inductor)
        new.failed, new.enabled, new.active, new.train_fused = self.failed, self.enabled, self.active, self.train_fused
        new.gradient_calls = copy.deepcopy(self.gradient_calls, memo)  # (shared by the copy's forwards, via memo)
        return new

    def __reduce__(self):
        return (PatchedForward, (self.module, self.specs, self.saved, self.outer, self.inductor),
                {"failed": self.failed, "enabled": self.enabled, "active": self.active, "train_fused": self.train_fused,
                 "gradient_calls": self.gradient_calls})

    def __setstate__(self, state: dict) -> None:
        self.failed, self.enabled = state.get("failed"), state.get("enabled")
        self.active = state.get("active", not self.outer)
        self.train_fused = state.get("train_fused", False)
        self.gradient_calls = state.get("gradient_calls", self.gradient_calls)

    def __repr__(self) -> str:
        tier = f"outer, {'on' if self.active else 'off'}; " if self.outer else ""
        return f"<fusion-advisor patched forward of {type(self.module).__name__} ({tier}{', '.join(self.keys)})>"


_CLASS: dict = {}  # (captured function, plan digest) -> [ClassCapture]: the class's shared captures
_CLASS_LOCK = threading.RLock()  # `_CLASS` is every model's: instances in any thread found and forget captures
MAX_CLASS_CAPTURES = 16  # shared captures per class and plan (a stage's first block, its others, per stage)
_NOT_SERVED = object()
_REFUSED = "Detected recompile when torch.compile stance is 'fail_on_recompile'"


class ClassCapture:
    """One compiled function shared by the patched instances of a class that have one plan: compiled (and
    recompiled) only by its owner, the first instance that ran; the others call it without compiling. A class
    has several where its instances differ in what dynamo guards on (shapes, submodules: ResNet-50's sixteen
    bottleneck blocks are eight graphs, each stage's first block and its others): an instance every one of
    them refuses owns a new one, which the next instances like it join (it traced 16 times, now 8)."""

    def __init__(self, fn: Callable, backend: Backend, owner: PatchedForward, key: tuple):
        self.backend = backend
        self.compiled = compile_fresh(fn, backend, holder=self, graphs=graphs_per_capture())
        # The registry keeps no module alive, and lets go of the capture once its owner is gone: instances
        # it serves hold it themselves; otherwise its compiled graphs (and their CUDA-graph recordings, the
        # pool memory they keep) are freed with the model, as dynamo's cache on its code object goes.
        self.owner = weakref.ref(owner, functools.partial(_forget_capture, key, weakref.ref(self)))
        self.breaks = False  # the owner's capture broke into several frames: nobody else joins it
        self.served = self.refused = 0  # calls of other instances it served / instances its guards refused

    @property
    def diverges(self) -> bool:
        """Two instances refused and none served (HF layers guarding on their `layer_idx`): the next ones
        compile their own without asking (a refusal costs dynamo's account of the failed guards)."""
        return self.refused >= 2 and not self.served


def _forget_capture(key: tuple, entry: weakref.ref, _owner) -> None:
    classes = _CLASS  # None once the interpreter is shutting down (its modules' globals cleared): nothing to do
    if classes is None or entry() is None:
        return
    with _CLASS_LOCK:
        entries = classes.get(key) or []
        if entry() in entries:
            entries.remove(entry())
        if not entries:
            classes.pop(key, None)


def _served(fn: Callable, lead: tuple, args, kwargs):
    """The shared capture's output, or `_NOT_SERVED` when dynamo would have to compile for these inputs
    (its guards refuse them: raised before the frame runs, so nothing ran). The guards are asked first
    (`_guards_accept`): a refusal raised under dynamo's `fail_on_recompile` stance keeps the capture's
    backend alive for the rest of the process (torch 2.13: its failing callback is never released), and
    with it the owner's graphs; HF decoder layers, which guard on their `layer_idx`, were each refused."""
    if _guards_accept(fn, lead, args, kwargs) is False:
        return _NOT_SERVED
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            return fn(*lead, *args, **kwargs)
    except RuntimeError as e:
        if str(e).startswith(_REFUSED):
            return _NOT_SERVED
        raise


CONTEXT_REFUSED = "a call whose context refused the capture (it ran the original forward; later calls capture)"
_CONTEXT_ERRORS = ("attempted to set_stance in a torch.compile region",)


def _refused_by_context(e: BaseException) -> bool:
    """Whether `e` is dynamo refusing to start (or steer) a capture where this call came from, before anything
    ran: the call's context, not the capture, is at fault, so the module must not fall back for good."""
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _CONTEXT_ERRORS)


def _shapes_of(args, kwargs) -> tuple:
    """The shapes and dtypes of a call's tensors, top level and one level into tuples and lists (HF's rotary
    tables): what a capture's guards (dynamic=False) hold exactly, among other things."""
    out = []
    for a in (*args, *kwargs.items()):
        if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str):  # a keyword argument
            out.append(a[0])
            a = a[1]
        if isinstance(a, torch.Tensor):
            out.append((a.shape, a.dtype))
        elif isinstance(a, (tuple, list)):
            out.append(tuple((x.shape, x.dtype) if isinstance(x, torch.Tensor) else type(x) for x in a))
        else:
            out.append(type(a))
    return tuple(out)


def _guards_accept(fn: Callable, lead: tuple, args, kwargs) -> bool | None:
    """Whether one of the compiled entries of `fn` (a `compile_fresh` function) accepts these arguments,
    by the guards dynamo would check on entry; None where that cannot be told (no entries yet, another
    torch's internals): the caller then asks dynamo itself."""
    fresh = getattr(fn, "_fusion_advisor_fresh", None)
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

        entries = _debug_get_cache_entry_list(fresh.__code__)
        if not entries:
            return None
        # The frame's own locals: its parameters (a decorator's `wrapper(*args, **kwargs)`, not the signature
        # it advertises) and the free variables it closes over, which dynamo's guards read as locals too.
        signature = fresh.__dict__.get("_fusion_advisor_signature")
        if signature is None:  # (computed once: 70 us a call on this project's CPU)
            signature = fresh._fusion_advisor_signature = inspect.signature(fresh, follow_wrapped=False)
        bound = signature.bind(*lead, *args, **kwargs)
        bound.apply_defaults()
        f_locals = dict(bound.arguments)
        f_locals.update(zip(fresh.__code__.co_freevars, (c.cell_contents for c in fresh.__closure__ or ())))
        return any(e.guard_manager.check(f_locals) for e in entries)
    except Exception:  # noqa: BLE001  (internals moved: dynamo decides, as before)
        return None


def graphs_per_capture() -> int:
    """The graphs one compiled function may hold: `GRAPHS_PER_CAPTURE`, or dynamo's recompile limit where the user
    set that lower (read when the function is compiled)."""
    try:
        return max(1, min(GRAPHS_PER_CAPTURE, int(torch._dynamo.config.recompile_limit)))
    except Exception:  # noqa: BLE001
        return GRAPHS_PER_CAPTURE


def _full(fn: Callable, captured: int) -> bool:
    """Whether the compiled function `fn` (`compile_fresh`) holds as many graphs as one capture may: a call its
    guards refuse then runs without compiling (`FULL`). Dynamo would compile up to its `recompile_limit` and then
    print its warning block on the user's terminal. `captured`: the graphs its backend was handed (at least its
    entries, so most calls are answered without asking dynamo)."""
    limit = getattr(fn, "_fusion_advisor_graphs", None) or GRAPHS_PER_CAPTURE
    if captured < limit:
        return False
    held = cached_graphs(fn)
    return held is not None and held >= limit  # (internals moved: dynamo's own limit applies)


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


class HookWatch:
    """Whether hooks or forwards inside a captured module changed since it was captured. Dynamo does not
    guard on them, so a hook added later on a submodule would silently never run. Checked on every call:
    one comparison of a global counter and of the hook dicts' sizes (a few µs for a decoder layer).

    Hooks added later that do nothing unless their library asks for something in the call at hand
    (`dormant_hook`: HF's output-capturing hooks, installed on the first call asking for
    `output_hidden_states` or `output_attentions`) are taken in, not counted as a change: a call in which one
    is live runs the original forward for that call only (`EXTRA_OUTPUTS`), every other call the capture,
    which those hooks would have left as it is."""

    def __init__(self, module: torch.nn.Module):
        from torch.nn.modules import module as nn_module

        # The module's own hooks run around the patched forward, outside the capture: always honoured.
        self.subs = list(module.modules())[1:]
        self.dicts = [d for m in self.subs for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks,
                                                 m._backward_pre_hooks)]
        self.dicts += [getattr(nn_module, name) for name in _GLOBAL_HOOKS]
        self.dormant: list[Callable[[], bool]] = []  # whether each kind of dormant hook taken in is live now
        self._seen()

    def _seen(self) -> None:
        """The hooks as they are now are the ones the capture stands for."""
        self.keys = self._keys()
        self.sizes = self._sizes()
        self.next_id = RemovableHandle.next_id

    def _sizes(self) -> tuple:
        return tuple(map(len, self.dicts)) + tuple(id(m.__dict__.get("forward")) for m in self.subs)

    def plain(self) -> bool:
        """No hooks on any module inside, and no instance-level forward there: what a capture of another
        instance of the class (which dynamo's guards do not check for hooks) may stand for."""
        own = len(self.dicts) - len(_GLOBAL_HOOKS)
        return not any(self.dicts[:own]) and all("forward" not in m.__dict__ for m in self.subs)

    def _keys(self) -> tuple:
        return tuple(tuple(d) for d in self.dicts)

    def changed(self) -> str | None:
        """None when nothing changed (or only dormant hooks came, none live in this call), else what did (in words)."""
        if RemovableHandle.next_id != self.next_id or self._sizes() != self.sizes:
            if self._sizes()[len(self.dicts):] != self.sizes[len(self.dicts):]:
                return "a forward replaced after patching"
            if self._keys() != self.keys:
                if not self._only_dormant_added():
                    return "hooks registered or removed after patching"
            self._seen()  # a hook elsewhere (a tensor's, another model's), or dormant ones taken in
        return EXTRA_OUTPUTS if any(live() for live in self.dormant) else None

    def _only_dormant_added(self) -> bool:
        """Whether the only change is hooks added that are dormant (`dormant_hook`); if so they are taken in."""
        added = []
        for d, keys in zip(self.dicts, self.keys):
            if not set(keys) <= d.keys():
                return False  # one removed: the capture ran it
            added += [d[k] for k in d.keys() - set(keys)]
        lives = [dormant_hook(h) for h in added]
        if not added or any(live is None for live in lives):
            return False
        self.dormant += [live for live in dict.fromkeys(lives) if live not in self.dormant]
        return True


EXTRA_OUTPUTS = ("a call asking for extra outputs (output_hidden_states, output_attentions): the original forward ran "
                 "that call, whose hooks collect them; other calls run fused")


def dormant_hook(hook: Callable) -> Callable[[], bool] | None:
    """For a hook known to do nothing unless its library asks for something in the current call: a function
    telling whether it is live now; else None. HF's output-capturing hooks (transformers >= 5) record layer
    outputs only while a model call asking for them has a collector holding their key (`_active_collector`)."""
    if getattr(hook, "__name__", None) != "output_capturing_hook":
        return None
    collector = getattr(sys.modules.get(getattr(hook, "__module__", None) or ""), "_active_collector", None)
    return None if collector is None or not callable(getattr(collector, "get", None)) else _collecting(collector)


@functools.lru_cache(maxsize=None)
def _collecting(collector) -> Callable[[], bool]:
    """One function per collector (so that a watch lists each kind once). A call asking for nothing opens an empty one."""
    return lambda: bool(collector.get())




_log = logging.getLogger(__name__)
_TRACERS_TOLD: set = set()  # which whole-model tracers the log has named already (once per process each)


def _traced(m: torch.nn.Module) -> bool:
    """Whether a tracer is recording this call: dynamo (an outer capture, the user's `torch.compile`,
    `torch.export`), `torch.jit.trace` or FX's symbolic trace. Each then sees the original forward: a
    capture of ours inside it could only fail (jit.trace refuses a dynamo-compiled function, and the failure
    used to switch the module to its original forward for good) or stand in its graph for the model's ops.
    The exporting tracers are told once in the log that their graph holds the model's own ops (not from
    inside dynamo, which would break its graph on the logging call)."""
    if torch.compiler.is_dynamo_compiling():
        return True
    if torch.compiler.is_exporting():
        tracer = "torch.export"
    elif torch.jit.is_tracing():
        tracer = "torch.jit.trace"
    elif torch.fx._symbolic_trace.is_fx_symbolic_tracing():
        tracer = "torch.fx"
    else:
        return torch.compiler.is_compiling()
    if tracer not in _TRACERS_TOLD:
        _TRACERS_TOLD.add(tracer)
        _log.info("fusion-advisor: %s traces the original forward of the patched %s (and of every patched module): "
                  "its graph holds the model's own ops, not the fused kernels; the patched model itself still runs "
                  "them", tracer, type(m).__name__)
    return True


def _nested_input(args, kwargs) -> bool:
    """Whether a nested tensor is among the call's arguments (PyTorch's nested-tensor fast path hands them to
    `nn.TransformerEncoder`'s layers). Only the arguments themselves are looked at: a few hundred ns a call."""
    for x in args:
        if isinstance(x, torch.Tensor) and x.is_nested:
            return True
    for x in kwargs.values():
        if isinstance(x, torch.Tensor) and x.is_nested:
            return True
    return False


def _needs_autograd(m: torch.nn.Module, args, kwargs) -> bool:
    if not torch.is_grad_enabled():
        return False
    if any(p.requires_grad for p in m.parameters()):
        return True
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in tree_leaves((args, kwargs)))
