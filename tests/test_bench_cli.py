"""Every maintained benchmark imports and answers `python -m bench.NAME --help` from the repository root (the
way each is run: bench/ is a package, no benchmark edits sys.path). Nothing is measured; all start at once."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ["suite", "zoo", "train", "coexist", "decode", "new_shapes", "serving", "cold_start", "kernels",
              "matmul_fusion", "scale", "profile_overhead", "synth_trace", "distributed", "attention_mask"]
LIBRARIES = ["common", "workloads", "retime", "suite_report"]  # shared by the benchmarks, no command line of their own


def test_every_benchmark_shows_its_help():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmds = {name: [sys.executable, "-m", f"bench.{name}", "--help"] for name in BENCHMARKS}
    cmds["libraries"] = [sys.executable, "-c", "; ".join(f"import bench.{m}" for m in LIBRARIES)]
    procs = {k: subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for k, c in cmds.items()}
    failed = {}
    for k, p in procs.items():
        out, _ = p.communicate(timeout=120)
        if p.returncode != 0 or (k != "libraries" and "usage:" not in out):
            failed[k] = out[-1500:]
    assert not failed, failed


def test_the_benchmarks_are_listed_here():
    """A benchmark added to bench/ is added to this test (or to LIBRARIES)."""
    mine = {p.stem for p in (ROOT / "bench").glob("*.py")} - {"__init__"}
    assert mine == set(BENCHMARKS) | set(LIBRARIES)
