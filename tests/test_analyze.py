"""The analyzer on real torch.profiler traces recorded here, and on bad input."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from advisor.analysis.api import analyze
from advisor.collect.runner import profile_script
from candidates import RESIDUAL_RMSNORM, ROTARY, SWIGLU, describe, find_candidate, op_names  # (tests/ is on sys.path)

ROOT = Path(__file__).resolve().parents[1]


def _profile(script: Path, out: Path, *args: str) -> Path:
    profile_script(script, list(args), out_dir=out, device="cpu", region=None)
    return out


@pytest.fixture(scope="module")
def seed_trace(tmp_path_factory) -> tuple[Path, int]:
    n = 4096
    script = tmp_path_factory.mktemp("src") / "seed_same_shape.py"
    script.write_text(
        "import torch\n"
        "class Seed(torch.nn.Module):\n"
        "    def forward(self, x, b):\n"
        "        return torch.log(torch.relu(x + b))\n"
        f"x, b = torch.randn({n}), torch.randn({n})\n"
        "m = Seed()\n"
        "for _ in range(3):\n"
        "    m(x, b)\n"
    )
    return _profile(script, tmp_path_factory.mktemp("seed")), n


def test_seed_example_bytes_exact(seed_trace):
    path, n = seed_trace
    a = analyze(path)
    cands = a.doc["candidates"]
    assert len(cands) == 1, describe(cands)
    c = cands[0]
    assert c["bytes_unfused"] == 28 * n
    assert c["bytes_fused"] == 12 * n
    assert c["bytes_saved"] == 16 * n
    assert c["kernels_saved"] == 2
    assert c["occurrences"] == 1  # per steady-state iteration (the warm-up call is dropped)
    assert [op.split("::")[1] for op in c["ops"]] == ["add", "relu", "log"]
    assert c["confidence"] == "high"
    assert a.doc["steady_state"]["iterations"] == 2


def test_analysis_json_schema(seed_trace, tmp_path):
    path, _ = seed_trace
    a = analyze(path)
    out = a.to_json(tmp_path / "analysis.json")
    doc = json.loads(out.read_text())
    for key in ("schema_version", "device", "totals", "unknown_ops", "candidates", "timeline"):
        assert key in doc
    c = doc["candidates"][0]
    for key in ("id", "pattern", "ops", "kernels", "modules", "occurrences", "kernels_saved", "bytes_unfused",
                "bytes_fused", "bytes_saved", "est_time_saved_us", "measured_time_us", "confidence", "program"):
        assert key in c, key
    assert doc["device"]["bandwidth_source"] == "measured"
    assert c["modules"] == ["Seed"]  # qualified: the root module class
    prog = c["program"]
    assert [n["op"] for n in prog["nodes"]] == c["ops"]
    assert len(prog["inputs"]) == 2 and len(prog["outputs"]) == 1


def test_python_api_dataframes(seed_trace):
    a = analyze(seed_trace[0])
    assert {"op", "cls", "time_us", "bytes", "module"} <= set(a.ops.columns)
    assert list(a.candidates["bytes_saved"]) == [16 * seed_trace[1]]


def test_no_et_falls_back_to_low_confidence(seed_trace):
    a = analyze(seed_trace[0] / "trace" / "kineto.json.gz")
    assert a.doc["low_confidence"] is True
    assert a.doc["candidates"], "shape-and-order fallback should still find the chain"
    assert all(c["confidence"] == "low" for c in a.doc["candidates"])


@pytest.fixture(scope="module")
def llama_analysis(tmp_path_factory):
    return analyze(_profile(ROOT / "examples" / "hf_llama.py", tmp_path_factory.mktemp("llama"), "--device", "cpu"))


def test_llama_cpu_patterns(llama_analysis):
    cands = llama_analysis.doc["candidates"]
    # The residual add and the RMSNorm chain it feeds, once per norm after a residual (2 layers: 3 + final).
    rms = find_candidate(cands, RESIDUAL_RMSNORM)
    assert op_names(rms) == ["add", "pow", "mean", "add", "rsqrt", "mul", "mul"]
    assert rms["occurrences"] == 4
    swiglu = find_candidate(cands, SWIGLU)
    assert swiglu["occurrences"] == 2 and swiglu["kernels_saved"] == 2
    rotary = find_candidate(cands, ROTARY)
    assert op_names(rotary) == ["mul", "neg", "cat", "mul", "add"]
    assert rotary["occurrences"] == 4  # q and k in each of 2 layers
    assert any(c["kind"] == "epilogue" and c["extends"] == swiglu["id"] for c in llama_analysis.doc["candidates"])


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "advisor", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


@pytest.mark.parametrize("content, expect", [
    (b"", "empty"),
    (b'{"traceEvents": [{"ph": "X", "cat": "cpu_op"', "not valid JSON"),
    (b"hello, world", "not valid JSON"),
    (b'{"nodes": []}', "not a Kineto"),
    (b'{"traceEvents": []}', "nothing to analyse"),
])
def test_bad_trace_one_line_error(tmp_path, content, expect):
    f = tmp_path / "trace.json"
    f.write_bytes(content)
    r = _run_cli("analyze", str(f))
    assert r.returncode != 0
    assert expect in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_truncated_gzip(tmp_path, seed_trace):
    raw = (seed_trace[0] / "trace" / "kineto.json.gz").read_bytes()
    f = tmp_path / "kineto.json.gz"
    f.write_bytes(raw[: len(raw) // 2])
    r = _run_cli("analyze", str(f))
    assert r.returncode != 0 and "truncated" in r.stderr and "Traceback" not in r.stderr


def test_missing_trace(tmp_path):
    r = _run_cli("analyze", str(tmp_path / "nope"))
    assert r.returncode != 0 and "not found" in r.stderr


def test_analyze_cli_writes_json(seed_trace, tmp_path):
    r = _run_cli("analyze", str(seed_trace[0]), "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "analysis.json").read_text())
    assert doc["candidates"][0]["bytes_saved"] == 16 * seed_trace[1]


def test_unknown_ops_are_listed_not_fatal(tmp_path):
    # A custom op the registry has never heard of: a barrier, listed by name.
    script = tmp_path / "custom.py"
    script.write_text(
        "import torch\n"
        "lib = torch.library.Library('advtest', 'DEF')\n"
        "lib.define('twice(Tensor x) -> Tensor')\n"
        "lib.impl('twice', lambda x: x * 2, 'CPU')\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return torch.ops.advtest.twice(torch.relu(x + 1)).exp()\n"
        "m, x = M(), torch.randn(64)\n"
        "for _ in range(2):\n"
        "    m(x)\n"
    )
    a = analyze(_profile(script, tmp_path / "out"))
    names = [u["name"] for u in a.doc["unknown_ops"]]
    assert "advtest::twice" in names or any("twice" in n for n in names), names
    # add -> relu fuse; the custom op stops the chain before exp.
    assert [c["ops"] for c in a.doc["candidates"]] == [["aten::add", "aten::relu"]]


class _MaskedNorm(torch.nn.Module):
    """Issue 15's repro: transformers' mask helpers reduce with no `dim` (`mask.sum() == mask.numel()`)."""

    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(64)

    def forward(self, x, mask):
        return torch.relu(self.ln(x) + 1.0) * (mask.sum() == mask.numel())


def test_full_reduction_without_dim_through_optimize(tmp_path, monkeypatch):
    """A reduction with no dim (the trace spells the argument "<None>") crashed the matmul-reduction rule
    with `int('<')`. Through `advisor.optimize`: it completes, the LayerNorm -> add -> relu chain is a
    candidate, and the model gives its unpatched outputs."""
    import advisor

    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path / "cache"))
    model = _MaskedNorm().eval()
    x, mask = torch.randn(2, 32, 64), torch.ones(2, 32, dtype=torch.long)
    with torch.no_grad():
        ref = model(x, mask)
    report = advisor.optimize(model, (x, mask), out=tmp_path / "opt")
    doc = json.loads((report.out_dir / "analysis.json").read_text())
    chains = [[op.split("::")[1] for op in c["ops"]] for c in doc["candidates"]]
    assert any(ops[:3] == ["layer_norm", "add", "relu"] for ops in chains), chains
    with torch.no_grad():
        assert torch.allclose(model(x, mask), ref, rtol=1e-5, atol=1e-5)
    advisor.unpatch(model)


# ------------------------------------------------------------------------------- issue 20 item 7
ADAMW_SCRIPT = """
import torch
import advisor
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
x = torch.randn(32, 64)
for _ in range(4):
    with advisor.region("step"):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
"""


@pytest.fixture(scope="module")
def adamw_trace(tmp_path_factory) -> Path:
    """A training step with AdamW (single-tensor: one update chain per parameter, its step size new each step)."""
    script = tmp_path_factory.mktemp("src") / "adamw_step.py"
    script.write_text(ADAMW_SCRIPT)
    out = tmp_path_factory.mktemp("adamw")
    profile_script(script, [], out_dir=out, device="cpu", region="step")
    return out


def test_adamw_chain_is_one_candidate_over_parameter_shapes(adamw_trace):
    """Four parameters (two weight, two bias shapes), three steps, each step's own step size: one candidate,
    four occurrences per iteration, not one row per shape and step with `Occ. 0`."""
    a = analyze(adamw_trace)
    assert a.doc["steady_state"]["iterations"] == 3
    adam = [c for c in a.doc["candidates"] if any(o.endswith("addcdiv_") for o in c["ops"])]
    assert len(adam) == 1, [(d, c["occurrences"]) for d, c in zip(describe(adam), adam)]
    (c,) = adam
    assert c["title"].startswith("Adam/AdamW update: ") and c["occurrences"] == 4
    assert c["kernels_saved"] == 4 * (len(c["ops"]) - 1)
    shapes = {tuple(a.graph.nodes[g.members[-1]].writes[0].shape) for g in a.groups[c["id"]]}
    assert shapes == {(128, 64), (128,), (64, 128), (64,)}, shapes  # every parameter shape, each step
    # (Other candidates may legitimately count under 1 per iteration: a chain the profiler saw in only some
    # of the iterations, which happened under load in CI-like runs; the report prints 0.33, never 0.)


def test_fractional_occurrences_never_read_zero():
    from advisor.units import fmt_count

    assert [fmt_count(v) for v in (1 / 3, 2 / 3, 4, 2.5, 1234.0)] == ["0.33", "0.67", "4", "2.5", "1,234"]


def test_candidate_ids_are_stable_between_profiles(adamw_trace, tmp_path):
    """`apply` profiles the script again: a second profile's timings differ, its candidate ids do not."""
    script = tmp_path / "adamw_step.py"
    script.write_text(ADAMW_SCRIPT)
    second = tmp_path / "again"
    profile_script(script, [], out_dir=second, device="cpu", region="step")
    ids = [{c["pattern_id"]: c["id"] for c in analyze(p).doc["candidates"]} for p in (adamw_trace, second)]
    # the update (optimizer) and the loss's backward chain; in a training step the linear epilogues are not
    # candidates: each linear's output is read again by the backward (GELU's and square's derivatives)
    assert ids[0] == ids[1] and len(ids[0]) >= 2


def test_time_per_iteration_spread_over_three_iterations(adamw_trace):
    import io

    from rich.console import Console

    from advisor.report.terminal import render_terminal

    doc = analyze(adamw_trace).doc
    sp = doc["totals"]["time_us_per_iteration"]
    assert sp["iterations"] == 3 and sp["min"] <= sp["median"] <= sp["max"]
    con = Console(record=True, width=200, file=io.StringIO(), color_system=None)
    render_terminal(doc, None, con)
    out = con.export_text()
    assert "3 iterations)" in out and "median" in out
    adam = next(line for line in out.splitlines() if "Adam/AdamW update" in line)
    assert " 4 " in adam and " 0 " not in adam, adam  # four occurrences per iteration, never `Occ. 0`


def test_guessed_dataflow_never_crosses_iterations():
    """Without an execution trace the dataflow is guessed from shapes and order; one iteration's last
    output must not become the next one's input (that guess invented a 'Residual add + LayerNorm' across
    iterations: issue 20 item 9). Every committed Kineto trace, read without its ET."""
    import glob

    import advisor

    root = Path(__file__).resolve().parent.parent
    traces = sorted(glob.glob(str(root / "sample_traces" / "**" / "kineto.json.gz"), recursive=True))
    assert len(traces) >= 5
    for path in traces:
        g = advisor.analyze(path).graph
        assert any(n.iteration != g.nodes[0].iteration for n in g.nodes), f"{path}: one iteration only"
        cross = [(g.nodes[g.values[u.value].producer].op, n.op) for n in g.nodes for u in n.reads
                 if g.values[u.value].producer >= 0 and g.nodes[g.values[u.value].producer].iteration != n.iteration]
        assert not cross, f"{path}: {cross[:3]}"


def test_the_docs_document_every_field_analysis_json_writes():
    """Issue 20: the documentation's analysis.json section (docs/ARCHITECTURE.md, the contracts between
    stages) names every key the writer writes (top level, totals, estimate and each candidate), for a GPU
    trace and a CPU one."""
    import advisor

    root = Path(__file__).resolve().parent.parent
    readme = (root / "docs" / "ARCHITECTURE.md").read_text()
    section = readme.split("## analysis.json", 1)[1].split("\n## ", 1)[0]
    for trace in ("hf_llama", "cpu/seed"):
        doc = advisor.analyze(root / "sample_traces" / trace).doc
        missing = [k for k in doc if f"| `{k}` |" not in section]
        missing += [f"totals.{k}" for k in doc["totals"] if f"`{k}`" not in section]
        missing += [f"totals.time_us_per_iteration.{k}" for k in doc["totals"]["time_us_per_iteration"]
                    if f"`{k}`" not in section]
        missing += [f"estimate.{k}" for k in doc["estimate"] if f"`{k}`" not in section]
        missing += [f"candidate.{k}" for c in doc["candidates"] for k in c if f"`{k}`" not in section]
        assert not missing, f"{trace}: undocumented: {sorted(set(missing))}"


# ------------------------------------------------------------------------------- a training step (issue 19)
TRAIN_SCRIPT = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=128, vocab_size=256))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
ids = torch.randint(0, 256, (2, 32))
for _ in range(4):
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.fixture(scope="module")
def training_analysis(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    script = out / "train.py"
    script.write_text(TRAIN_SCRIPT)
    return analyze(_profile(script, out / "prof")).doc


def test_a_training_loop_is_analysed_step_by_step(training_analysis):
    """A script that trains, profiled with no region: each iteration is a training step (the model's call,
    then its backward and the optimizer's step), and its candidates say which part they run in. The
    backward's ops are the work (autograd's per-node scopes were opaque ops before: 'other', 47% of the
    time); no candidate joins a forward op to the backward op that reads its output a pass later; the
    forward's are generated, the backward's and the optimizer's say what fuses them instead."""
    from advisor.records import Candidate
    from advisor.report.next_step import next_steps
    from advisor.workflows.generate import _top_forward, skip_reason

    doc = training_analysis
    assert doc["steady_state"]["source"] == "module" and doc["steady_state"].get("training_step")
    assert not any(u["name"].startswith(("autograd::", "torch::autograd")) for u in doc["unknown_ops"])
    cands = [Candidate.from_json(c) for c in doc["candidates"]]
    phases = {c.phase for c in cands}
    assert {None, "backward", "optimizer"} <= phases, [(c.title, c.phase) for c in cands]
    adam = [c for c in cands if c.title.startswith("Adam")]
    assert adam and all(c.phase == "optimizer" for c in adam)
    forward = [c for c in cands if c.phase is None]
    assert any("RMSNorm" in c.title for c in forward)
    for c in cands:
        assert (skip_reason(c) or "").startswith(("runs in the backward", "the optimizer's update")) == bool(c.phase)
    chosen = _top_forward(cands, 2)
    assert sum(c.phase is None for c in chosen) == 2 and chosen[-1].phase is None
    steps = next_steps(doc)
    assert any("fused=True" in s.code for s in steps) and any("train=True" in s.code for s in steps)


def test_training_steps_reach_over_the_backward_and_the_optimizer():
    from advisor.collect import steady

    def ev(name, ts, dur, tid=1, cat="cpu_op"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": {}}
    calls = [(0, 10), (100, 110), (200, 210)]
    events = []
    for b, e in calls:  # the forward, its backward on autograd's thread, the optimizer after it
        events += [ev("autograd::engine::evaluate_function: MmBackward0", e + 5, 30, tid=2),
                   ev("Optimizer.step#AdamW.step", e + 40, 20, cat="user_annotation")]
    windows = steady.training_steps(events, calls)
    assert windows == [(0, 70), (100, 170), (200, 270)]
    assert steady.training_steps([ev("aten::mm", 5, 1)], calls) is None  # inference: nothing to reach over


def test_gemm_epilogue_pays_for_the_triton_gemm(monkeypatch):
    """A GEMM epilogue moves the product from cuBLAS to our Triton GEMM: its estimate on the committed H100 trace
    is the output's round trip less (slowdown(K) - 1) x cuBLAS's measured time (BERT pooler's linear + tanh). A
    linear + ReLU or GELU is cuBLASLt's own epilogue instead (`patching.gemm_epilogues`): its estimate is the
    activation kernel's measured time less what the epilogue still costs, whatever our Triton GEMM's speed."""
    from advisor.analysis import cost

    assert cost.triton_gemm_slowdown(768) == pytest.approx(1.64)
    assert cost.triton_gemm_slowdown(1 << 20) == cost.TRITON_GEMM_SLOWDOWN[-1][1]
    assert 1.5 > cost.triton_gemm_slowdown(1536) > 1.38  # between its points, in log2(K)

    def epilogues(trace):
        doc = analyze(ROOT / "sample_traces" / trace).doc
        return {c["title"]: c["est_time_saved_us"] for c in doc["candidates"] if c["kind"] == "epilogue"}

    charged = {**epilogues("timm_vit"), **epilogues("hf_bert")}
    monkeypatch.setattr(cost, "TRITON_GEMM_SLOWDOWN", ((1, 1.0),))  # as fast as cuBLAS: the bytes alone
    free = {**epilogues("timm_vit"), **epilogues("hf_bert")}
    assert charged.keys() == free.keys() and len(charged) >= 3
    triton = [t for t in charged if "→ gelu" not in t and "→ relu" not in t]
    assert triton and all(0 <= charged[t] < free[t] for t in triton), (charged, free)
    lt = [t for t in charged if t not in triton]
    assert len(lt) >= 2 and all(0 < charged[t] == free[t] for t in lt), (charged, free)
    monkeypatch.setattr(cost, "CUBLASLT_EPILOGUE_SHARE", {"relu": 0.0, "gelu": 0.0})
    whole = epilogues("hf_bert")  # the activation's whole time: 1 / (1 - 0.3) of the estimate
    assert all(whole[t] == pytest.approx(charged[t] / 0.7) for t in lt if t in whole)
