"""`advisor.optimize(model, example_inputs)`: dynamic fusion of a live model, in this process.

    report = advisor.optimize(model, (input_ids,), top=5)   # profiles, analyses, generates, patches
    print(report)                                           # what was patched where, and why not
    advisor.unpatch(model)                                  # back to the original, bit for bit

Steps: profile a few calls (inference mode) into OUT/trace, analyse (OUT/analysis.json), generate and
validate kernels for the top candidates (the generator's on-disk cache makes repeats cheap), patch
the model in place, run it patched and unpatched on the example inputs and unpatch any pattern whose
outputs differ, on a GPU keep only the patterns that make the call faster (`keep_faster`), write
OUT/apply.json (patterns, manifest) so `advisor.patch(other_model, OUT)` can re-apply the same plan
later, and store the plan in the cache: a second `optimize` of the same model and input shapes
re-patches and re-checks it without profiling (`advisor.workflows.plan_cache`). With `benchmark=True`
(meaningful on a GPU) also times the call before and after, and each pattern applied alone.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from advisor.status import Status

SCHEMA_VERSION = 1


@dataclass
class OptimizeReport:
    out_dir: Path
    patterns: list  # apply.json `patterns` records, with patch status
    manifest: list
    check: dict
    end_to_end: dict | None = None
    handle: object = field(default=None, repr=False)
    phases_s: dict = field(default_factory=dict)  # wall seconds per step of the cold path
    selection: dict | None = None  # what selection handed back, and why (apply.json `selection`)

    @property
    def applied(self) -> list:
        return [p for p in self.patterns if p.get("patched") and p.get("kept", True)]

    def __str__(self) -> str:
        lines = [f"fusion-advisor: {len(self.applied)} of {len(self.patterns)} patterns patched "
                 f"(plan in {self.out_dir})"]
        for p in self.patterns:
            state = f"patched, {p['sites']} site(s)" if p in self.applied else p.get("status") or "not patched"
            lines.append(f"  {p['candidate']:>4} {p['title']}: {state}")
        for module, why in (self.handle.fallbacks() if self.handle is not None else {}).items():
            lines.append(f"  {module} ran its original forward: " + ", ".join(f"{w} ({n}x)" for w, n in why.items()))
        if self.selection and self.selection.get("decision"):
            lines.append(f"  selection: {self.selection['decision']}")
        if self.end_to_end:
            lines.append("  " + describe_timing(self.end_to_end))
        return "\n".join(lines)


def describe_timing(e2e: dict) -> str:
    if not e2e.get("timing_meaningful"):
        return f"timing: not meaningful here ({e2e.get('reason')})"
    return f"{e2e['before_ms']:.3f} ms -> {e2e['after_ms']:.3f} ms per call ({e2e['speedup']:.2f}x)"


def optimize(model: torch.nn.Module, example_inputs, top: int = 5, out=None, replacement: str = "kernel",
             calls: int = 3, benchmark: bool = False, iters: int = 20,
             granularity: str = "layer", reuse: bool = True, select: bool | None = None,
             interpret: bool = False) -> OptimizeReport:
    """Profile, analyse, generate, validate and patch `model` in place; returns an `OptimizeReport`.

    top: candidates to generate kernels for; out: where the plan goes (a temporary folder by default);
    calls: profiled calls; benchmark: also time before/after and each pattern alone (GPU);
    granularity: what a capture holds (`layer`, `occurrence`, `pattern`, `root`); reuse: re-apply a
    stored plan for the same model and input shapes; select: on a GPU keep only what is faster
    (default on); interpret: without a GPU, patch anyway with kernels running in Triton's interpreter
    (for checks and tests: 100-2,000x slower than the model's own ops, so off by default: the model
    is then left as it was and the report says why).
    """
    from advisor.analyze.api import analyze
    from advisor.bench.timing import Stopwatch
    from advisor.bench.trace import profile_calls
    from advisor.patching import build_plan, load_plan, occurrence_modules, patch, unpatch
    from advisor.workflows import plan_cache
    from advisor.patching.graphs import clear_recordings
    from advisor.workflows.kernels import kernel_specs
    from advisor.patching.verify import check, float32_reference
    from advisor.interpreter import use_interpreter_without_gpu

    use_interpreter_without_gpu()
    args, kwargs = split_inputs(example_inputs)
    device = _device_of(model, args, kwargs)
    out_dir = Path(out) if out else Path(tempfile.mkdtemp(prefix="fusion-advisor-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    unpatch(model)  # profile the original

    def call():  # as most users call a model for inference (HF's docs, eval loops)
        with torch.no_grad():
            return model(*args, **kwargs)

    def call_in_inference_mode():  # the other common way: captured too, so neither waits for dynamo later
        with torch.inference_mode():
            return model(*args, **kwargs)

    phases = Stopwatch()
    options = {"top": top, "replacement": replacement, "granularity": granularity, "select": select is not False}
    key_parts: dict = {}
    key = plan_cache.fingerprint(model, args, kwargs, device, options, key_parts) if reuse else None
    with phases("reuse"):
        reused = bool(key) and plan_cache.fetch(key, out_dir)
    if reused:  # the same model and inputs were optimised before: its plan, re-checked below
        doc = json.loads((out_dir / "analysis.json").read_text())
        records = json.loads((out_dir / "apply.json").read_text())["patterns"]
        with phases("patch"):
            plan = load_plan(out_dir)
            specs = plan.patterns
            handle = patch(model, plan)
            enabled = json.loads((out_dir / "apply.json").read_text()).get("enabled")
            handle.enable(None if enabled is None else frozenset(enabled))  # as selected when it was stored
    else:
        with phases("profile"):
            trace_dir = profile_calls(call, out_dir, device, calls)
        with phases("analyze"):
            analysis = analyze(trace_dir)
            analysis.to_json(out_dir / "analysis.json")
            doc = analysis.doc
        with phases("generate"):
            specs, records = kernel_specs(doc, top, replacement, out_dir, device)
        with phases("patch"):
            plan = build_plan(specs, doc, occurrence_modules(analysis), granularity)
            handle = patch(model, plan)
    if device != "cuda" and not interpret:  # kernels would run in Triton's interpreter: never a speedup
        unpatch(model)
        records = interpreter_only(records, specs)
        out = {"schema_version": SCHEMA_VERSION, "replacement": replacement, "device": device,
               "patterns": records, "manifest": [], "check": None, "end_to_end": None,
               "phases_s": phases.seconds, "plan_reused": reused, "plan_key": key,
           "plan_key_parts": key_parts,
               "selection": {"decision": "nothing patched: no GPU (interpret=True patches anyway, for checks)",
                             "kept": []}}
        write_json(out_dir / "apply.json", out)
        return OptimizeReport(out_dir, records, [], {}, None, None, phases.seconds, out["selection"])
    before = handle.launches()
    with phases("check"):  # the first patched call captures the modules (dynamo) and runs the kernels
        chk = check(call, handle, float32_reference(model, args, kwargs))
    handle = chk.handle
    if chk.dropped:  # re-patched without them: capture (and count launches) with what is left
        call()
    with phases("check"):
        call_in_inference_mode()
    records = pattern_status(records, specs, handle, chk.dropped, doc, launched_sites(before, handle.launches()))
    selection = timed = None
    if select is not False and not reused:  # a reused plan was selected when it was stored
        with phases("select"):
            selected, selection = keep_faster(call, handle, device, records, iters)
        timed = selection.pop("timing", None)
        if selected is not handle or selection.get("state") not in (None, "all"):
            timed, handle = None, selected  # what runs now is not the all-patched state timed first
    e2e = (timed or time_patterns(call, handle, device, iters, records)) if benchmark else None
    if selection is not None or e2e is not None:
        clear_recordings()  # graphs recorded for the states timed above (each pattern alone, ...)
    handle.settle()
    out = {"schema_version": SCHEMA_VERSION, "replacement": replacement, "device": device,
           "patterns": records, "manifest": handle.manifest(), "check": chk.as_dict(), "end_to_end": e2e,
           "phases_s": phases.seconds, "plan_reused": reused, "plan_key": key,
           "plan_key_parts": key_parts, "selection": selection,
           "enabled": sorted(handle.enabled) if handle.enabled is not None else None,
           "skipped_targets": getattr(plan, "skipped", {})}
    write_json(out_dir / "apply.json", out)
    if key and not reused and out["manifest"]:
        plan_cache.store(out_dir, key)
    return OptimizeReport(out_dir, records, out["manifest"], out["check"], e2e, handle, phases.seconds, selection)


def pattern_status(records: list, specs: list, handle, dropped: dict, doc: dict | None = None,
                   launched: dict | None = None) -> list:
    """Each apply.json pattern record plus whether it is patched, where, and if not why (`status_code`
    and `status`). `launched`: {pattern key: sites whose launcher ran on the example inputs}; without
    it, sites substituted in the captured graphs count."""
    by_cand = {s.candidate: s for s in specs}
    captured_keys = {k for t in getattr(getattr(handle, "plan", None), "targets", []) for k in t.keys}
    skipped = getattr(getattr(handle, "plan", None), "skipped", {}) or {}
    uncaptured = getattr(getattr(handle, "plan", None), "uncaptured", {}) or {}
    out = []
    for r in records:
        r = dict(r)
        s = by_cand.get(r["candidate"])
        substituted = handle.sites(s.key) if s is not None and handle is not None else 0
        sites = substituted if launched is None or s is None else launched.get(s.key, 0)
        broken = [x.broken for x in handle.site_objects(s.key) if x.broken] if s is not None and handle else []
        r["sites"] = sites
        r["patched"] = bool(s is not None and sites and s.key not in dropped and not broken)
        code, why = Status.PATCHED, "patched"
        if s is None:  # (a reused plan's record keeps the status its first run found)
            code = Status(r.get("status_code") or Status.NOT_GENERATED)
            why = r.get("reason") or r.get("status") or "no kernel"
        elif s.key in dropped:
            code, why = Status.MISMATCH, f"unpatched: {dropped[s.key]}"
        elif broken:
            code, why = Status.LAUNCHER_FAILED, f"launcher failed, original ops run instead: {broken[0]}"
        elif handle is not None and s.key not in captured_keys:
            mods = uncaptured.get(s.key) or []
            where = f"{mods[0]}{f' (+{len(mods) - 1} more)' if len(mods) > 1 else ''}: {skipped.get(mods[0])}" \
                if mods else "no module of the model holds all its ops"
            code, why = Status.NOT_CAPTURED, f"not patched: its occurrences span modules that are not captured ({where})"
        elif not sites and handle is not None and not getattr(handle, "reached", True):
            code, why = Status.NOT_CALLED, "not patched: no module of the plan was called"
        elif not substituted:
            rejected = sorted(set(handle.rejected(s.key))) if handle else []
            code, why = Status.NOT_MATCHED, "not patched: its ops were not found in the captured graphs" \
                + (f" ({'; '.join(rejected)})" if rejected else " (the module computes it differently when captured)")
        elif not sites:
            code, why = Status.NOT_LAUNCHED, (f"not patched: substituted in {substituted} captured graph(s), but the example "
                                       "inputs never ran it (another model's capture, or a guard on shapes/dtypes)")
        r["status_code"], r["status"] = code, why
        out.append(r)
    # Overlapping patterns: the first in plan order takes the ops (an epilogue extends a pointwise group).
    extends = {c["id"]: c.get("extends") for c in (doc or {}).get("candidates", [])}
    patched = {r["candidate"]: r for r in out if r["patched"]}
    for r in out:
        base = patched.get(extends.get(r["candidate"]) or "")
        if not r["patched"] and r["status_code"] == Status.NOT_MATCHED and base is not None:
            r["status_code"] = Status.OVERLAP
            r["status"] = f"not patched: {base['candidate']} ({base['title'].split(':')[0]}) took its ops first"
    return out


def interpreter_only(records: list, specs: list) -> list:
    """The records of a run that patches nothing because its kernels would run in the interpreter."""
    validated = {s.candidate for s in specs}
    out = []
    for r in records:
        r = {**r, "sites": 0, "patched": False}
        if r["candidate"] in validated:
            r["status_code"] = Status.INTERPRETER
            r["status"] = ("validated, not patched: without a GPU its kernel runs in Triton's interpreter, "
                           "far slower than the model's own ops (interpret=True patches it anyway, for checks)")
        else:
            r["status_code"] = Status(r.get("status_code") or Status.NOT_GENERATED)
            r["status"] = r.get("reason") or "no kernel"
        out.append(r)
    return out


def launched_sites(before: dict, after: dict) -> dict:
    """{pattern key: (site, patched module) pairs whose launcher ran between two `Patched.launches()`
    snapshots}: a pattern substituted once in a capture that ten layers share runs at ten sites."""
    out: dict = {}
    for (site, _), n in after.items():
        if n > before.get((site, _), 0):
            out[site.key] = out.get(site.key, 0) + 1
    return out


@dataclass(frozen=True)
class Option:
    """One state the model can be handed back in, and what it measured."""

    name: str  # "all" | "kept" | "captured" (captures replayed, every site on its original ops)
    enabled: frozenset | None  # pattern keys whose launchers run (None: every one)
    ms: float


def choose(before_ms: float, noise_ms: float, options: list[Option]) -> Option | None:
    """The selection policy, on timings alone: the fastest option, if it beats the unpatched model by more
    than the measurement's noise (and 1%); None: leave the model unpatched."""
    best = min(options, key=lambda o: o.ms, default=None)
    margin = max(noise_ms, 0.01 * before_ms)
    return best if best is not None and best.ms < before_ms - margin else None


def keep_faster(call, handle, device: str, records: list, iters: int = 20) -> tuple:
    """On a GPU, never leave the model slower: time each patched pattern alone (`time_patterns`); then time,
    side by side with the unpatched model, every pattern on, only those that saved time alone, and the
    captures with no kernel (their CUDA-graph replay alone), and hand back the fastest (`choose`) as
    timed, or the model unpatched. Marks `kept` (and why not) on the records; returns (the handle now in
    force, the decision). Without meaningful timing nothing is dropped."""
    from advisor.bench.timing import time_configs, timing_meaningful
    from advisor.patching import only, patch, patches_off

    patched = [r for r in records if r.get("patched")]
    key_of = {s.candidate: s.key for s in handle.plan.patterns}
    if not patched:
        return handle, {"decision": "nothing patched", "kept": []}
    if not timing_meaningful(device):
        return handle, {"decision": "all patched patterns kept (timing not meaningful here: no selection)",
                        "kept": [r["candidate"] for r in patched]}
    e2e = time_patterns(call, handle, device, iters, records)
    out = {"all_patched": {k: e2e.get(k) for k in ("before_ms", "after_ms", "captured_only_ms", "speedup", "noise_ms")},
           "timing": e2e}  # the whole of it: `optimize(benchmark=True)` need not time the same handle again
    alone_kept = frozenset(key_of[r["candidate"]] for r in patched
                           if ((r.get("applied_alone") or {}).get("saved_us_per_iter") or 0) > 0)
    every = frozenset(key_of[r["candidate"]] for r in patched)
    states = {"all": None, "captured": frozenset()}
    if alone_kept and alone_kept != every:
        states["kept"] = alone_kept
    # The final comparison, in one interleaved run: what is chosen is what was timed last.
    t = time_configs(call, {"before": patches_off, **{k: (lambda e: lambda: only(e))(e) for k, e in states.items()}},
                     device, iters=iters)
    before = t["before"].median_ms
    noise = max(x.spread_ms for x in t.values())
    options = [Option(k, e, t[k].median_ms) for k, e in states.items()]
    out["final"] = {k: round(v.median_ms, 4) for k, v in t.items()} | {"noise_ms": round(noise, 4)}
    best = choose(before, noise, options)
    if best is None:
        handle = patch(handle.model, handle.plan.only(set()))  # every forward as it was
        out["decision"] = (f"nothing kept (the model runs unpatched): no state beats it beyond noise ({before:.3f} ms; "
                           + ", ".join(f"{o.name} {o.ms:.3f}" for o in options) + f"; noise {noise:.3f} ms)")
        enabled = frozenset()
    else:
        handle.enable(best.enabled)
        enabled = every if best.enabled is None else best.enabled
        what = {"all": "every patched pattern", "kept": f"the {len(enabled)} patterns that saved time alone",
                "captured": "the captured layers replayed as CUDA graphs, every site on its original ops"}[best.name]
        out["decision"] = f"kept {what}: {before:.3f} -> {best.ms:.3f} ms end to end (noise {noise:.3f} ms)"
        out["state"] = best.name
    out["enabled"] = sorted(enabled) if best is not None else None
    out["kept"] = [r["candidate"] for r in patched if key_of[r["candidate"]] in enabled and best is not None]
    for r in patched:
        r["kept"] = r["candidate"] in out["kept"]
        r["status_code"] = Status.PATCHED if r["kept"] else Status.NOT_KEPT
        alone = (r.get("applied_alone") or {}).get("saved_us_per_iter")
        r["status"] = "patched" if r["kept"] else \
            (f"not kept: {alone:+.0f} µs per call alone" if alone is not None else "not kept") + \
            ("" if best is not None or alone is None or alone <= 0 else ", but no patched state was faster end to end")
    return handle, out


def time_patterns(call, handle, device: str, iters: int, records: list) -> dict:
    """Per call: unpatched, patched, captured with every site on its original ops, and each patched
    pattern alone (its saving = captured-only minus alone), timed in interleaved rounds."""
    from advisor.bench.timing import time_configs, timing_meaningful
    from advisor.patching import only, patches_off

    if not timing_meaningful(device):
        return {"timing_meaningful": False, "device": device,
                "reason": "kernels run in Triton's interpreter on the CPU; no speedup is claimed"}
    alone = each_alone(handle, [r["candidate"] for r in records if r.get("patched")])
    configs = {"before": patches_off, "after": None, "captured_only": lambda: only(set()), **alone}
    t = time_configs(call, configs, device, iters=iters)
    cap = t["captured_only"].median_ms
    for r in records:
        if r["candidate"] in alone:
            a = t[r["candidate"]]
            r["applied_alone"] = {"ms": round(a.median_ms, 4), "captured_ms": round(cap, 4),
                                  "saved_us_per_iter": round((cap - a.median_ms) * 1e3, 2),
                                  "spread_us": round(max(a.spread_ms, t["captured_only"].spread_ms) * 1e3, 2),
                                  "est_saved_us_per_iter": r.get("est_time_saved_us")}
    before, after = t["before"], t["after"]
    return {"timing_meaningful": True, "device": device, "method": before.method, "iters": before.iters,
            "before_ms": round(before.median_ms, 4), "after_ms": round(after.median_ms, 4),
            "captured_only_ms": round(cap, 4),
            "speedup": round(before.median_ms / after.median_ms, 4) if after.median_ms else None,
            "noise_ms": round(max(before.spread_ms, after.spread_ms), 4),
            "before": before.as_dict(), "after": after.as_dict(), "captured_only": t["captured_only"].as_dict(),
            "note": "captured_only: the module captures with every site running its original ops; "
                    "before -> captured_only is what capturing alone changes (less Python per op)"}


def each_alone(handle, candidates: list) -> dict:
    """{candidate: context factory inside which only that pattern runs its launchers}, per candidate the
    handle's plan has (the configurations that time each pattern alone)."""
    from advisor.patching import only

    keys = {s.candidate: s.key for s in handle.plan.patterns}
    return {c: (lambda k: lambda: only({k}))(keys[c]) for c in candidates if c in keys}


def split_inputs(example_inputs) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _device_of(model, args, kwargs) -> str:
    for t in list(model.parameters())[:1] + [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]:
        return "cuda" if t.device.type == "cuda" else "cpu"
    return "cpu"


def write_json(path: Path, doc: dict) -> Path:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=_jsonable))
    tmp.replace(path)
    return path


def _jsonable(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)
