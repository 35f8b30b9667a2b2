"""The Python API as a notebook user meets it (issue 20 item 9): a short repr, summary(), a candidate
column to group ops by, TensorBoard trace directories."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import advisor

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_traces" / "cpu" / "mlp_block"


@pytest.fixture(scope="module")
def analysis():
    return advisor.analyze(SAMPLE)


def test_repr_is_short_and_says_what_was_found(analysis):
    text = repr(analysis)
    assert len(text) < 300 and text.startswith("<Analysis ") and "candidates" in text


def test_summary_lists_the_top_candidates(analysis):
    text = analysis.summary(top=1)
    first, second = analysis.doc["candidates"][:2]  # ids are stable, not ranks: the top one need not be c1
    assert len(text.splitlines()) <= 6 and f" {first['id']} " in text and f" {second['id']} " not in text
    assert first["title"].split(":")[0] in text


def test_ops_have_a_candidate_column(analysis):
    ops = analysis.ops
    by_candidate = ops.groupby("candidate", observed=True)["time_us"].sum()
    assert set(by_candidate.index) <= set(analysis.candidates["id"]) and len(by_candidate) >= 1
    assert ops["candidate"].isna().any() or len(ops) == ops["candidate"].notna().sum()


def test_tensorboard_trace_directory(tmp_path):
    from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
    x = torch.randn(8, 64)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 on_trace_ready=tensorboard_trace_handler(str(tmp_path / "tb"))):
        for _ in range(3):
            model(x)
    assert list((tmp_path / "tb").glob("*.pt.trace.json"))
    a = advisor.analyze(tmp_path / "tb")
    assert a.doc["source"]["kineto"].endswith(".pt.trace.json") and len(a.ops) >= 6


def test_analyze_stays_a_function():
    """Its first call imports the stage package advisor.analysis; the function keeps its name and help."""
    import subprocess
    import sys

    code = ("import advisor, pydoc\nadvisor.analyze(sys.argv[1])\nadvisor.analyze(sys.argv[1])\n"
            "print(pydoc.render_doc(advisor.analyze, renderer=pydoc.plaintext))")
    r = subprocess.run([sys.executable, "-c", "import sys\n" + code, str(SAMPLE)], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "analyze(path, et=None)" in r.stdout and "TensorBoard" in r.stdout


def test_the_facade_functions_keep_their_names_and_arguments():
    """`advisor.optimize`, `patch`, `unpatch`, `analyze` stay the façade's functions once the modules that do
    the work are imported (no module shadows them), and `optimize` forwards every argument of the pipeline
    with the same default."""
    import inspect

    import advisor.analysis.api  # noqa: F401
    import advisor.patching  # noqa: F401
    from advisor.workflows import live_model

    for name in ("analyze", "optimize", "patch", "unpatch"):
        f = getattr(advisor, name)
        assert inspect.isfunction(f) and f.__module__ == "advisor", name
    facade, pipeline = (inspect.signature(f).parameters for f in (advisor.optimize, live_model.optimize))
    assert {"interpret", "select", "top", "granularity"} <= set(facade)
    assert [(p.name, p.default) for p in facade.values()] == [(p.name, p.default) for p in pipeline.values()]


def test_import_advisor_stays_cheap():
    """`import advisor` loads the façade and the region marker, not the stages (pandas, dynamo, triton)."""
    import subprocess
    import sys

    code = "import advisor, sys; print(sorted(m for m in sys.modules if m.startswith(('advisor', 'pandas', 'triton'))))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert eval(r.stdout) == ["advisor", "advisor.collect", "advisor.collect.region",
                              "advisor.version"]
