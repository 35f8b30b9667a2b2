"""fusion-advisor: profiler-driven kernel fusion for PyTorch.

Stages, one package each, data flowing one way:
collect -> trace -> graph -> analyze -> codegen -> validate -> patch -> bench -> report.
The op registry (`advisor.ops`) is the only place that knows what an aten op is.
"""

__version__ = "0.1.0"

from advisor.collect.region import region  # noqa: E402,F401


def analyze(path, et=None):
    """Analyse a trace directory or Kineto JSON; returns an `Analysis` with pandas DataFrames."""
    from advisor.analyze.api import analyze as _analyze

    return _analyze(path, et=et)
