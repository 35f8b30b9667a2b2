"""fusion-advisor: profiler-driven kernel fusion for PyTorch.

Stages, one package each, data flowing one way:
collect -> trace -> graph -> analyze -> codegen -> validate -> patching -> report;
`advisor.workflows` runs them in order (`optimize` on a live model, `apply` on a script) and no stage
imports it. The op registry (`advisor.ops`) is the only place that knows what an aten op is.

This module is the façade: the functions below are what a user calls. Each imports its stage when
called, so that `import advisor` stays cheap (no pandas, dynamo or triton until they are needed).
"""

from advisor.version import __version__  # noqa: F401

from advisor.collect.region import region  # noqa: F401


def analyze(path, et=None):
    """Analyse a trace; returns an `Analysis` (`print(a.summary())`; `a.candidates`, `a.ops`, `a.kernels`
    are pandas DataFrames, `a.doc` what analysis.json holds).

    path: a `fusion-advisor profile` output directory (OUT or OUT/trace), a Kineto .json/.json.gz, or a
    TensorBoard trace directory (`torch.profiler.tensorboard_trace_handler`; its newest *.pt.trace.json).
    et: an execution trace file, when `path` is a bare Kineto file.
    """
    from advisor.analysis.api import analyze as analyze_trace  # pandas: imported when first needed

    return analyze_trace(path, et=et)


def optimize(model, example_inputs, top: int | None = 5, out=None, replacement: str = "kernel", calls: int = 3,
             benchmark: bool = False, iters: int = 20, granularity: str = "layer", reuse: bool = True,
             select: bool | None = None, interpret: bool = False, train: bool = False, train_memory: float = 0.0,
             decode: bool = False, isolate: bool | None = None, inductor: bool | str | None = None,
             dynamic: bool | None = None):
    """Profile, analyse, generate, validate and patch `model` in place; returns an `OptimizeReport`.

        report = advisor.optimize(model, (input_ids,))
        print(report)             # what was patched where, and why not
        advisor.unpatch(model)    # back to the original, bit for bit

    example_inputs: a tuple of positional arguments, a dict of keyword arguments, or one tensor.
    top: the highest-ranked candidates that get kernels (None: every candidate worth one,
    `workflows.kernels.worth_patching`); out: where the plan goes (a temporary folder by default);
    replacement: `kernel` (generated Triton), or the stand-ins `program` / `subgraph` (tests the patcher);
    calls: profiled calls; benchmark: also time before/after and each pattern alone (GPU); iters: timed
    calls per configuration; granularity: what a capture holds (`layer`, `occurrence`, `pattern`,
    `root`); reuse: re-apply a stored plan for the same model and input shapes; select: on a GPU keep
    only what is faster (default on); interpret: without a GPU, patch anyway with kernels running in
    Triton's interpreter (for checks and tests: 100-2,000x slower than the model's own ops, so off by
    default: the model is then left as it was and the report says why); train: calls that need
    gradients run the fused kernels with their generated, validated backwards, where a training call
    (forward and backward, on a GPU, with selection on) measures faster through them than through the
    original forwards and no heavier (`report.training` says which and why); off by default, training
    then runs the original forwards, at eager's time and memory; train_memory: how much heavier than the
    original forwards' peak fused training may be and still be kept, as a fraction (0.05: 5%; default 0:
    no heavier, beyond the allocator's rounding), for a user who would trade memory for speed; decode: the
    model will `generate` (a Hugging Face generation model): its decode steps run on HF's static cache,
    which `generate` compiles with CUDA graphs over the patched model (`report.decode` says what was set;
    `unpatch` restores the generation config); isolate: run the first optimize (profile, capture, fused calls)
    in a child process first, so that a crash there (a native fast path or C extension in the model's own code:
    SIGSEGV) leaves the model unpatched and working, the reason in `report.isolation` (default: off, or on where
    $FUSION_ADVISOR_ISOLATE=1; a model that cannot be pickled is optimised in process, with a note); inductor:
    True: each captured inference graph is compiled by torch.compile's Inductor around the fused kernels (which
    stay ours, as custom ops; patterns of pointwise, reduction and norm ops only are left to Inductor, which fuses
    them with their neighbours), so the ops no pattern took are fused too; guards, CUDA-graph replay, selection
    and unpatch as without it (apply.json `inductor_graphs` says which graphs Inductor compiled and why not
    others); "max-autotune": that route with Inductor's GEMM autotuning and tuned launch configurations (as
    torch.compile's `max-autotune-no-cudagraphs`: minutes of compile time; the CUDA graphs stay ours); False: our
    captures alone; None (default): on a GPU with selection on, both routes are checked and
    timed and the faster kept (`report.selection["route"]` says which and by how much), ours elsewhere and with
    `decode=True` (where the prompt's forward is a few percent of a `generate`);
    dynamic: after `optimize`, a patched module captures two more shapes; calls at shapes past those run, with True,
    Inductor's dynamic-shape compile of the module's original forward (compiled once, on the first such call:
    fused at every later batch and length, no CUDA graph; `report.handle.any_shape_calls()` counts them), with
    False its original ops; None (default): True on a GPU.
    """
    from advisor.workflows.live_model import optimize as optimize_model  # torch, dynamo, triton: when called

    return optimize_model(model, example_inputs, top=top, out=out, replacement=replacement, calls=calls,
                          benchmark=benchmark, iters=iters, granularity=granularity, reuse=reuse, select=select,
                          interpret=interpret, train=train, train_memory=train_memory, decode=decode,
                          isolate=isolate, inductor=inductor, dynamic=dynamic)


def patch(model, plan):
    """Patch `model` in place with a plan (a `Plan`, an `apply`/`optimize` output directory whose
    apply.json names it, or a bundle file from `save_bundle`); returns a `Patched` handle
    (`handle.manifest()`, `handle.unpatch()`)."""
    from advisor.patching import patch as patch_model  # torch and dynamo: imported when first needed
    from advisor.workflows import bundle  # zipfile: imported when first needed

    return bundle.patch(model, plan) if bundle.is_bundle(plan) else patch_model(model, plan)


def save_bundle(plan, path):
    """Write a portable plan bundle to `path` and return it: `plan` (an `OptimizeReport`, or an
    `apply`/`optimize` output directory) with its kernels' compiled Triton binaries and the versions
    they were built with. `advisor.patch(model, path)` in another process or on another machine with
    the same GPU, torch and Triton patches from it without profiling, generating or compiling; where
    those differ it says so in one line and the kernels compile on first use."""
    from advisor.workflows.bundle import save  # torch and triton: imported when first needed

    return save(plan, path)


def unpatch(model):
    """Restore every patched forward under `model`, bit for bit; returns how many modules were restored."""
    from advisor.patching import unpatch as unpatch_model  # torch and dynamo: imported when first needed

    return unpatch_model(model)
