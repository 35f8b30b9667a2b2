"""The options several `fusion-advisor` sub-commands share: one meaning, one default, checked while the
command line is parsed (a bad value costs nothing: no profiling, no file written)."""
from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Optional

import typer

TOP_DEFAULT = 5  # as advisor.optimize(top=5)


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
