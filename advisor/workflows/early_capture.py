"""Capture the model while its kernels compile: the cold start's two longest waits, overlapped.

`optimize` on empty caches used to wait for the compile workers (their start-up, then each kernel's
Triton compiles and validation: 6.4 s of Llama's 17.3 s on the H100, this process idle), and only then
capture the patched model (dynamo's trace, AOTAutograd, the rewrite: 4.2 s more for Llama's layers and
whole stack, reports/cold-start/first-call-profile). Neither needs the other: the patterns to substitute
are known from the analysis, and where each kernel module will be written is fixed
(`generate.kernel_path`). So `patch_while_generating` generates in a thread (the workers do the work)
and meanwhile patches the model with the specs the generation is expected to end with, every kernel
validated (`kernels.expected_specs`), and runs one call with every site on its original ops
(`only(())`: no kernel launches before it has validated; each site's module is loaded at its first
launch, `capture.PendingLauncher`: a module may be rewritten until generation ends), the whole stack as one
capture too where selection will time it.
That call is replayed op by op (`replay_off`): a CUDA-graph recording here would be broken by the
generation thread's own GPU work (a kernel validated in this process, alternatives timed), which in
turn waits for this call (`gpu_free`) so that its timings are not ours.

When the generation ends as expected (every kernel validated: the usual case) the captures are kept and
the first patched call only records its CUDA graphs; otherwise the model is patched again with what did
validate and captured afresh, as before. `FUSION_ADVISOR_EARLY_CAPTURE=0` turns this off (the cold-start
benchmark's comparison).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from advisor import config
from advisor.patching import Patched, build_plan, only, patch, unpatch, whole
from advisor.patching.capture import pending_kernels, plan_digest
from advisor.patching.graphs import replay_off
from advisor.workflows.kernels import expected_specs, kernel_specs

ENV = config.EARLY_CAPTURE


def enabled() -> bool:
    return config.current().early_capture


def patch_while_generating(model: torch.nn.Module, call: Callable[[], object], doc: dict, occurrences: dict,
                           top: int, out_dir, device: str, granularity: str, phases,
                           outer: bool, inductor: bool = False) -> tuple[list, list, object, Patched]:
    """(specs, records, plan, handle): `kernel_specs(doc, top, "kernel", ...)` and the model patched with its
    specs, captured while the kernels were generated where they came out as expected. `outer`: capture the
    whole stack too (selection will time it). `phases`: the caller's `Stopwatch` (`capture`: this process's
    capture call, overlapped with `generate`; `generate`: the wait for the kernels after it)."""
    expected = expected_specs(doc, top, out_dir, device)
    quiet = threading.Event()  # set once this thread's GPU work is done
    cuda_device = torch.cuda.current_device() if device == "cuda" else None

    def generate():
        if cuda_device is not None:  # the caller's current device, which a new thread does not inherit
            torch.cuda.set_device(cuda_device)
        return kernel_specs(doc, top, "kernel", out_dir, device, gpu_free=quiet.wait)

    handle = None
    with ThreadPoolExecutor(1, thread_name_prefix="fusion-advisor-generate") as pool:
        job = pool.submit(generate)
        try:
            if expected:
                with phases("capture"):
                    handle = _captured(model, call, build_plan(expected, doc, occurrences, granularity, inductor), outer)
        finally:
            quiet.set()
            with phases("generate"):
                try:
                    specs, records = job.result()
                except BaseException:
                    unpatch(model)  # as it was handed over: nothing generated, nothing patched
                    raise
    if handle is not None and _same(specs, expected):
        handle.kernels_written()
        return expected, records, handle.plan, handle
    plan = build_plan(specs, doc, occurrences, granularity, inductor)
    return specs, records, plan, patch(model, plan)


def _captured(model: torch.nn.Module, call: Callable[[], object], plan, outer: bool) -> Patched | None:
    """The model patched with `plan` and captured by one call with no kernel launched (None where that call
    raised: the caller patches again once the kernels are known)."""
    handle = patch(model, plan)
    try:
        with only(()), replay_off(), pending_kernels():
            call()
            if outer and handle.outer:
                with whole(True):
                    call()
    except Exception:  # noqa: BLE001  (the same call patched after generation says what is wrong, as before)
        return None
    return handle


def _same(specs: list, expected: list) -> bool:
    """Whether the generation ended with the specs the model was captured with (same patterns, programs and
    kernel modules, in the same order)."""
    return [s.key for s in specs] == [s.key for s in expected] and plan_digest(specs) == plan_digest(expected)
