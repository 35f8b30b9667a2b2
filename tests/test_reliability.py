"""Reliability (issue 8): bad input gets one clear line (and a non-zero exit where the run cannot go on),
and the user's model is never harmed. Only what the stage tests do not cover already is here:
tests/test_collect.py (missing / non-Python / raising / sys.exit / idle scripts), tests/test_analyze.py
(empty, truncated, non-JSON, foreign-JSON traces, unknown ops), tests/test_codegen.py and
tests/test_validate.py (planted wrong kernels, in-place on inputs), tests/test_patch.py (unpatch,
gradients, guards, copy/save/to/modes with stand-ins) and tests/test_fuzz.py (generated kernels).
"""
from __future__ import annotations

import copy
import gzip
import hashlib
import io
import json
import multiprocessing
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import advisor
from advisor.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
GPU_SEED = ROOT / "sample_traces" / "seed" / "trace"  # recorded on an H100: kernels, runtime calls, ET
CPU_SEED = ROOT / "sample_traces" / "cpu" / "seed" / "trace"
DEV = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path_factory.getbasetemp() / "reliability-kernel-cache"))


def cli(argv, capsys) -> tuple[int, str, str]:
    """The CLI in this process: (exit code, stdout, stderr)."""
    code = 0
    try:
        cli_main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def flat(text: str) -> str:
    """Terminal output with rich's line wrapping undone."""
    return " ".join(text.split())


def one_line_error(code: int, err: str, *needles: str) -> None:
    assert code != 0, err
    assert "Traceback" not in err, err
    lines = [l for l in err.strip().splitlines() if l.strip()]
    text = " ".join(lines)
    assert lines and lines[0].startswith("error:"), err
    for n in needles:
        assert n in text, err
    # rich wraps one long line to the terminal width: one message, however many screen lines
    assert sum(l.startswith("error:") for l in lines) == 1 and len(text) < 600, err


def doctored(src: Path, dst: Path, edit=None, et: Path | None | bool = True) -> Path:
    """A copy of a trace directory with its Kineto events edited (and another ET, or none)."""
    dst.mkdir(parents=True, exist_ok=True)
    with gzip.open(src / "kineto.json.gz", "rt") as f:
        doc = json.load(f)
    if edit:
        edit(doc)
    with gzip.open(dst / "kineto.json.gz", "wt") as f:
        json.dump(doc, f)
    if et is True:
        shutil.copy(src / "et.json.gz", dst / "et.json.gz")
    elif et:
        shutil.copy(et, dst / "et.json.gz")
    shutil.copy(src / "meta.json", dst / "meta.json")
    return dst


def _args(doc):
    return [e.get("args", {}) for e in doc["traceEvents"]]


def script(tmp_path: Path, name: str, body: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


# ============================================================================================ scripts
def test_worker_threads_are_profiled_and_analysed(tmp_path, capsys):
    """A script whose models run in worker threads: their ops are recorded and analysed (Kineto records
    the profiling thread only unless told otherwise; the ET observer records every thread)."""
    p = script(tmp_path, "threads.py", """
        import threading, torch
        class Block(torch.nn.Module):
            def forward(self, x, b):
                return torch.log(torch.relu(x + b)) * 2
        class Other(torch.nn.Module):
            def forward(self, x):
                return torch.sigmoid(x * 3).sum(-1)
        def work(m, args):
            for _ in range(3):
                m(*args)
        x, b, y = torch.randn(4096), torch.randn(4096), torch.randn(64, 33)
        ts = [threading.Thread(target=work, args=(Block(), (x, b))),
              threading.Thread(target=work, args=(Other(), (y,)))]
        for t in ts: t.start()
        for t in ts: t.join()
    """)
    code, out, err = cli(["profile", p, "--out", tmp_path / "o", "--device", "cpu"], capsys)
    assert code == 0, err
    from advisor.analyze.api import analyze

    doc = analyze(tmp_path / "o").doc
    titles = {" → ".join(o.split("::")[1] for o in c["ops"]) for c in doc["candidates"]}
    assert {"add → relu → log → mul", "mul → sigmoid → sum"} <= titles, (titles, doc.get("warnings"))
    assert not doc["warnings"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the streams of a CPU run are not CUDA "
                                                          "streams, and a CPU-only torch cannot create them")
def test_cuda_streams(tmp_path, capsys):
    p = script(tmp_path, "streams.py", """
        import torch
        class Block(torch.nn.Module):
            def forward(self, x, b):
                return torch.log(torch.relu(x + b)) * 2
        m, s = Block(), torch.cuda.Stream()
        x, b = torch.randn(1 << 16, device="cuda"), torch.randn(1 << 16, device="cuda")
        for _ in range(3):
            with torch.cuda.stream(s):
                m(x, b)
            m(x, b)
        torch.cuda.synchronize()
    """)
    code, _, err = cli(["profile", p, "--out", tmp_path / "o", "--device", "cuda"], capsys)
    assert code == 0, err
    code, out, err = cli(["analyze", tmp_path / "o"], capsys)
    assert code == 0 and "add → relu → log → mul" in flat(out), err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU to profile on; "
                                                          "test_gpu_trace_without_kernels covers the analysis side")
def test_no_gpu_work_on_a_gpu_machine(tmp_path, capsys):
    p = script(tmp_path, "cpu_only.py", """
        import torch
        class Block(torch.nn.Module):
            def forward(self, x):
                return torch.relu(x + 1) * 2
        m, x = Block(), torch.randn(1024)
        for _ in range(3):
            m(x)
    """)
    code, out, err = cli(["profile", p, "--out", tmp_path / "o", "--device", "cuda"], capsys)
    assert code == 0
    code, out, err = cli(["analyze", tmp_path / "o"], capsys)
    assert "ran no GPU work" in flat(out + err)


# ============================================================================================= traces
def test_gpu_trace_without_kernels(tmp_path, capsys):
    """Recorded on a GPU machine, but no kernel ran (the model stayed on the CPU): analysed as CPU time,
    with a warning saying so."""
    def cpu_only(doc):
        doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") not in
                              ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver", "ac2g",
                               "gpu_user_annotation")]
    d = doctored(GPU_SEED, tmp_path / "t", cpu_only)
    code, out, err = cli(["analyze", d], capsys)
    assert code == 0, err
    doc = json.loads((d / "analysis.json").read_text())
    assert any("no GPU work" in w for w in doc["warnings"]), doc["warnings"]
    assert "no GPU work" in flat(out)


def test_kineto_without_record_function_ids(tmp_path, capsys):
    """An older torch writes no 'Record function id': the ET cannot be joined, so the shape-and-order
    fallback runs (low confidence), with a warning that says why; candidates are still found."""
    def drop(doc):
        for a in _args(doc):
            a.pop("Record function id", None)
    d = doctored(CPU_SEED, tmp_path / "t", drop)
    code, out, err = cli(["analyze", d], capsys)
    assert code == 0, err
    doc = json.loads((d / "analysis.json").read_text())
    assert doc["low_confidence"] and doc["candidates"]
    assert any("Record function id" in w for w in doc["warnings"])
    assert "Record function id" in flat(out)


def test_gpu_kineto_with_external_id_renamed(tmp_path, capsys):
    """Kernels that join no cpu op (their 'External id' renamed): one clear line, exit 2, not an empty report."""
    def rename(doc):
        for a in _args(doc):
            if "External id" in a:
                a["external id"] = a.pop("External id")
    d = doctored(GPU_SEED, tmp_path / "t", rename)
    code, _, err = cli(["analyze", d], capsys)
    one_line_error(code, err, "joins a cpu op", "External id")


def test_kernels_but_no_cpu_ops(tmp_path, capsys):
    def no_cpu(doc):
        doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") != "cpu_op"]
    for et in (True, None):
        d = doctored(GPU_SEED, tmp_path / f"t{bool(et)}", no_cpu, et=et)
        code, _, err = cli(["analyze", d], capsys)
        one_line_error(code, err, "no cpu_op events")


def test_et_of_another_run_is_refused(tmp_path, capsys):
    """An ET recorded with another workload: its rf_ids meet Kineto ops of other names. Saying so beats
    silently reporting the other workload's candidates as this one's."""
    other = tmp_path / "other.py"
    other.write_text("import torch\nclass O(torch.nn.Module):\n    def forward(self, x):\n"
                     "        return torch.sigmoid(x * 2).sum(-1)\n"
                     "m, x = O(), torch.randn(64, 32)\nfor _ in range(3):\n    m(x)\n")
    code, _, err = cli(["profile", other, "--out", tmp_path / "o", "--device", "cpu"], capsys)
    assert code == 0, err
    d = doctored(CPU_SEED, tmp_path / "t", et=tmp_path / "o" / "trace" / "et.json.gz")
    code, _, err = cli(["analyze", d], capsys)
    one_line_error(code, err, "does not belong")
    # and through --et on the command line
    code, _, err = cli(["analyze", CPU_SEED / "kineto.json.gz", "--et", tmp_path / "o" / "trace" / "et.json.gz",
                        "--out", tmp_path / "x"], capsys)
    one_line_error(code, err, "does not belong")


def test_meta_that_is_not_json(tmp_path, capsys):
    d = doctored(CPU_SEED, tmp_path / "t")
    (d / "meta.json").write_text("{ not json")
    code, _, err = cli(["analyze", d], capsys)
    one_line_error(code, err, "meta", "not valid JSON")
