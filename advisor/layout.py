"""Where each stage's files live, so every sub-command can be given either OUT or OUT/trace.

    OUT/trace/     what `profile` wrote: kineto.json.gz, et.json.gz, meta.json
    OUT/           what the later stages write: analysis.json, kernels/, apply.json, report.html, report.txt

A torch.distributed job (`profile --nproc-per-node N`, or `profile` inside each rank of a torchrun job) writes one
trace per rank, OUT/trace/rank-K/, and `analyze` writes each rank's analysis to OUT/rank-K/ beside the merged one.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from advisor.documents import ANALYSIS_FILE, APPLY_FILE

TRACE_DIR = "trace"
RANK_PREFIX = "rank-"


def rank_dir(root, rank: int) -> Path:
    """ROOT/rank-K: a rank's trace folder under OUT/trace, or its analysis folder under OUT."""
    return Path(root) / f"{RANK_PREFIX}{int(rank)}"


def rank_dirs(trace) -> list:
    """The rank-K trace folders of a distributed run under TRACE (OUT/trace), by rank; [] for one process."""
    p = Path(trace)
    if not p.is_dir():
        return []
    found = [(int(d.name[len(RANK_PREFIX):]), d) for d in p.iterdir()
             if d.is_dir() and d.name.startswith(RANK_PREFIX) and d.name[len(RANK_PREFIX):].isdigit()
             and (d / "meta.json").is_file()]
    return [d for _, d in sorted(found)]


@dataclass(frozen=True)
class RunDir:
    out: Path  # analysis.json, apply.json, kernels/ and the reports go here
    trace: Path  # the trace: a directory, or a bare Kineto file

    @property
    def analysis(self) -> Path:
        """analysis.json: in OUT; a trace directory that holds one itself (older layouts) is read too."""
        for d in (self.out, self.trace):
            if (d / ANALYSIS_FILE).is_file():
                return d / ANALYSIS_FILE
        return self.out / ANALYSIS_FILE


def locate(path) -> RunDir:
    """The run directory and trace for PATH: OUT, OUT/trace, a Kineto file in either, or any trace directory."""
    p = Path(path)
    if not p.exists():  # the caller says "not found" with the path as given
        return RunDir(p, p)
    if p.is_dir() and (p / TRACE_DIR).is_dir():
        return RunDir(p, p / TRACE_DIR)
    home = p if p.is_dir() else p.parent  # a bare file's results go beside it
    return RunDir(home.parent if home.name == TRACE_DIR else home, p)


def drop_stale_kernels(out) -> list:
    """Delete OUT/kernels/*.py that OUT/apply.json no longer names: a `generate --top 2` into a folder that
    held nine kernels left seven beside the new plan, each looking like part of it. Returns those deleted."""
    import json

    out = Path(out)
    try:
        doc = json.loads((out / APPLY_FILE).read_text())
    except (OSError, ValueError):
        return []  # no plan to compare with: leave everything
    named = {Path(str(e["kernel_file"])).name for key in ("patterns", "manifest") for e in doc.get(key) or []
             if isinstance(e, dict) and e.get("kernel_file")}
    stale = [p for p in sorted((out / "kernels").glob("*.py")) if p.name not in named]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale
