"""fusion-advisor: profiler-driven kernel fusion for PyTorch.

Stages, one package each, data flowing one way:
collect -> trace -> graph -> analyze -> codegen -> validate -> patch -> bench -> report.
The op registry (`advisor.ops`) is the only place that knows what an aten op is.
"""

__version__ = "0.1.0"

from advisor.interpreter import use_interpreter_without_gpu as _use_interpreter

_use_interpreter()  # before anything imports triton: see advisor.interpreter

from advisor.collect.region import region  # noqa: E402,F401


# The package advisor.analyze is loaded here, before the function of the same name is defined: loaded
# later (by the function's first call) Python set it as the attribute `advisor.analyze`, and from then on
# `advisor.analyze(path)` raised "'module' object is not callable" and help() showed the package.
import advisor.analyze as _analyze_package  # noqa: E402,F401  (its __init__ is empty: nothing heavy)


def analyze(path, et=None):
    """Analyse a trace; returns an `Analysis` (`print(a.summary())`; `a.candidates`, `a.ops`, `a.kernels`
    are pandas DataFrames, `a.doc` what analysis.json holds).

    path: a `fusion-advisor profile` output directory (OUT or OUT/trace), a Kineto .json/.json.gz, or a
    TensorBoard trace directory (`torch.profiler.tensorboard_trace_handler`; its newest *.pt.trace.json).
    et: an execution trace file, when `path` is a bare Kineto file.
    """
    from advisor.analyze.api import analyze as _analyze

    return _analyze(path, et=et)


def optimize(model, example_inputs, top: int = 5, out=None, **kw):
    """Profile, analyse, generate, validate and patch `model` in place; returns an `OptimizeReport`."""
    from advisor.workflows.live_model import optimize as _optimize

    return _optimize(model, example_inputs, top=top, out=out, **kw)


def patch(model, plan):
    """Patch `model` with a plan (or an `apply`/`optimize` output directory); returns a `Patched`.

    (Once `advisor.patch` the package is imported it replaces this attribute; the package is callable
    with the same signature.)"""
    from advisor.patching import patch as _patch

    return _patch(model, plan)


def unpatch(model):
    """Restore every patched forward under `model`, bit for bit."""
    from advisor.patching import unpatch as _unpatch

    return _unpatch(model)
