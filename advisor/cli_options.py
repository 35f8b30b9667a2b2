"""The options several `fusion-advisor` sub-commands share: one meaning, one default, checked while the
command line is parsed (a bad value costs nothing: no profiling, no file written)."""
from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Optional

import typer

# As advisor.optimize(top=5). Every candidate worth a kernel (top=None) measured no faster on the H200 at the sizes
# users run (reports/coverage-default) and costs more compiles: what torch.compile wins there is kernel kinds.
TOP_DEFAULT = 5


class Device(str, Enum):
    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


class Replacement(str, Enum):
    kernel = "kernel"
    program = "program"
    subgraph = "subgraph"


class Granularity(str, Enum):
    layer = "layer"
    pattern = "pattern"
    occurrence = "occurrence"
    root = "root"


def top_option():
    return typer.Option(TOP_DEFAULT, "--top", min=1, help="The N highest-ranked candidates: the ones the terminal "
                        "report lists and, for generate and apply, the ones given a kernel (report.html lists all).")


def out_option(default: Optional[Path] = Path("advisor_out"), what: str = "Output directory"):
    return typer.Option(default, "--out", help=f"{what} (the trace goes to OUT/trace/, the rest to OUT/).")


def device_option():
    return typer.Option(Device.auto, "--device", help="Where the script runs (exported to it as FUSION_ADVISOR_DEVICE); "
                        "auto picks cuda when a GPU is available.")


def region_option():
    return typer.Option(None, "--region", help="Steady-state region: an advisor.region or NVTX range name "
                        "(default: the calls of the outermost nn.Module).")


def calls_option():
    return typer.Option(None, "--calls", min=1, help="Profile only the first N calls of the outermost nn.Module "
                        "(the first is warm-up); the rest of the script runs unprofiled, at full speed. "
                        "Default: the first 11 (schedule 0,1,10).")


def _parse_schedule(text: Optional[str]):
    from advisor.collect.schedule import Schedule
    from advisor.errors import AdvisorError

    if text is None:
        return None
    try:
        return Schedule.parse(text)
    except AdvisorError as e:
        raise typer.BadParameter(str(e).removeprefix("--schedule ")) from None


def schedule_option():
    return typer.Option(None, "--schedule", metavar="WAIT,WARMUP,ACTIVE", callback=_parse_schedule,
                        help="As torch.profiler.schedule, one step per call of the outermost nn.Module: WAIT calls "
                        "unprofiled, WARMUP profiled but left out of the analysis, ACTIVE analysed; the rest "
                        "unprofiled. E.g. 10,1,3 for a training loop.")


def chosen_schedule(calls: Optional[int], schedule):
    """--calls N or --schedule, not both (None: the runner's default window, `Schedule.default`)."""
    from advisor.collect.schedule import Schedule
    from advisor.errors import AdvisorError

    if calls is not None and schedule is not None:
        raise AdvisorError("give --calls or --schedule, not both (--calls N is --schedule 0,1,N-1)")
    return Schedule.first_calls(calls) if calls is not None else schedule


def nproc_option():
    return typer.Option(None, "--nproc-per-node", min=1, help="Run SCRIPT as N ranks of a torch.distributed job "
                        "on this host (torch.distributed.run, as torchrun does), each profiled: one trace per rank "
                        "in OUT/trace/rank-K/. Inside a job torchrun started, a plain `profile` writes its rank's.")
