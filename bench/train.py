"""Training steps (issue 19): eager / torch.compile / fusion-advisor (/ Liger-Kernel where installed), one
process per model.

    python -m bench.train --out $OUT/train            # GPU: the suite's full shapes, bf16
    python -m bench.train --quick --modes eager,advisor --out /tmp/train   # CPU smoke run
    python -m bench.train --models splade --modes eager,compile,advisor --out $OUT/train-splade

Eager, torch.compile and the advisor are built side by side in the model's process and their timed steps
run in `--rounds` interleaved rounds (drift over the run, a GPU clock or a noisy neighbour, hits all alike;
run one after another, eager alone moved 35 -> 47 ms over one run on the H100); their peak is then
what the mode keeps between steps plus its step's own peak. Liger and the lce modes run after them, alone.

One step = forward, loss (the model's own LM loss where it has labels, else mean square of its main
output; the SPLADE head: the FLOPS regulariser, sum over the vocabulary of the batch-mean activation
squared), backward, optimizer step (AdamW, fused on a GPU), zero_grad. Per mode the model is built
afresh (same seed), so peak memory is that mode's alone: step ms (median of --steps after --warmup, CUDA
events), peak GB (max allocated over the timed steps), peak extra MB (per timed step, the peak allocated
during it minus what was allocated when it began: what the step itself needs on top of the model,
its inputs and optimizer state; the max over the steps), first-step s (the first step, compile or
capture included; the advisor's `optimize` is timed separately as `optimize_s`).

`splade`: the SPLADE head (transformers' BERT-base MLM head, vocabulary 30522, on hidden states
32 x 256 x 768 bf16 that require grad, as an encoder's output would, then the max over the sequence of
log1p(relu(logits)) * mask). Eager and torch.compile hold the B x L x V logits; the advisor trains it
through `advisor.kernels.splade_head` (never holding them).

The advisor mode: `advisor.optimize(model, inputs, train=True)` on the inference inputs, its defaults
otherwise, as a user would call it (selection keeps the patterns faster for inference; then a training
call, forward and backward, is timed through the fused path and through the original forwards, and
fused training is kept only if faster and no heavier: `report.training`), then the model is trained:
each fused pattern with a validated generated backward runs forward+backward as one autograd Function,
the others their original ops (`advisor.patching.autograd.summary()` lists which).
Liger-Kernel (`apply_liger_kernel_to_llama`) runs for Llama only where `liger_kernel` imports; it
patches HF's classes for the whole process, so it runs last. The lce mode (causal LMs): eager, with the
LM loss computed by `advisor.kernels.linear_cross_entropy` (linear + cross-entropy in row chunks, the
N x V logits never held; what Liger's fused linear cross-entropy does). The advisor modes get it from
`optimize(train=True)` itself where it is kept (`report.training["lm_loss"]`).

Writes OUT.json (every number) and OUT.md (a table), printing the table. torch, the workloads and the
advisor are imported inside the child's functions: the parent process only starts children and writes.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import child_command, child_env, git_rev, write_report

MODELS = ["hf_llama", "hf_gpt2", "hf_bert", "timm_vit", "splade"]
DEFAULT_MODELS = "hf_llama,hf_gpt2"  # ~3 min each on an H100 (two compiles, one optimize): the 8-minute budget
# eager_again: eager once more, last (how far the GPU drifted over the run: modes run one after another)
# `advisor_memory`: the advisor with `train_memory=MEMORY_ALLOWED` (fused training kept up to 2% heavier than
# the original forwards: what a user who trades memory for speed gets)
ADVISOR_MODES = ("advisor", "advisor_autocast", "advisor_memory")
MEMORY_ALLOWED = float(os.environ.get("FUSION_BENCH_TRAIN_MEMORY", "0.02"))  # a child inherits it
WARM_S = 3.0  # steps of every interleaved mode, in turn, before the timed rounds
MODES = ["eager", "compile", "advisor", "lce", "liger", "eager_again", "advisor_autocast",
         "advisor_memory"]
# --autocast: fp32 weights, each step's forward and loss under `torch.autocast` (bf16 on a GPU), the usual mixed-
# precision loop; `advisor` calls optimize outside the autocast context (as most scripts would),
# `advisor_autocast` inside it (the state its training check then measures is the one the loop runs).
AUTOCAST = os.environ.get("FUSION_BENCH_AUTOCAST") == "1"
# --lora (causal LMs): every mode trains LoRA adapters (peft, r=16 on every linear layer but the head), the
# usual fine-tuning; peft is not among the project's dependencies (carry its wheel to the GPU machine)
LORA = os.environ.get("FUSION_BENCH_LORA") == "1"
DEFAULT_MODES = "eager,compile,advisor,lce,liger"
# --form (causal LMs): the call a training loop makes, the same in every mode and handed to `optimize` as is:
# `inference` (optimize gets the inference inputs; the loop adds labels), `dict` ({"input_ids", "labels",
# "use_cache": False}: model(**batch)), `tuple` ((ids,): model(ids, labels=ids)), `kwargs` (optimize gets
# {"input_ids"}: model(input_ids=ids, labels=ids))
FORMS = ("inference", "dict", "tuple", "kwargs")
FORM = os.environ.get("FUSION_BENCH_FORM", "inference")


# ----------------------------------------------------------------------------------------- child
def lora(model):
    """`model` with LoRA adapters (peft): r=16 on every linear layer but the head, the usual fine-tuning."""
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                      target_modules="all-linear", task_type="CAUSAL_LM"))


def _loss(model, inputs, labels, name: str = ""):
    from bench.workloads import main_output

    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), dict(inputs))
    if labels is not None:
        kwargs["labels"] = labels
    out = model(*args, **kwargs)
    if name == "splade":  # FLOPS regulariser (SPLADE's sparsity loss): sum_v (mean_b out[b, v])^2
        return out.float().mean(0).pow(2).sum()
    loss = getattr(out, "loss", None)
    return loss if loss is not None else main_output(out).float().pow(2).mean()


def process_state() -> dict:
    """What a mode leaves behind in the process that may slow the next one (eager_again after advisor)."""
    import threading

    import torch

    children = 0
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]) if pid.isdigit() else None
            children += ppid == os.getpid()
        except (OSError, IndexError, ValueError):
            pass
    from torch.nn.modules import module as nn_module
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return {"threads": threading.active_count(), "children": children, "gc_objects": len(gc.get_objects()),
            "gc_enabled": gc.isenabled(), "gc_threshold": gc.get_threshold(),
            "profiler": torch.autograd.profiler._is_profiler_enabled,
            "function_modes": len(torch.overrides._get_current_function_mode_stack()),
            "dispatch_modes": len(_get_current_dispatch_mode_stack()),
            "global_hooks": sum(len(getattr(nn_module, h)) for h in dir(nn_module) if h.startswith("_global_")
                                and isinstance(getattr(nn_module, h), dict)),
            "grad": torch.is_grad_enabled(), "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "matmul_precision": torch.get_float32_matmul_precision(),
            "allocated_gb": round(torch.cuda.memory_allocated() / 2**30, 3) if torch.cuda.is_available() else None}


class Clock:
    def __init__(self, device):
        import torch

        self.cuda = device == "cuda"
        self.torch = torch

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def start(self):
        if self.cuda:
            self.s, self.e = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            self.s.record()
        else:
            self.t = time.perf_counter()

    def ms(self) -> float:
        if self.cuda:
            self.e.record()
            self.torch.cuda.synchronize()
            return self.s.elapsed_time(self.e)
        return (time.perf_counter() - self.t) * 1e3


class Mode:
    """One mode's model, optimizer and inputs, ready to step; its numbers gathered in `res`."""

    def __init__(self, name: str, mode: str, device: str, quick: bool, out_dir: Path):
        import torch

        from bench.workloads import build

        self.name, self.mode, self.device, self.torch = name, mode, device, torch
        self.resident_from = torch.cuda.memory_allocated() if device == "cuda" else 0
        w = build(name, device, quick)
        model = w.model.float() if AUTOCAST else w.model
        lm = type(model).__name__.endswith(("LMHeadModel", "CausalLM"))  # HF LMs compute their own loss from labels
        self.labels = w.inputs["input_ids"] if lm and isinstance(w.inputs, dict) else None
        if self.labels is not None and FORM != "inference":
            ids = self.labels
            w.inputs = {"dict": {"input_ids": ids, "labels": ids, "use_cache": False}, "tuple": (ids,),
                        "kwargs": {"input_ids": ids}}[FORM]
            self.labels = None if FORM == "dict" else ids
        self.res = res = {"mode": mode, "shape": w.shape, "state_before": process_state()}
        self.report = None  # the advisor's OptimizeReport (advisor modes)
        if mode == "liger":
            from liger_kernel.transformers import apply_liger_kernel_to_llama  # noqa: F401 (only where installed)

            if not type(model).__name__.startswith("Llama"):
                raise Skip("Liger's patch here is for Llama only")
            apply_liger_kernel_to_llama()
            w = build(name, device, quick)  # rebuilt: Liger patches the classes, models made after use its modules
            model = w.model.float() if AUTOCAST else w.model
        if mode == "lce":  # the LM loss through advisor.kernels.linear_cross_entropy (no logits)
            if self.labels is None:
                raise Skip("the fused linear + cross-entropy loss is for causal LMs")
            from advisor.kernels.linear_cross_entropy import fused_causal_lm_loss

            fused_causal_lm_loss(model)
        if name == "splade":  # the encoder's output: its gradient is part of the step
            w.inputs[0].requires_grad_(True)
        model.train().requires_grad_(True)  # as a training loop has it before optimize (workloads build frozen)
        if LORA:
            if self.labels is None:
                raise Skip("LoRA here is for causal LMs")
            model = lora(model)
        if mode in ADVISOR_MODES:
            import advisor
            from advisor.patching import autograd, splade

            # a fresh model: its backwards validated and counted afresh (the registries are per process)
            autograd._BACKWARDS.clear()
            splade._RECORDS.clear()
            t0 = time.perf_counter()
            with self.autocast(mode == "advisor_autocast"):
                report = self.report = advisor.optimize(model, w.inputs, train=True,
                                                        train_memory=MEMORY_ALLOWED if mode == "advisor_memory" else 0.0,
                                                        out=out_dir / f"advisor-{name}",
                                                        **({"interpret": True} if device != "cuda" else {}))
            res["optimize_s"] = round(time.perf_counter() - t0, 2)
            res["patched"] = [f"{p['candidate']} {p['title']}" for p in report.applied]  # as backwards' labels
            res["training"] = report.training
            res["selection"] = (report.selection or {}).get("decision")
        if mode == "compile":
            model = torch.compile(model)
        self.model, self.w = model, w
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **({"fused": True} if device == "cuda" else {}))
        self.clock = Clock(device)
        self.leaves = [x for x in (w.inputs if isinstance(w.inputs, tuple) else ())
                       if getattr(x, "requires_grad", False)]
        self.times, self.losses, self.extra, self.peak, self.reserved = [], [], [], 0, 0
        self.rounds: list = []  # medians of the interleaved rounds (child)
        self.steps = 0

    def step(self, timed: bool) -> None:
        torch = self.torch
        cuda = self.device == "cuda"
        self.clock.sync()
        if cuda and timed:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        self.clock.start()
        with self.autocast():
            loss = _loss(self.model, self.w.inputs, self.labels, self.name)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        for x in self.leaves:
            x.grad = None
        ms = self.clock.ms()
        if cuda and timed:
            self.peak = max(self.peak, torch.cuda.max_memory_allocated())
            self.reserved = max(self.reserved, torch.cuda.max_memory_reserved())
            self.extra.append(torch.cuda.max_memory_allocated() - before)
        self.losses.append(loss.item())
        if self.steps == 0:
            self.res["first_step_s"] = round(time.perf_counter() - t0, 2)
            if cuda:  # what the mode keeps between steps: model, optimizer state, the advisor's recordings
                self.resident = torch.cuda.memory_allocated() - self.resident_from
        self.steps += 1
        if timed:
            self.times.append(ms)

    def autocast(self, on: bool = True):
        return self.torch.autocast(self.device, dtype=self.torch.bfloat16, enabled=AUTOCAST and on)

    def profile(self, out_dir: Path) -> None:
        """Where a mode's step goes: kernel and host time per op, two steps."""
        from torch.profiler import ProfilerActivity, profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                self.step(False)
            self.torch.cuda.synchronize()
        avg = prof.key_averages()
        if os.environ.get("TRAIN_TRACE"):  # the kernels one by one, for comparing two modes' steps
            import gzip

            trace = out_dir / f"trace-{self.name}-{self.mode}.json"
            prof.export_chrome_trace(str(trace))
            with open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb") as g:
                g.write(f.read())
            trace.unlink()
        (out_dir / f"profile-{self.name}-{self.mode}.txt").write_text(
            avg.table(sort_by="self_device_time_total", row_limit=70) + "\n\n"
            + avg.table(sort_by="self_cpu_time_total", row_limit=40))

    def finish(self, interleaved: bool) -> dict:
        res = self.res
        res["step_ms"] = round(statistics.median(self.times), 3)
        res["step_ms_min"] = round(min(self.times), 3)
        if self.rounds:  # each interleaved round's median: how far the run drifted
            res["round_ms"] = [round(x, 3) for x in self.rounds]
        if self.device == "cuda":
            # the steady state only (peaks reset before each timed step): not compile's or validation's scratch.
            # Interleaved, other modes' models share the GPU: this mode's peak is what it keeps plus its step's peak.
            peak = self.resident + max(self.extra) if interleaved else self.peak
            res["peak_gb"] = round(peak / 2**30, 3)
            # CUDA graphs' scratch stays reserved in their pool (not allocated between replays): reserved counts
            # it (all modes together when interleaved)
            res["peak_reserved_gb"] = round(self.reserved / 2**30, 3)
        res["peak_extra_mb"] = round(max(self.extra) / 2**20, 1) if self.extra else None
        res["losses"] = [round(x, 5) for x in self.losses]
        res["interleaved"] = interleaved
        if self.mode in ADVISOR_MODES:
            from advisor.patching import autograd, patched_modules
            from advisor.patching.graphs import _LIVE
            from advisor.patching.train_graphs import TrainGraphed

            res["backwards"] = autograd.summary()
            res["fallbacks"] = {q: dict(f.fallbacks) for q, f in patched_modules(self.model) if f.fallbacks}
            res["train_graphs"] = [{"recordings": len(t.recordings), "failed": t.failed, "trace": t.failed_trace,
                                    "not_replayed": dict(t.not_replayed)}
                                   for t in list(_LIVE) if isinstance(t, TrainGraphed)]
        return res

    def close(self) -> None:
        del self.model, self.opt, self.w
        gc.collect()
        if self.device == "cuda":
            self.torch.cuda.empty_cache()


class Skip(Exception):
    """A mode that does not apply to this model."""


# Modes that can share a process with the others and be timed in interleaved rounds (Liger patches HF's
# classes for the whole process: it runs alone, last; the lce modes change the model's loss the same way).
INTERLEAVED = {"eager", "compile", "advisor", "eager_again", "advisor_autocast", "advisor_memory"}


def child(name: str, modes: list, quick: bool, warmup: int, steps: int, result: Path, profile: bool = False,
          rounds: int = 1) -> int:
    """Each mode's steps; with rounds > 1 the modes of INTERLEAVED are built side by side and timed in
    `rounds` interleaved rounds (drift over the run hits all alike), the others after them one by one."""
    import advisor  # noqa: F401
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    doc = {"model": name, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "torch": torch.__version__, "modes": {}}
    from bench.workloads import TITLES

    doc["title"] = TITLES.get(name, name)

    def record(mode, fn):
        torch.manual_seed(0)
        try:
            doc["modes"][mode] = fn()
        except Skip as e:
            doc["modes"][mode] = {"mode": mode, "skipped": str(e)}
        except Exception as e:  # one mode failing (compile on an odd model) must not lose the others
            doc["modes"][mode] = {"mode": mode, "error": f"{type(e).__name__}: {e}"[:500]}
        result.write_text(json.dumps(doc, indent=1, default=str))
        r = doc["modes"][mode]
        print(f"{name} {mode}: {r.get('step_ms')} ms, peak {r.get('peak_gb')} GB, first step {r.get('first_step_s')} s"
              + (f" ({r.get('error') or r.get('skipped')})" if r.get("error") or r.get("skipped") else ""), flush=True)

    together = [m for m in modes if m in INTERLEAVED] if rounds > 1 else []
    if together:
        ready: dict = {}
        for mode in together:
            torch.manual_seed(0)
            try:
                ready[mode] = Mode(name, mode, device, quick, result.parent)
                for _ in range(warmup):
                    ready[mode].step(False)
            except Exception as e:
                ready.pop(mode, None)
                doc["modes"][mode] = {"mode": mode, "error": f"{type(e).__name__}: {e}"[:500]}
        # Warmed up again, all together, right before the rounds: each mode was built and warmed minutes
        # before the first round (compile, optimize), and the GPU's clocks and the allocator had cooled in
        # between: BERT's eager rounds read 43.6, 38.8, 33.8 ms on the H100 (session 13), first the slowest.
        warm_until = time.perf_counter() + (0.0 if quick else WARM_S)
        while ready and time.perf_counter() < warm_until:
            for mode, m in list(ready.items()):
                try:
                    m.step(False)
                except Exception as e:  # as in the rounds: a mode failing leaves the others timed
                    doc["modes"][mode] = {"mode": mode, "error": f"{type(e).__name__}: {e}"[:500]}
                    ready.pop(mode).close()
        per_round = max(1, -(-steps // rounds))
        for r in range(rounds):
            names = list(ready) if r % 2 == 0 else list(ready)[::-1]  # ABBA: drift within a round hits all alike
            for mode, m in [(k, ready[k]) for k in names if k in ready]:
                try:
                    for _ in range(per_round):
                        m.step(True)
                    m.rounds.append(statistics.median(m.times[-per_round:]))
                except Exception as e:  # a mode failing mid-run leaves the others timed
                    doc["modes"][mode] = {"mode": mode, "error": f"{type(e).__name__}: {e}"[:500]}
                    ready.pop(mode).close()
        for mode, m in ready.items():
            if profile and device == "cuda":
                m.profile(result.parent)
            record(mode, lambda m=m: m.finish(True))
        for m in ready.values():
            m.close()
    for mode in modes:
        if mode in together:
            continue
        if mode == "liger":
            try:
                import liger_kernel  # noqa: F401
            except ImportError:
                doc["modes"][mode] = {"mode": mode, "skipped": "liger_kernel is not installed here"}
                result.write_text(json.dumps(doc, indent=1, default=str))
                continue

        def alone(mode=mode):
            m = Mode(name, mode, device, quick, result.parent)
            try:
                for i in range(warmup + steps):
                    m.step(i >= warmup)
                if profile and device == "cuda":
                    m.profile(result.parent)
                return m.finish(False)
            finally:
                m.close()

        record(mode, alone)
    return 0


# ----------------------------------------------------------------------------------------- parent
def table(doc: dict) -> str:
    rows = ["| model | mode | step ms | × eager | peak GB | reserved GB | peak extra MB | first step s | note |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, r in doc["results"].items():
        if "error" in r:
            rows.append(f"| {name} | — | failed: {r['error'].splitlines()[-1][:120]} |||||||")
            continue
        eager = r["modes"].get("eager", {}).get("step_ms")
        for mode, m in r["modes"].items():
            if "step_ms" not in m:
                rows.append(f"| {name} | {mode} | {m.get('error') or m.get('skipped')} |||||||")
                continue
            x = f"{eager / m['step_ms']:.2f}" if eager else "—"
            note = ""
            if mode in ADVISOR_MODES:
                bws = m.get("backwards") or []
                used = sum(1 for b in bws if b.get("used", b["validated"]) and b["launches"])
                note = (f"optimize {m.get('optimize_s')} s; {len(m.get('patched') or [])} patterns; "
                        f"{used} of {len(bws)} derived backwards validated, faster and used; "
                        f"{(m.get('training') or {}).get('decision', '')}"
                        + (f"; {m['training']['lm_loss']['decision']}" if (m.get("training") or {}).get("lm_loss") else ""))
            rows.append(f"| {name} | {mode} | {m['step_ms']} | {x} | {m.get('peak_gb')} | {m.get('peak_reserved_gb')} | "
                        f"{m.get('peak_extra_mb')} | "
                        f"{m.get('first_step_s')} | {note} |")
    return "\n".join(rows)


def markdown(doc: dict) -> str:
    out = ["# Training steps (bench/train.py, issue 19)", "",
           "One process per model; per mode a fresh model (same seed). Step = forward, loss, backward, AdamW "
           "(fused on a GPU) step; median after warm-up (CUDA events); peak = max allocated over the timed steps; "
           "peak extra = per step, the peak allocated minus what was allocated as it began (max over the steps).",
           "", table(doc), ""]
    for name, r in doc["results"].items():
        adv = r.get("modes", {}).get("advisor", {})
        if adv.get("backwards"):
            out += [f"## {name}: derived backwards", "", "| pattern | validated | fwd+bwd ms fused / original | used | "
                    "launches | saved MB | eager saved MB (est.) | reason |", "|---|---|---|---|---|---|---|---|"]
            for b in adv["backwards"]:
                mb = lambda v: f"{v / 2**20:.1f}" if v else "—"  # noqa: E731
                ms = f"{b['fused_ms']:.3f} / {b['eager_ms']:.3f} ({b.get('timed_by') or 'calls'})" \
                    if b.get("fused_ms") is not None else "—"
                out.append(f"| {b.get('pattern') or b['program']} | {b['validated']} | {ms} | {b.get('used')} | "
                           f"{b['launches']} | "
                           f"{mb(b['saved_bytes'])} | "
                           f"{mb(b['eager_saved_bytes'])} | {(b['reason'] or '')[:160]} |")
            derived = {b.get("pattern") for b in adv["backwards"]}
            eager_ops = [p for p in adv.get("patched") or []
                         if not any(d and d.startswith(p) for d in derived)]  # (an epilogue's label adds to it)
            if eager_ops:  # padded GEMMs (and epilogues that never trained): no backward derived for them
                out.append(f"| {' / '.join(eager_ops)} | — | — | — | — | — | — | no backward derived: a padded GEMM "
                           "trains through autograd on its padded ops; an epilogue here never trained fused |")
            out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=DEFAULT_MODELS, help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--out", type=Path, default=Path("reports/train/train"))
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--autocast", action="store_true", help="fp32 weights, steps under torch.autocast (bf16)")
    p.add_argument("--lora", action="store_true", help="causal LMs: every mode trains LoRA adapters (needs peft)")
    p.add_argument("--form", choices=FORMS, default="inference", help="causal LMs: the training call the loop makes "
                   "and optimize is handed (see FORMS)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3, help="eager / compile / advisor built side by side and timed in "
                   "this many interleaved rounds (1: one mode after another, each alone on the GPU)")
    p.add_argument("--timeout", type=float, default=210.0, help="seconds per model (its process)")
    p.add_argument("--profile", action="store_true", help="GPU: per mode, a torch.profiler table of two steps "
                   "(OUT's folder, profile-MODEL-MODE.txt)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    names = [n for n in a.models.split(",") if n]
    bad = [m for m in modes if m not in MODES] + [n for n in names if n not in MODELS]
    if bad:
        print(f"train: unknown model or mode: {', '.join(bad)} (models: {', '.join(MODELS)}; modes: {', '.join(MODES)})",
              file=sys.stderr)
        return 2
    if a.child:
        return child(a.child, modes, a.quick, a.warmup, a.steps, a.result, a.profile, a.rounds)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"results": {}, "form": a.form, "commit": git_rev()}
    for name in names:
        result = a.out.parent / f".train-{name}.json"
        result.unlink(missing_ok=True)
        t0 = time.perf_counter()
        cmd = child_command("bench.train", "--child", name, "--result", result, "--modes", ",".join(modes),
                            "--warmup", a.warmup, "--steps", a.steps, "--rounds", a.rounds) \
            + (["--quick"] if a.quick else []) + (["--profile"] if a.profile else [])
        try:
            proc = subprocess.run(cmd, timeout=a.timeout, capture_output=True, text=True,
                                  env={**child_env(), **({"FUSION_BENCH_AUTOCAST": "1"} if a.autocast else {}),
                                       **({"FUSION_BENCH_LORA": "1"} if a.lora else {}), "FUSION_BENCH_FORM": a.form})
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-12:]
        except subprocess.TimeoutExpired as e:
            tail = [(e.stdout or b"").decode(errors="replace")[-2000:] if isinstance(e.stdout, bytes) else (e.stdout or ""),
                    f"timed out after {a.timeout:.0f} s"]
        res = json.loads(result.read_text()) if result.exists() else {"model": name, "error": "\n".join(tail)}
        if "timed out" in tail[-1] and "error" not in res:
            res["note"] = tail[-1] + " (the modes listed finished)"
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        result.unlink(missing_ok=True)
        doc["results"][name] = res
        print("\n".join(t for t in tail if t.startswith(name) or "Error" in t)[-3000:], flush=True)
        write_report(a.out, doc)
    write_report(a.out, doc, markdown(doc))
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
