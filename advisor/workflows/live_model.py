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

import atexit
import json
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves

from advisor import agreement
from advisor.collect.in_process import profile_calls
from advisor.errors import AdvisorError, exception_details, exception_reason
from advisor.example_inputs import snapshot
from advisor.documents import ANALYSIS_FILE, APPLY_FILE, ApplyDoc, Selection, SelectionState, write_apply
from advisor.layout import rank_dir
from advisor.patching import load_plan, patch, unpatch
from advisor.patching import decode as decode_setup
from advisor.patching.modules import at_rest, underneath
from advisor.patching.plan import INDUCTOR_MODES
from advisor.patching.capture import launched_sites
from advisor.patching.forward import checking
from advisor.patching.graphs import clear_recordings
from advisor.patching.train_graphs import drop_training_recordings
from advisor.patching.verify import check, eval_if_unrepeatable, float32_reference
from advisor.records import PatternResult
from advisor.stopwatch import Stopwatch
from advisor.measure import timing as measure_timing  # read at call time: tests replace it
from advisor.workflows import counted, early_capture, pipeline, plan_cache, probe, route
from advisor.workflows.lm_loss import causal_lm_step, keep_faster_lm_loss
from advisor.workflows.outcome import interpreter_only
from advisor.workflows.selection import keep_faster, time_patterns
from advisor.workflows.training import keep_faster_training

@dataclass(repr=False)
class OptimizeReport:
    out_dir: Path
    results: list[PatternResult]  # what became of each candidate tried (apply.json's `patterns`)
    manifest: list
    check: dict
    end_to_end: dict | None = None
    handle: object = field(default=None, repr=False)
    phases_s: dict = field(default_factory=dict)  # wall seconds per step of the cold path
    selection: dict | None = None  # what selection handed back, and why (apply.json `selection`)
    training: dict | None = None  # with train=True: whether calls needing gradients run fused, and why
    modes: str | None = None  # set where optimize ran a model handed over in training mode in eval mode
    runs: dict | None = None  # fused launches counted on one call after the checks (`counted`)
    decode: str | None = None  # what `generate` does with the patched model (`patching.decode`)
    isolation: str | None = None  # with isolate=True: how the first capture in a probe process went (`probe`)

    @property
    def patterns(self) -> list[dict]:
        """apply.json's `patterns` records (the results as JSON)."""
        return [r.to_json() for r in self.results]

    @property
    def applied(self) -> list[dict]:
        """The records of the patterns in use: patched, and not dropped by selection."""
        return [r.to_json() for r in self.results if r.in_use]

    def __repr__(self) -> str:  # short, as in a notebook's echo or a log line; print() gives the summary
        return (f"<OptimizeReport out_dir={str(self.out_dir)!r} patterns={len(self.results)} "
                f"in_use={len(self.applied)}>")

    def __str__(self) -> str:
        lines = [f"fusion-advisor: {len(self.applied)} of {len(self.results)} patterns patched "
                 f"(plan in {self.out_dir})"]
        for r in self.results:
            state = f"patched, {r.sites} site(s)" if r.in_use else \
                (r.verdict.message if r.verdict else "") or "not patched"
            lines.append(f"  {r.candidate:>4} {r.title}: {state}")
        if self.runs is not None:
            lines.append(f"  runs: {self.runs['fused_launches_per_call']} fused kernel launch(es) per call (counted on "
                         "one call of the example inputs after the checks)")
        for module, why in (self.handle.fallbacks() if self.handle is not None else {}).items():
            lines.append(f"  {module} ran its original forward: " + ", ".join(f"{w} ({n}x)" for w, n in why.items()))
        for module, why in (self.handle.graphs_not_used() if self.handle is not None else {}).items():
            lines.append(f"  {module} runs its capture op by op, without a CUDA graph: {why}")
        if self.selection and self.selection.get("decision"):
            lines.append(f"  selection: {self.selection['decision']}")
        if self.training and self.training.get("decision"):
            lines.append(f"  training: {self.training['decision']}")
        if self.training and self.training.get("lm_loss"):
            lines.append(f"  training: {self.training['lm_loss']['decision']}")
        if self.modes:
            lines.append(f"  {self.modes}")
        if self.isolation:
            lines.append(f"  isolation: {self.isolation}")
        if self.decode:
            lines.append(f"  {self.decode}")
        if self.end_to_end:
            lines.append("  " + describe_timing(self.end_to_end))
        return "\n".join(lines)


def scratch_out_dir() -> Path:
    """The output folder of an `optimize` not given `out=`: in the temp directory, removed when the process
    exits. Not sooner: the patched model imports its kernels from it (a new input shape captures again), and
    `report.out_dir` names it for `advisor.patch` and `save_bundle` for as long as the report lives. The plan
    itself outlives it in the plan cache (a later `optimize` reuses it)."""
    d = Path(tempfile.mkdtemp(prefix="fusion-advisor-"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d


def describe_timing(e2e: dict) -> str:
    if not e2e.get("timing_meaningful"):
        return f"timing: not meaningful here ({e2e.get('reason')})"
    return f"{e2e['before_ms']:.3f} ms -> {e2e['after_ms']:.3f} ms per call ({e2e['speedup']:.2f}x)"


# One `optimize` at a time in a process, whichever thread asks: its steps use what the process has one of (the
# profiler and its execution-trace observer, which crashed the interpreter when two threads profiled at once;
# module hooks registered for every module; the random state its checks rewind), and dynamo compiles one frame at a
# time anyway. Patched models keep running in other threads meanwhile.
_OPTIMIZING = threading.RLock()


@dataclass(frozen=True)
class OptimizeOptions:
    """What `optimize` was asked to do, as `advisor.optimize` describes each argument; checked when made."""

    top: int | None = 5
    out: object = None  # the output folder (None: a scratch folder removed at exit)
    replacement: str = "kernel"
    calls: int = 3
    benchmark: bool = False
    iters: int = 20
    granularity: str = "layer"
    reuse: bool = True
    select: bool | None = None  # None as True: selection runs unless turned off
    interpret: bool = False
    train: bool = False
    train_memory: float = 0.0
    decode: bool = False
    isolate: bool | None = None
    # None: on a GPU both routes are timed and the faster kept (`route`); True or a mode of `plan.INDUCTOR_MODES`
    # ("max-autotune"): Inductor's route, in that mode
    inductor: bool | str | None = None
    dynamic: bool | None = None  # None: on a GPU; new shapes past the capture budget run Inductor's dynamic compile

    def any_shape(self, device: str) -> bool:
        """Whether calls at new shapes past the capture budget run Inductor's dynamic-shape compile of the
        forward (`patching.any_shape`) rather than its original ops."""
        return self.dynamic if self.dynamic is not None else device == "cuda"

    def __post_init__(self):
        m = self.train_memory
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m <= 1:
            raise AdvisorError(f"train_memory is the extra peak memory fused training may take, as a fraction from 0 "
                               f"to 1 (0.05: 5%); got {m!r}")
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise AdvisorError(f"dynamic is True, False or None (the default, chosen by the device); got {self.dynamic!r}")
        modes = [m for m in INDUCTOR_MODES if isinstance(m, str)]
        if self.inductor is not None and not isinstance(self.inductor, bool) and self.inductor not in modes:
            raise AdvisorError(f"inductor is True, False, None (the default, chosen by the device) or a mode "
                               f"({', '.join(map(repr, modes))}); got {self.inductor!r}")

    @property
    def inductor_route(self) -> bool | str:
        """Inductor's route taken without timing it against ours: its mode (True, or a mode's name), else False."""
        return self.inductor if self.inductor is not None else False

    @property
    def selecting(self) -> bool:
        return self.select is not False

    def for_probe(self) -> dict:
        """The arguments the probe process's own `optimize` takes (its output folder and isolation are its own;
        it never benchmarks)."""
        return {"top": self.top, "replacement": self.replacement, "calls": self.calls, "iters": self.iters,
                "granularity": self.granularity, "reuse": self.reuse, "select": self.select,
                "interpret": self.interpret, "train": self.train, "train_memory": self.train_memory,
                "decode": self.decode, "inductor": self.inductor, "dynamic": self.dynamic}


def optimize(model: torch.nn.Module, example_inputs, top: int | None = 5, out=None, replacement: str = "kernel",
             calls: int = 3, benchmark: bool = False, iters: int = 20,
             granularity: str = "layer", reuse: bool = True, select: bool | None = None,
             interpret: bool = False, train: bool = False, train_memory: float = 0.0,
             decode: bool = False, isolate: bool | None = None, inductor: bool | str | None = None,
             dynamic: bool | None = None) -> OptimizeReport:
    """Profile, analyse, generate, validate and patch `model` in place; returns an `OptimizeReport`.
    The arguments are described at `advisor.optimize`, the façade that calls this."""
    options = OptimizeOptions(top=top, out=out, replacement=replacement, calls=calls, benchmark=benchmark,
                              iters=iters, granularity=granularity, reuse=reuse, select=select, interpret=interpret,
                              train=train, train_memory=train_memory, decode=decode, isolate=isolate,
                              inductor=inductor, dynamic=dynamic)
    with _OPTIMIZING:
        model = underneath(model)  # a wrapper (torch.compile, DDP): the module it calls is optimised, the wrapper works on
        args, kwargs = split_inputs(example_inputs)
        if any(isinstance(t, torch.Tensor) and t.is_nested for t in tree_leaves((args, kwargs))):
            # PyTorch's execution-trace observer cannot record a nested tensor (it has no sizes): it disables itself
            # mid-profile and the profiler's next region crashed the interpreter (SIGSEGV); nor can dynamo capture one
            raise AdvisorError("nothing patched: the example inputs hold a nested tensor, which the profile cannot "
                               "record and a capture cannot follow; pass the padded tensors (and their padding mask) "
                               "instead")
        unpatch(model)  # profile the original (and probe it for random ops)
        isolation = None
        if probe.wanted(isolate):  # the first capture in a child process first: a crash there costs the user nothing
            isolation = probe.first_capture(model, snapshot(example_inputs), options.for_probe())
            if isolation.crashed:
                return left_unpatched(out, replacement, _device_of(model, args, kwargs), isolation)

        def call():  # as most users call a model for inference (HF's docs, eval loops); a patched forward
            call_args, call_kwargs = snapshot((args, kwargs))  # the user's inputs stay as they handed them over
            with torch.no_grad():  # runs calls in inference mode through the same capture (`PatchedForward`)
                return model(*call_args, **call_kwargs)

        try:
            with eval_if_unrepeatable(model, call) as modes, agreement.recorded() as agreed_so_far:
                return _optimize(model, args, kwargs, call, options, modes, isolation, agreed_so_far)
        finally:
            at_rest(model)  # FSDP2's modules as `fully_shard` left them: an optimizer made now steps the sharded ones


def _optimize(model, args, kwargs, call, options: OptimizeOptions, modes, isolation: probe.ProbeOutcome | None = None,
              agreed_so_far=lambda: None) -> OptimizeReport:
    device = _device_of(model, args, kwargs)
    job = agreement.job()
    # each rank of a job writes its own folder (its trace, its apply.json), rank-K under the one it was given
    out_dir = (rank_dir(options.out, job.rank) if job else Path(options.out)) if options.out else scratch_out_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    phases = Stopwatch()
    pipeline.start_triton(device, options.replacement)  # every way on launches Triton kernels: hashed meanwhile
    key_options = {"top": options.top, "replacement": options.replacement, "granularity": options.granularity,
                   "select": options.selecting, **({"inductor": options.inductor} if options.inductor is not None else {})}
    key_parts: dict = {}
    key = plan_cache.fingerprint(model, args, kwargs, device, key_options, key_parts) if options.reuse else None
    with phases("reuse"):  # (in a job, only where every rank has the plan stored)
        reused = agreement.everywhere(bool(key) and plan_cache.fetch(key, out_dir), "stored plan")
    if reused:  # the same model and inputs were optimised before: its plan, re-checked below
        doc = json.loads((out_dir / ANALYSIS_FILE).read_text())
        records = [PatternResult.from_json(p) for p in json.loads((out_dir / APPLY_FILE).read_text())["patterns"]]
        with phases("patch"):
            plan = load_plan(out_dir)
            specs = plan.patterns
            handle = patch(model, plan)  # in the state selection left it when it was stored (`Plan.enabled`)
    else:
        pipeline.start_workers(device)
        with phases("profile"):
            trace_dir = profile_calls(call, out_dir, device, options.calls)
        with phases("analyze"):
            analysed = pipeline.analyse(trace_dir, out_dir)
        doc = analysed.doc
        if options.replacement == "kernel" and (device == "cuda" or options.interpret) and early_capture.enabled():
            # captured while the kernels compile: dynamo's and AOTAutograd's seconds off the cold start's path
            specs, records, plan, handle = early_capture.patch_while_generating(
                model, call, doc, analysed.occurrences, options.top, out_dir, device, options.granularity, phases,
                outer=options.selecting and measure_timing.timing_meaningful(device), inductor=options.inductor_route)
        else:
            specs, records, plan = pipeline.make_kernels(analysed, options.top, options.replacement, out_dir, device,
                                                         options.granularity, phases, options.inductor_route)
            with phases("patch"):
                handle = patch(model, plan)
    if device != "cuda" and not options.interpret:  # kernels would run in Triton's interpreter: never a speedup
        unpatch(model)
        records = interpreter_only(records, specs)
        selection = {"decision": "nothing patched: no GPU (interpret=True patches anyway, for checks)", "kept": []}
        write_apply(out_dir, ApplyDoc(
            replacement=options.replacement, device=device, patterns=tuple(records), manifest=[],
            phases_s=phases.seconds, plan_reused=reused, plan_key=key, plan_key_parts=key_parts,
            selection=Selection.from_json(selection), modes=modes,
            isolation=isolation.to_json() if isolation is not None else None))
        return OptimizeReport(out_dir, records, [], {}, None, None, phases.seconds, selection, modes=modes,
                              isolation=isolation.decision if isolation is not None else None)
    generated = records

    def check_and_select(handle, phase: str = "") -> route.Checked:
        """The patched model's outputs checked against the unpatched model's, then (on a GPU) its states timed and
        the fastest kept: the steps each route takes."""
        handle.train_fused(options.train)
        before = handle.launches()
        with phases("check" + phase):  # the first patched call captures the modules (dynamo) and runs the kernels
            chk = check(call, handle, float32_reference(model, args, kwargs))
        handle = chk.handle
        if chk.dropped:  # re-patched without them: capture (and count launches) with what is left
            call()
        launched = launched_sites(before, handle.launches())
        records = pipeline.checked_status(generated, specs, handle, chk.dropped, doc, launched)
        selection = timed = None
        if options.selecting and not reused:  # a reused plan was selected when it was stored
            with phases("select" + phase):
                selected, selection, records = keep_faster(call, handle, device, records, options.iters,
                                                           float32_reference(model, args, kwargs))
            records = pipeline.selected_status(records, specs, selected, chk.dropped, doc, selection, launched)
            timed = selection.pop("timing", None)
            if selected is not handle or selection.get("state") not in (None, SelectionState.ALL):
                timed, handle = None, selected  # what runs now is not the all-patched state timed first
        return route.Checked(chk, handle, records, selection, timed)

    checked = check_and_select(handle)
    if options.inductor is None and options.selecting and not reused and options.replacement == "kernel" \
            and not options.decode and measure_timing.timing_meaningful(device):  # both routes timed, the faster kept
        # (not for `decode=True`: the prompt's forward, all our captures run, was ~3% of a 64-token generate on the
        # H200, while timing Inductor's route too cost 15-20 s of an `optimize` that took 27-35 s; reports/decode)
        checked = route.choose(checked, model, lambda h: check_and_select(h, " (inductor)"), patch)
    chk, handle, records, selection, timed = (checked.check, checked.handle, checked.records, checked.selection,
                                              checked.timed)
    e2e = None
    if options.benchmark:
        e2e = timed
        if not e2e:
            e2e, records = time_patterns(call, handle, device, options.iters, records)
    if selection is not None or e2e is not None:
        clear_recordings()  # graphs recorded for the states timed above (each pattern alone, ...)
    handle.train_fused(options.train)  # (selection may have handed back a new handle)
    training = None
    if options.train and options.selecting:  # kept only where a whole training call measures faster, no heavier
        with phases("train_check"), checking():  # its calls through the original forwards are not the user's
            # The LM loss first: the training check then steps as the user's loop will (its loss included), held
            # to the memory of the user's model (its loss as before)
            lm_loss = None
            try:
                lm_loss = keep_faster_lm_loss(model, args, kwargs, device, options.iters)
                labels, baseline = causal_lm_step(model, args, kwargs, lm_loss)
                training = keep_faster_training(model, handle, args, kwargs, device, options.iters,
                                                options.train_memory, labels, baseline)
                if training.get("kept"):  # stated as a real step runs it
                    _count_training(training, model, handle, args, kwargs, device, labels)
            except Exception as e:  # each check catches its own failures; one outside them must not cost the
                # user their patched model either: training then runs the original forwards
                handle.train_fused(False)
                drop_training_recordings()
                training = {"decision": f"training runs the original forwards (its check failed: "
                                        f"{exception_reason(e, named=(model,))}; apply.json's training.traceback "
                                        "has the full error)", "kept": False, **exception_details(e)}
            if lm_loss is not None:
                training["lm_loss"] = lm_loss
    with phases("count"):  # what the report says runs is what one call runs now (before `settle`: not the user's budget)
        ran = counted.inference(call, handle)
    records = counted.agree(records, specs, ran)
    runs = {"fused_launches_per_call": sum(ran.values()), "sites": ran}
    any_shape = options.any_shape(device)
    handle.settle(any_shape)  # the checks' own captures (training calls, their modes) are not the user's loop's budget
    generate = decode_setup.prepare(model) if options.decode else None  # what `model.generate` will do now
    manifest, checked = handle.manifest(), chk.as_dict()
    write_apply(out_dir, pipeline.apply_doc(
        replacement=options.replacement, device=device, records=records, manifest=manifest, checks=[checked],
        end_to_end=e2e, selection=selection, enabled=sorted(handle.enabled) if handle.enabled is not None else None,
        outer=handle.outer_on, plan=handle.plan, inductor_graphs=handle.inductor_graphs() or None,
        attention_layouts=handle.attention_layouts() or None, gemm_epilogues=handle.gemm_epilogues() or None,
        dynamic=any_shape,
        phases_s=phases.seconds, plan_reused=reused, plan_key=key, plan_key_parts=key_parts, training=training,
        runs=runs, modes=modes, graphs=handle.graph_keys(), cuda_graphs_not_used=handle.graphs_not_used(),
        fallbacks=handle.fallbacks(), decode=generate.to_json() if generate is not None else None,
        isolation=isolation.to_json() if isolation is not None else None,
        distributed=_agreement_json(agreed_so_far())))
    if key and not reused and manifest and (job is None or job.rank == agreement.DECIDING_RANK):
        plan_cache.store(out_dir, key)
    return OptimizeReport(out_dir, records, manifest, checked, e2e, handle, phases.seconds, selection,
                          training, modes, runs,
                          generate.decision if generate is not None else decode_setup.hint(model, any_shape),
                          isolation.decision if isolation is not None else None)


def left_unpatched(out, replacement: str, device: str, isolation: probe.ProbeOutcome) -> OptimizeReport:
    """The report of an `optimize` whose probe process crashed: the model untouched, the reason stored."""
    out_dir = Path(out) if out else scratch_out_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    selection = {"decision": isolation.decision, "kept": []}
    write_apply(out_dir, ApplyDoc(replacement=replacement, device=device, manifest=[], phases_s={}, plan_reused=False,
                                  selection=Selection.from_json(selection), isolation=isolation.to_json()))
    return OptimizeReport(out_dir, [], [], {}, None, None, {}, selection, isolation=isolation.decision)


def _count_training(training: dict, model, handle, args, kwargs, device, labels) -> None:
    """`training` (kept fused) as one real training step runs it: its fused site runs counted, and where there are
    none, training handed back to the original forwards and said so (it had been "kept as asked" on a model
    whose layers could not train fused)."""
    n = agreement.agreed(counted.training(model, handle, args, kwargs, device, labels), "training count")
    training["fused_per_step"] = n
    if n == 0:
        handle.train_fused(False)
        drop_training_recordings()
        training.update(kept=False, decision="training runs the original forwards: a training step ran no fused site "
                        "(counted; no pattern here has a validated backward, or its layers could not be captured "
                        f"for training), where the check had said: {training['decision']}")
    elif n is not None:
        training["decision"] += f"; counted on one training step: {n} fused site run(s) per step"


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


def _agreement_json(agreed: agreement.Agreement | None) -> dict | None:
    """apply.json `distributed`: in a torch.distributed job, this rank and what rank 0 decided for every rank."""
    if agreed is None:
        return None
    return agreed.to_json() | {"note": f"the plan, the output checks and the timings selection chose by are rank "
                                       f"{agreed.decided_by}'s, broadcast: every rank keeps the same state"}
