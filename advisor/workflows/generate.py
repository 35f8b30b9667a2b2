"""`generate`: kernels for the top candidates of an analysis, each validated, into OUT/kernels and apply.json.

Every candidate ends with a kernel that validated or a stated reason: ops without a lowering and
unsupported views say which, a kernel that fails to compile or to match PyTorch says how. One failure
never stops the run. Matmul-anchored candidates (`Kind.anchored`: epilogue, attention, matmul_reduction) go
to `advisor.codegen.anchored.generate_anchored`; their entries add `memory_saved_bytes` and
`alternatives` (e.g. attention's `run_sdpa`, validated the same way). Candidates come in as
`advisor.records.Candidate`s, each one's fate goes out as a `PatternResult` (apply.json's `patterns`).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import re
import threading
import types
from pathlib import Path

import torch

from advisor.codegen import GENERATOR_VERSION, Unsupported, generate
from advisor.codegen.anchored import AnchoredGenerated, generate_anchored
from advisor.codegen.cache import FIRST_LINE, load_module
from advisor.documents import ApplyDoc, read_apply, write_apply
from advisor.jsonio import atomic_write
from advisor.patching import timing, triton_setup  # timing: where a cold start's seconds go (bench/cold_start.py)
from advisor.ops.registry import OpClass, op_class, tagged
from advisor.records import Candidate, Kind, PatternResult, candidates_of
from advisor.status import Status
from advisor.stopwatch import Stopwatch
from advisor.validate import compile_ahead, compile_jobs, interpreted, launch_signatures, launchers, validate
from advisor.validate.inputs import draw
from advisor.validate.shapes import cases

MATMUL_REASON = "contains a matmul anchor (a GEMM epilogue or matmul + reduction kernel: the matmul-anchored generator)"
NO_PROGRAM = "the analysis recorded no program for this candidate"

log = logging.getLogger(__name__)


# Where in a training step a candidate runs decides whether a kernel is generated for it at all: patches
# replace module forwards, so a backward chain is fused from its forward pattern's derived backward, and
# an optimizer's update is PyTorch's fused optimizer's job.
PHASE_REASONS = {
    "backward": "runs in the backward pass: `optimize(model, inputs, train=True)` fuses backwards, derived from "
                "the forward patterns' kernels",
    "optimizer": "the optimizer's update: PyTorch's fused optimizer does it in one kernel "
                 "(`torch.optim.AdamW(params, fused=True)`)",
}


def skip_reason(c: Candidate) -> str | None:
    if c.phase in PHASE_REASONS:
        return PHASE_REASONS[c.phase]
    classes = {op_class(o) for o in c.ops}
    if c.kind.anchored:
        return None if c.has_program else NO_PROGRAM
    if OpClass.MATMUL in classes:
        return MATMUL_REASON
    if OpClass.ATTENTION in classes:
        return "contains an attention op (a fused attention kernel is a barrier)"
    if not c.has_program:
        return NO_PROGRAM
    return None


def generate_candidates(doc: dict, out_dir: Path, top: int | None = None, on_result=None) -> dict:
    """Generate + validate the top `top` candidates of an analysis.json document; write apply.json.

    Each candidate's generate + validate is one job, independent of the others: on a GPU the jobs go
    to worker processes (`advisor.workflows.workers`; most of a cold start is Triton compiling, whose
    Python front end holds the GIL), and the records come back in the candidates' order, the same as
    one after another in process (which is what runs under the interpreter, or when the workers cannot
    start: said in one line). Kernels with validated alternatives (attention's SDPA) are then timed
    here, one at a time, alone on the GPU, and the faster one becomes the module's `run`
    (`choose_launcher`)."""
    return record_patterns(out_dir, generate_results(candidates_of(doc), out_dir, top, on_result))


def generate_results(candidates: list[Candidate], out_dir: Path, top: int | None = None,
                     on_result=None, every: list[Candidate] | None = None, gpu_free=None) -> list[PatternResult]:
    """`generate_candidates` on records: the top `top` candidates' results (apply.json is not written).
    `on_result` is called with each result as it is final. `every`: all of the analysis's candidates, where
    `candidates` are a selection of them (the groups that rivals extend are looked up there).

    Candidates that extend the same group (Llama's SwiGLU as gate_proj's epilogue and as up_proj's) are
    rivals for the same ops: the patcher substitutes the first in rank order and the other is never
    patched beside it. The later rivals are generated only when the first one's kernel does not validate
    (a second batch of jobs); else their record says which rival took the ops. A tuned epilogue's job is
    ten Triton compiles (eight tile configs and two shapes): up_proj's were a third of the H100's compile
    work in Llama's cold start, for a kernel that was never patched.
    `gpu_free()`, when given, is waited for before anything here is timed on the GPU (this process captures the
    model meanwhile: `workflows/early_capture.py`)."""
    out_dir = Path(out_dir)
    chosen = _top_forward(candidates, top)
    rival_of = rivals(chosen, every or candidates)
    entries = _entries([c for c in chosen if c.id not in rival_of], out_dir)
    retry = [c for c in chosen if c.id in rival_of and not entries[rival_of[c.id].id].validated]
    entries |= _entries(retry, out_dir) if retry else {}
    results = []
    for c in chosen:
        entry = entries.get(c.id) or _rival_record(c, rival_of[c.id])
        if not interpreted() and entry.validated and \
                any(a.get("validated") for a in (entry.alternatives or {}).values()):
            clock = Stopwatch()
            if gpu_free is not None:
                gpu_free()
            try:  # the module again, in this process: the generator's cache and Triton's make it cheap
                with clock("alternatives"), timing.timed("alternatives"):
                    gen = generate_anchored(c.program, c.kind.value)
                    times = time_alternatives(gen, load_module(gen.path), entry.alternatives)
                timed = dataclasses.replace(entry, seconds={**(entry.seconds or {}), **clock.seconds})
                entry = choose_launcher(timed, times)
            except Exception as e:  # timing is an optimisation: the validated kernel stays `run`
                entry = dataclasses.replace(entry, launcher_note=f"alternatives not timed: {type(e).__name__}: {e}"[:300])
        results.append(_report(entry, on_result))
    return results


RIVAL_REASON = ("not generated: {rival} ({title}) fuses the same group at every site and its kernel validated; the "
                "first in rank order takes the ops, so this one could not be patched beside it")


def _rival_record(c: Candidate, rival: Candidate) -> PatternResult:
    why = RIVAL_REASON.format(rival=rival.id, title=(rival.title or "").split(":")[0])
    return pattern_record(c, reason=why).with_verdict(Status.OVERLAP, why)


def rivals(chosen: list[Candidate], candidates: list[Candidate]) -> dict[str, Candidate]:
    """{candidate id: the earlier candidate it rivals}: a candidate to be generated that extends the same group
    as an earlier one (in rank order) which fuses that group at every one of its occurrences, so that no
    site is left for the later one (ResNet's BatchNorm + ReLU + max-pool extends a chain at one site of 33:
    not a rival of anything extending that chain elsewhere). A chain ending in a window op is never a rival:
    it is substituted before the chain's other extensions (`patching.plan.patch_order`: a conv epilogue at
    every BatchNorm + ReLU leaves the stem's pool to the window kernel)."""
    occurrences = {c.id: c.occurrences for c in candidates}
    first, out = {}, {}
    for c in chosen:
        if not c.extends or skip_reason(c) is not None:
            continue
        if c.extends in first and not any(tagged(op, "window") for op in c.ops):
            out[c.id] = first[c.extends]
        elif c.occurrences and c.occurrences == occurrences.get(c.extends) and _generates(c):
            first[c.extends] = c
    return out


def _generates(c: Candidate) -> bool:
    """Whether the generator writes a kernel for `c` (no compile: its source, from the generator's cache
    where it was made before; the job then finds it there). A refused one (a conv epilogue) takes no ops."""
    try:
        generate_anchored(c.program, c.kind.value) if c.kind.anchored else generate(c.program)
        return True
    except Exception:  # noqa: BLE001  (its own job says why)
        return False


def _entries(chosen: list[Candidate], out_dir: Path) -> dict[str, PatternResult]:
    """{candidate id: its job's record}: each candidate generated and validated (in the compile workers where
    they run), a pattern's other shapes as jobs of their own (one kernel per shape) folded into its record."""
    shapes = [s for c in chosen for s in shape_candidates(c)]
    launchers_soon(chosen + shapes)
    entries = _in_workers(chosen + shapes, out_dir)
    if entries is None:
        entries = [_job(c, out_dir) for c in chosen + shapes]
    entries, shape_entries = entries[:len(chosen)], iter(entries[len(chosen):])
    out = {}
    for c, entry in zip(chosen, entries):
        if c.variants:
            shape_jobs = [next(shape_entries) for _ in c.variants]
            entry = dataclasses.replace(entry, variants=[
                {"index": i, "validated": e.validated, "kernel_file": e.kernel_file if e.validated else None,
                 "reason": e.reason} for i, e in enumerate(shape_jobs, 1)],
                seconds={**(entry.seconds or {}),
                         "shapes": round(sum(_job_seconds(e) for e in shape_jobs), 3)})
        out[c.id] = entry
    return out


def launchers_soon(chosen: list[Candidate]) -> threading.Thread | None:
    """Have Triton's launchers for every kernel signature the candidates' validations will launch built in a
    thread (`validate.launchers`: gcc, up to Triton 3.6), while the compile workers start (3-4 s on the H100)
    or, in this process, while the first job compiles; None where nothing is built (no GPU, the interpreter,
    a Triton with one launcher for all)."""
    if interpreted() or not launchers.per_signature():
        return None
    thread = threading.Thread(target=_build_launchers, args=(chosen,), name="fusion-advisor-launchers", daemon=True)
    thread.start()
    return thread


def _build_launchers(chosen: list[Candidate]) -> int:
    found = []
    for c in chosen:
        if skip_reason(c) is not None:
            continue
        try:  # generated before (`rivals`): from the generator's cache
            gen = generate_anchored(c.program, c.kind.value) if c.kind.anchored else generate(c.program)
            found += launch_signatures(gen, load_module(gen.path))
        except Exception:  # noqa: BLE001  (its job generates it again and says why it failed)
            continue
    return launchers.build(found)


def shape_candidates(c: Candidate) -> list[Candidate]:
    """Candidate `c` at each of its other shapes, a job (and a kernel module) of its own each."""
    return [dataclasses.replace(c, id=f"{c.id}s{i}", program=p, variants=None)
            for i, p in enumerate(c.variants or [], 1)]


def kernel_path(out_dir: Path, c: Candidate) -> Path:
    """Where candidate `c`'s validated kernel module is written (known before it is generated: the model is
    captured against it while the kernels compile, `workflows/early_capture.py`)."""
    return Path(out_dir) / "kernels" / f"{c.id}_{slug(c.title or '')}.py"


def expected_kernels(candidates: list[Candidate], every: list[Candidate] | None = None) -> list[Candidate]:
    """The candidates `generate_results(candidates, ..., every=every)` ends with a kernel for when every kernel
    generates and validates: not skipped, and not a rival of an earlier one (which then takes the ops)."""
    chosen = _top_forward(candidates, None)
    rival_of = rivals(chosen, every or candidates)
    return [c for c in chosen if c.id not in rival_of and skip_reason(c) is None]


def _job_seconds(entry: PatternResult) -> float:
    """A job's wall seconds: its steps' (`validate_steps` breaks `validate` down, not counted twice)."""
    return sum(v for v in (entry.seconds or {}).values() if isinstance(v, (int, float)))


def _top_forward(candidates: list[Candidate], top: int | None) -> list[Candidate]:
    """The candidates down to the `top`-th of the forward's (a training step's backward and optimizer ones
    ranked among them come along, to be recorded with why no kernel is generated for them)."""
    chosen, forward = [], 0
    for c in candidates:
        if top and forward >= top:
            break
        chosen.append(c)
        forward += c.phase is None
    return chosen


# Jobs worth the compile workers. Their start is their import of torch and a CUDA context: 2.7-4.3 s after the
# analysis on the H100's host, whatever the jobs. A kernel's job in this process, where Triton is set up and its
# launchers built ahead, took 0.5-0.7 s: distilbert's two jobs in process 1.1-1.3 s against 2.1-4.7 s through
# the workers, its first call 6.3 and 7.5 s against 8.4 and 12.9 s (reports/cold-start/in-process-workers/h100-in-process.md).
WORKERS_START_S = 3.0
JOB_S = 1.0  # a job in this process, rounded up: its kernel generated, compiled at three shapes and compared


def _in_process_s(chosen: list, ahead: list) -> float:
    """Seconds `chosen`'s jobs would take one after another in this process: one per kernel, and one per tile
    config a tuned kernel compiles (`ahead`, each one's `_ahead_jobs`: eight ~2 s compiles, what the workers
    exist for)."""
    return JOB_S * sum(max(1, len(a)) for c, a in zip(chosen, ahead) if skip_reason(c) is None)


def _in_workers(chosen: list, out_dir: Path) -> list | None:
    """Each candidate's record, worked on in the worker processes; None = do them in this process."""
    from concurrent.futures.process import BrokenProcessPool  # function-level: only where workers run

    from advisor.workflows import workers  # function-level: multiprocessing only on this path

    n = workers.wanted(len(chosen), interpreted()) if chosen else 0
    ahead = [_ahead_jobs(c) for c in chosen] if n else []  # (generated once: the estimate and the pool use them)
    if n and not workers.chosen_by_user() and _in_process_s(chosen, ahead) < WORKERS_START_S:
        n = 0  # done here before the workers would have started
    if n == 0:  # no job, or few: done in this process (or none to do), without the pool `start_soon` began
        workers.discard_soon()
        return None
    try:
        with timing.timed("workers start"):  # waits for the pool `start_soon` began before profiling
            pool = workers.start(n, warm=warm_worker)
        with timing.timed("jobs"):
            return _pooled(pool, chosen, out_dir, ahead) if pool else None
    except (BrokenProcessPool, OSError, RuntimeError) as e:
        log.warning("fusion-advisor: compile workers unavailable (%s: %s); generating %d kernels in this process",
                    type(e).__name__, e, len(chosen))
        return None
    finally:  # each worker holds a CUDA context (~0.5 GB of GPU memory): not kept past the stage
        workers.discard()


def _pooled(pool, chosen: list, out_dir: Path, ahead: list | None = None) -> list:
    """Each candidate's `_job` run in `pool`, the records in the candidates' order. A kernel that times its
    tile configs (matmul-anchored) would compile them one after another inside its job (the H100: eight
    ~2 s compiles, the longest job of a cold start, while other workers sat idle): those compiles go to the
    pool first, as jobs of their own (`_compile_ahead`, into Triton's on-disk cache, which the processes
    share), and that candidate's `_job` starts once they are done; the other candidates' jobs run meanwhile.
    `ahead`: each candidate's `_ahead_jobs`, where the caller has them."""
    ahead = [_ahead_jobs(c) for c in chosen] if ahead is None else ahead
    if not any(ahead):
        return list(pool.map(_job, chosen, [out_dir] * len(chosen)))
    futures = {i: pool.submit(_job, c, out_dir) for i, c in enumerate(chosen) if not ahead[i]}
    warming = {i: [pool.submit(_compile_ahead, chosen[i], job) for job in jobs] for i, jobs in enumerate(ahead) if jobs}
    for i, compiles in warming.items():
        concurrent.futures.wait(compiles)
        futures[i] = pool.submit(_job, chosen[i], out_dir)
    return [futures[i].result() for i in range(len(chosen))]


def _ahead_jobs(c: Candidate) -> list:
    """`validate.compile_jobs` of candidate `c`'s kernel (generated here: the generator's cache makes that
    cheap, and the workers then find the module in it); [] when there is nothing to compile ahead."""
    if not c.kind.anchored or skip_reason(c) is not None:
        return []
    try:
        gen = generate_anchored(c.program, c.kind.value)
        return compile_jobs(gen, load_module(gen.path))
    except Exception:  # noqa: BLE001  (the candidate's own job generates it again and says why it failed)
        return []


def _compile_ahead(c: Candidate, job: tuple) -> None:
    """A worker job: one of `_ahead_jobs(c)`. A failure is for the validation to find and report."""
    try:
        gen = generate_anchored(c.program, c.kind.value)
        compile_ahead(gen, load_module(gen.path), *job)
    except Exception:  # noqa: BLE001
        pass


def choose_launcher(entry: PatternResult, times_ms: dict) -> PatternResult:
    """Make the fastest of the kernel and its validated alternatives the written module's `run`."""
    best = min(times_ms, key=times_ms.get)
    entry = dataclasses.replace(entry, launcher_ms={k: round(v, 4) for k, v in times_ms.items()},
                                launcher="run" if best == "kernel" else f"run_{best}")
    if best != "kernel":
        line = (f"\n\n# Measured faster on this GPU ({times_ms[best]:.4f} ms vs the generated kernel's "
                f"{times_ms['kernel']:.4f} ms) and validated the same way: it is what gets patched in.\n"
                f"run_kernel = run\nrun = run_{best}\n")
        entry = dataclasses.replace(entry, source=entry.source + line)
        atomic_write(Path(entry.kernel_file), entry.source)
    return entry


def _report(entry: PatternResult, on_result) -> PatternResult:
    if on_result:
        on_result(entry)
    return entry


def pattern_record(c: Candidate, **fields) -> PatternResult:
    """Candidate `c`'s result as it stands before (or without) a kernel."""
    return PatternResult(candidate=c.id, pattern_id=c.pattern_id, title=c.title, **fields)


# Whether this process is a compile worker (`warm_worker` ran): its jobs compile their validation's kernels in
# threads (`validate(compile_at_once=True)`). Jobs done in `optimize`'s own process do not: there they run while
# the model is captured, whose dynamo trace the compiles' Python front end would slow (distilbert on the H100:
# its capture 3.1-3.7 -> 4.0-4.5 s, its two jobs no shorter; reports/cold-start).
_IN_WORKER = [False]


def warm_worker() -> None:
    """A compile worker's start-up: importing this module (and with it torch, triton and the generator),
    which naming this function as the pool's initializer does, and the worker's CUDA context with the
    random generator validation draws from: each worker's first job drew its inputs in 0.4-0.9 s on the H100
    against 0.0 s for later jobs, and at start-up that overlaps the parent's profiling. Triton's set-up
    (its hash, its driver: `triton_setup`), which was in each worker's first compile, starts here in a
    thread and goes on while the other workers start; a job waits for it (`_job`)."""
    _IN_WORKER[0] = True
    triton_setup.start()
    if torch.cuda.is_available():
        torch.empty(1, device="cuda").normal_(generator=torch.Generator(device="cuda").manual_seed(0))


def _job(c: Candidate, out_dir: Path) -> PatternResult:
    """Candidate `c`'s result: its kernel generated, validated and written to OUT/kernels (a job for a
    worker process: frozen records in and out, pickled)."""
    entry = pattern_record(c, reason=skip_reason(c))
    if entry.reason is not None:
        return entry
    triton_setup.wait()  # its first compile needs what the set-up makes: not made a second time beside it
    clock = Stopwatch()
    try:
        with clock("generate"):
            gen = generate_anchored(c.program, c.kind.value) if c.kind.anchored else generate(c.program)
        entry = dataclasses.replace(entry, cached=gen.cached)
        with clock("load"):
            module = load_module(gen.path)
        with clock("validate"):
            check = validate(gen, module, compile_at_once=_IN_WORKER[0])
        entry = dataclasses.replace(entry, validated=check.validated, reason=check.reason, errors=check.errors,
                                    device_type="cpu" if interpreted() else "cuda",
                                    seconds={**clock.seconds, **({"validate_steps": check.steps} if check.steps else {})})
        if c.kind.anchored:
            entry = dataclasses.replace(entry, memory_saved_bytes=gen.memory_saved_bytes,
                                        alternatives=validate_alternatives(gen, module))
        source = kernel_text(c, check, interpreted(), gen.code)
        path = atomic_write(kernel_path(out_dir, c), source)
        entry = dataclasses.replace(entry, kernel_file=str(path), source=source)
    except Unsupported as e:
        entry = dataclasses.replace(entry, reason=str(e))
    except Exception as e:  # a generator bug must not stop the other candidates
        entry = dataclasses.replace(entry, reason=f"generator error: {type(e).__name__}: {e}"[:500])
    return entry


def record_patterns(out_dir: Path, results: list[PatternResult]) -> dict:
    """apply.json with this run's patterns (other stages' fields in an existing one kept); returns it as JSON."""
    doc = (read_apply(out_dir) or ApplyDoc()).replace(generator=GENERATOR_VERSION, patterns=tuple(results))
    write_apply(out_dir, doc)
    return doc.to_json()


def slug(title: str) -> str:
    name = title.split(":")[0].lower()
    return re.sub(r"[^a-z0-9]+", "_", name).strip("_")[:40] or "pattern"


def kernel_text(c: Candidate, check, interp: bool, code: str) -> str:
    """The kernel file written for candidate `c`: the generated module, its one-line docstring naming the
    candidate, and what it replaces, should save and was validated on at the end (below the code, so the
    kernels' lines stay where the module validated had them: `codegen.cache.FIRST_LINE` says why)."""
    what = "Padding launcher (cuBLAS)" if c.kind is Kind.PADDED_MATMUL else "Fused Triton kernel"
    first = f"{what} for candidate {c.id} (pattern {c.pattern_id}): {c.title}. About it: the end of this file."
    first = '"""' + " ".join(first.replace("\\", "/").replace('"', "'").split()) + '"""'  # one line, always
    body = code.split("\n", 1)[1] if code.startswith(FIRST_LINE) else code
    about = "\n".join(f"# {line}".rstrip() for line in _about(c, check, interp).splitlines())
    return f"{first}\n{body.rstrip()}\n\n\n# {'-' * 80} about this kernel\n{about}\n"


def _about(c: Candidate, check, interp: bool) -> str:
    """What it replaces, what it should save, what it was validated on."""
    ops = list(dict.fromkeys(c.ops))
    mods = c.modules
    more = f" (+{len(mods) - 3} more)" if len(mods) > 3 else ""
    err = check.errors or {}
    where = "Triton's interpreter (CPU)" if interp else "the GPU"
    shapes = "; ".join(f"{s['case']}: " + " ".join(str(x) for x in s["inputs"]) for s in err.get("shapes", []))
    status = (f"Validated against PyTorch (fp64 and native) on {where}: rel_l2 {err.get('rel_l2', 0):.2g}, "
              f"max_abs {err.get('max_abs', 0):.2g} ({err.get('dtype')})." if check.validated
              else f"NOT validated: {check.reason}")
    lines = [
        f"Replaces: {', '.join(ops)}" + (f" in {', '.join(mods[:3])}{more}" if mods else ""),
        f"Estimated saving: {c.est_time_saved_us or 0:.1f} us per iteration "
        f"({c.kernels_saved or 0} launches, {(c.bytes_saved or 0) / 1e6:.2f} MB of memory traffic).",
        status,
        f"Input shapes per case: {shapes}." if shapes else "",
        err.get("note") or "",
        "Generated by fusion-advisor; needs only torch and triton. Use: outputs = run(*inputs).",
    ]
    return "\n".join(_wrap(line, 98) for line in lines if line)


def _wrap(line: str, width: int = 100) -> str:
    out, cur = [], ""
    for word in line.split(" "):
        if cur and len(cur) + 1 + len(word) > width:
            out.append(cur)
            cur = "    " + word
        else:
            cur = f"{cur} {word}" if cur else word
    out.append(cur)
    return "\n".join(out)


def time_alternatives(gen: AnchoredGenerated, module, validated: dict) -> dict:
    """{name: median ms} of `run` ("kernel") and each validated alternative, on a GPU, at the recorded
    validation shape (`triton.testing.do_bench`, fresh random inputs)."""
    import triton.testing  # on a GPU only, where alternatives are timed

    prog = gen.program
    inputs = draw(prog, cases(prog, interpreter=False)[0], "cuda", torch.Generator(device="cuda").manual_seed(0))
    args = [inputs[i.id] for i in prog.inputs]
    runners = {"kernel": module.run, **{a: getattr(module, f"run_{a}") for a in gen.alternatives
                                        if (validated.get(a) or {}).get("validated")}}
    return {name: float(triton.testing.do_bench(lambda f=f: f(*args), return_mode="median"))
            for name, f in runners.items()}


def validate_alternatives(gen: AnchoredGenerated, module) -> dict:
    """{name: {validated, reason, rel_l2}} for each `run_<name>` in the module, through the same validation."""
    out = {}
    for alt in gen.alternatives:
        shim = types.SimpleNamespace(run=getattr(module, f"run_{alt}"), _empty=module._empty)
        try:
            v = validate(gen, shim)
            out[alt] = {"validated": v.validated, "reason": v.reason, "rel_l2": (v.errors or {}).get("rel_l2")}
        except Exception as e:  # an alternative failing must not cost the kernel its result
            out[alt] = {"validated": False, "reason": f"{type(e).__name__}: {e}"[:300], "rel_l2": None}
    return out
