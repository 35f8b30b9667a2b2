"""Patch fused kernels into a live model, reversibly.

    handle = advisor.patch(model, "advisor_out")     # the plan `apply` / `optimize` wrote
    handle = advisor.patch(model, plan)              # or a `Plan` built in-process
    advisor.unpatch(model)                           # the original forwards, bit for bit

Each target module's `forward` becomes a `PatchedForward` (an instance attribute; the class is never
touched): it runs the module's captured, rewritten forward (see `capture`), or the original forward
when patches are off or autograd needs it; on a GPU the captured forward is replayed from CUDA
graphs (`graphs`). `unpatch` deletes the attribute again (or puts back an
instance-level forward that was there before), so the module is exactly as it was. Patched models
survive `state_dict` save/load, `.to()`, `eval()/train()` (dynamo guards recompile, and sites whose
guard no longer holds run the original ops), `copy.deepcopy` and pickling.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from advisor.errors import AdvisorError
from advisor.kernels import derived
from advisor.kernels.linear_cross_entropy import CausalLMLossForward
from advisor.patching import decode, rewrite, triton_setup
from advisor.patching.forward import GradientCalls, PatchedForward
from advisor.patching.graphs import clear_recordings
from advisor.patching.modules import called_ancestor, contains, outermost, qualified, resolve, underneath
from advisor.patching.plan import Plan, PatternSpec, Target, build_plan, load_plan, manifest_entry, \
    occurrence_modules, spec_from_candidate

__all__ = ["patch", "unpatch", "patches_off", "only", "whole", "Patched", "Plan", "PatternSpec", "Target", "build_plan",
           "load_plan", "occurrence_modules", "spec_from_candidate", "patched_modules"]


@dataclass
class Patched:
    """What `patch` did to a model. Site counts fill in once the patched modules have run."""

    model: torch.nn.Module
    plan: Plan
    modules: list = field(default_factory=list)  # [(qualified name, module, [PatternSpec])]
    unresolved: list = field(default_factory=list)  # trace paths that do not fit this model
    forwards: dict = field(default_factory=dict, repr=False)  # qualified name -> PatchedForward installed

    def _logs(self, key: str | None = None) -> list:
        """One log per distinct capture (modules of one class share theirs)."""
        seen = {}
        for qual, _, specs in self.modules:
            f = self.forwards[qual]
            if key is None or any(s.key == key for s in specs):
                seen.setdefault(id(f.log()), f.log())
        return list(seen.values())

    def sites(self, key: str) -> int:
        """Substituted occurrences of a pattern in the graphs captured so far (shared graphs count once)."""
        return sum(log.count(key) for log in self._logs(key))

    def site_objects(self, key: str) -> list:
        return [s for log in self._logs(key) for s in log.sites.get(key, [])]

    def rejected(self, key: str) -> list[str]:
        return [r for log in self._logs(key) for r in log.rejected.get(key, [])]

    def errors(self) -> list[str]:
        return [e for log in self._logs() for e in log.errors]

    def launches(self) -> dict:
        """{Site: times its launcher ran} over this model's captures: taken before and after a call, it
        says which substitutions actually ran (a capture can hold sites the call never reaches)."""
        return {site: n for log in self._logs() for site, n in log.launches().items()}

    def fallbacks(self) -> dict[str, dict[str, int]]:
        """{module: {why it ran its original forward: calls}} since patching (hooks added later, capture
        budget spent, a capture that failed)."""
        return {q or type(self.model).__name__: dict(f.fallbacks) for q, f in self.forwards.items() if f.fallbacks}

    def inductor_graphs(self) -> dict[str, int]:
        """`optimize(..., inductor=True)`: {"compiled", or why a graph runs op by op: inference graphs}, over
        every capture of this model (empty when Inductor was not asked for)."""
        return inductor_outcomes(self._logs())

    def attention_layouts(self) -> dict[str, int]:
        """{attention input laid out for SDPA's fused kernels, and why: graphs} over every capture of this model
        (`attention_layout`)."""
        return attention_layouts(self._logs())

    def gemm_epilogues(self) -> dict[str, int]:
        """{linear + activation run as one cuBLASLt GEMM, and why: sites} over every capture of this model
        (`gemm_epilogues`)."""
        return gemm_epilogue_notes(self._logs())

    def graphs_not_used(self) -> dict[str, str]:
        """{module: why} for the captures whose CUDA graphs are not replayed (a recording that failed, or was
        refused where its memory could not be made safe: `graph_pools`): they run op by op."""
        out = {}
        for q, f in self.forwards.items():
            backend = f._backend
            for g in [*getattr(backend, "inference_graphs", ()), *getattr(backend, "train_graphs", ())]:
                if g.failed:
                    out.setdefault(q or type(self.model).__name__, g.failed)
        return out

    @property
    def enabled(self):
        """Pattern keys whose launchers run (None: every patched one); set by selection (`enable`)."""
        return next((f.enabled for f in self.forwards.values()), None)

    def graph_keys(self) -> list[str]:
        """The `aot_cache` keys of the inference graphs this model's captures lowered or rebuilt so far (a bundle
        carries them: a fresh process's capture skips AOTAutograd)."""
        return sorted({k for f in self.forwards.values() for k in getattr(f._backend, "graph_keys", ())})

    def kernels_written(self) -> None:
        """See `PatchedForward.kernels_written`."""
        for f in self.forwards.values():
            f.kernels_written()

    @property
    def outer(self) -> list:
        """The outer captures' forwards (see `capture`): over the layer captures, off until `set_outer`."""
        return [f for f in self.forwards.values() if f.outer]

    @property
    def outer_on(self) -> bool:
        return any(f.active for f in self.outer)

    def set_outer(self, on: bool) -> None:
        """Run the outer captures (True) or the layer captures inside them (False) from now on."""
        for f in self.outer:
            f.active = bool(on)

    def train_fused(self, on: bool) -> None:
        """Calls needing gradients run the fused kernels with their generated backwards (True), or the
        original forward at eager's cost (False, the default)."""
        for f in self.forwards.values():
            f.train_fused = bool(on)

    def enable(self, keys) -> None:
        """Only these patterns run their launchers from now on; the others' sites run their original ops
        inside the captures (empty: the captures alone, replayed as CUDA graphs on a GPU)."""
        for f in self.forwards.values():
            f.enabled = None if keys is None else frozenset(keys)

    def settle(self, any_shape: bool = False) -> None:
        """The model is checked: from now on new shapes capture only a little more, then run the original forwards
        or, with `any_shape`, Inductor's dynamic-shape compile of them (`PatchedForward.settle`)."""
        for f in self.forwards.values():
            f.settle(any_shape)

    def any_shape_calls(self) -> dict[str, int]:
        """{module: calls} that Inductor's dynamic-shape compile of its forward ran (`settle(any_shape=True)`)."""
        return {q or type(self.model).__name__: f.any_shape.calls for q, f in self.forwards.items()
                if f.any_shape is not None and f.any_shape.calls}

    def any_shape_graphs(self) -> dict[str, int]:
        """{module: graphs} dynamo compiled for those calls (one per family of shapes: recompiles made visible)."""
        return {q or type(self.model).__name__: n for q, f in self.forwards.items()
                if f.any_shape is not None and (n := f.any_shape.graphs())}

    def manifest(self, matched_only: bool = True) -> list[dict]:
        """apply.json's manifest: one entry per patched module and pattern (found there, by default)."""
        out = []
        for qual, mod, specs in self.modules:
            f = self.forwards[qual]
            log = f.log()
            for s in specs:
                if log.count(s.key) or not matched_only:
                    out.append(manifest_entry(s, qualified(self.model, qual), type(mod).__name__, log.count(s.key), f.outer))
        return out

    def unpatch(self) -> None:
        unpatch(self.model)


def patch(model: torch.nn.Module, plan: Plan | str | Path) -> Patched:
    """Patch `model` in place with a plan (or the plan in an `apply`/`optimize` output directory); a
    `torch.compile` wrapper's module underneath (`underneath`)."""
    model = underneath(model)
    derived.stale_all()  # the model may have trained unpatched since its folds were made (BatchNorm statistics)
    if isinstance(plan, (str, Path)):
        plan = load_plan(Path(plan))
    if any(s.replacement == "kernel" for s in plan.patterns):
        triton_setup.start()  # while the model is captured, before its first launch
    unpatch(model)
    wanted: dict[str, list[str]] = {}
    over: dict[str, list[str]] = {}  # outer targets: installed over the others, off until switched on
    unresolved = []
    for t in plan.targets:
        r = resolve(model, t.module)
        if r is None:
            unresolved.append(t.module)
            continue
        keys = (over if t.outer else wanted).setdefault(called_ancestor(model, r[0]), [])
        keys.extend(k for k in t.keys if k not in keys)
    if not wanted:
        wanted, over = over, {}  # only outer targets (a manifest of an outer capture): captured as usual
    if plan.targets and not wanted:
        raise AdvisorError(f"none of the plan's modules is in this {type(model).__name__} "
                           f"(the plan names {', '.join(sorted({t.module for t in plan.targets})[:3])}, ...)")
    order = [p.key for p in plan.patterns]
    done = Patched(model, plan, unresolved=unresolved)
    # A capture of a module contains every module it calls, so nested targets merge into the outer one.
    for outer in outermost(list(wanted)):
        keys = {k for q, ks in wanted.items() if contains(outer, q) for k in ks}
        specs = [plan.spec(k) for k in order if k in keys]
        mod = model.get_submodule(outer) if outer else model
        saved = mod.__dict__.get("forward")
        mod.forward = done.forwards[outer] = PatchedForward(mod, specs, saved, inductor=plan.inductor)
        done.modules.append((outer, mod, specs))
    for qual in outermost(list(over)):
        if any(contains(q, qual) for q in done.forwards):
            continue  # a capture of its own already holds it
        specs = [plan.spec(k) for k in order if k in over[qual]]
        mod = model.get_submodule(qual) if qual else model
        mod.forward = done.forwards[qual] = PatchedForward(mod, specs, mod.__dict__.get("forward"), outer=True,
                                                           inductor=plan.inductor)
        done.modules.append((qual, mod, specs))
    gradient_calls = GradientCalls(type(model).__name__)  # said once per model, not once per patched layer
    for f in done.forwards.values():
        f.gradient_calls = gradient_calls
    done.set_outer(plan.outer_on)  # as selection left it when the plan was written
    done.enable(plan.enabled)
    return done


def inductor_outcomes(logs) -> dict[str, int]:
    """{"compiled", or why a graph runs op by op: inference graphs} over capture logs (`CaptureLog.inductor`)."""
    return _tally(outcome for log in logs for outcome in log.inductor)


def attention_layouts(logs) -> dict[str, int]:
    """{attention input laid out for SDPA's fused kernels, and why: graphs} over capture logs."""
    return _tally(note for log in logs for note in log.layouts)


def gemm_epilogue_notes(logs) -> dict[str, int]:
    """{linear + activation run as one cuBLASLt GEMM, and why: sites} over capture logs."""
    return _tally(note for log in logs for note in log.epilogues)


def _tally(lines) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in lines:
        out[line] = out.get(line, 0) + 1
    return out


def unpatch(model: torch.nn.Module) -> int:
    """Restore every patched forward under `model` (an LM head's fused loss too: `optimize(train=True)`);
    returns how many modules were restored."""
    n = 0
    for _, mod in model.named_modules():
        f = mod.__dict__.get("forward")
        if isinstance(f, (PatchedForward, CausalLMLossForward)):
            if f.saved is not None:
                mod.forward = f.saved
            else:
                del mod.forward
            n += 1
    decode.restore(model)  # `optimize(..., decode=True)`'s generation config, as the user had it
    if n:
        clear_recordings()  # their CUDA graphs hold buffers; still-patched models simply record again
    return n


def patched_modules(model: torch.nn.Module) -> list[tuple[str, PatchedForward]]:
    return [(q, m.__dict__["forward"]) for q, m in model.named_modules()
            if isinstance(m.__dict__.get("forward"), PatchedForward)]


@contextlib.contextmanager
def patches_off():
    """Every patched forward runs its original code inside this block (the reference for comparisons)."""
    old = rewrite.set_off(True)
    try:
        yield
    finally:
        rewrite.set_off(old)


@contextlib.contextmanager
def whole(on: bool = True):
    """Inside this block outer captures run (True) or step aside for the layer captures (False)."""
    old = rewrite.set_outer(on)
    try:
        yield
    finally:
        rewrite.set_outer(old)


@contextlib.contextmanager
def only(keys):
    """Inside this block only the patterns in `keys` run their launchers; other sites run the original ops."""
    old = rewrite.set_enabled(keys)
    try:
        yield
    finally:
        rewrite.set_enabled(old)
