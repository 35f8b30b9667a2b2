"""Issue 50, items 1-2: `fusion-advisor profile --nproc-per-node 2` of a tiny DDP script (gloo, the CPU), one trace
per rank with the same steady-state calls, and `analyze` merging the ranks' candidates with communication
recognised and never fused. One profiled job is shared by the tests (about 20 s on two cores)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from advisor.ops.registry import OpClass, is_communication, lookup

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "fixtures" / "ddp_tiny.py"


def _cli(*args, timeout=240, env=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "advisor", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    r = _cli("profile", "--nproc-per-node", 2, SCRIPT, "--out", out, "--device", "cpu", "--", "--steps", 4)
    assert r.returncode == 0, r.stdout + r.stderr
    a = _cli("analyze", out)
    assert a.returncode == 0, a.stdout + a.stderr
    return out, r, a


def test_one_trace_per_rank_with_rank_fields_and_the_same_calls(job):
    out, r, _ = job
    metas = [json.loads((out / "trace" / f"rank-{k}" / "meta.json").read_text()) for k in (0, 1)]
    for k, m in enumerate(metas):
        assert (m["rank"], m["world_size"], m["local_rank"], m["backend"]) == (k, 2, k, "gloo")
        assert m["complete"] and m["exit_code"] == 0
        assert {"kineto.json.gz", "et.json.gz"} <= {p.name for p in (out / "trace" / f"rank-{k}").iterdir()}
        assert m["steady_state"]["source"] == "module"
        assert len(m["steady_state"]["iterations"]) == len(m["steady_state"]["calls"])
    assert metas[0]["steady_state"]["calls"] == metas[1]["steady_state"]["calls"] == [2, 3, 4]
    assert not (out / "trace" / "meta.json").exists()
    assert "2 ranks profiled; steady state: calls 2-4 on every rank" in r.stdout


def test_analyze_merges_the_ranks_and_keeps_communication_out(job):
    out, _, a = job
    doc = json.loads((out / "analysis.json").read_text())
    assert doc["distributed"]["world_size"] == 2 and doc["distributed"]["backend"] == "gloo"
    assert [r["rank"] for r in doc["distributed"]["ranks"]] == [0, 1]
    assert all((out / f"rank-{k}" / "analysis.json").is_file() for k in (0, 1))
    loss = [c for c in doc["candidates"] if c["ops"] == ["aten::relu", "aten::mul", "aten::add"]]
    assert len(loss) == 1, [(c["title"], c["ranks"]) for c in doc["candidates"]]  # the loss's chain, on every rank
    assert loss[0]["ranks"]["seen_on"] == [0, 1] and set(loss[0]["ranks"]["est_time_saved_us"]) == {"0", "1"}
    for c in doc["candidates"]:  # the ranks run one model on the same data: every pattern is found on both
        assert c["ranks"]["seen_on"] == [0, 1] and c["ranks"]["missing_on"] == [], (c["title"], c["ranks"])
        assert c["ranks"]["min"] <= c["est_time_saved_us"] <= c["ranks"]["max"]
        assert not any(is_communication(op) for op in c["ops"] + c["kernels"])
    assert len({c["id"] for c in doc["candidates"]}) == len(doc["candidates"])
    # communication is recognised on every rank (DDP's gradient all-reduce), as a barrier never in a candidate
    for k in (0, 1):
        rank_doc = json.loads((out / f"rank-{k}" / "analysis.json").read_text())
        assert any("all_reduce" in x["name"] or "allreduce" in x["name"] for x in rank_doc["communication"])
        assert rank_doc["totals"]["communication_us"] > 0
        c = rank_doc["communication_time"]  # the all-reduce against the step's compute
        assert 0 < c["exposed_us"] <= c["communication_us"] < c["iteration_us"]
        comm = [t for t in rank_doc["timeline"] if t["class"] == "communication"]
        assert comm and all(t["candidate"] is None for t in comm)
        assert not [u for u in rank_doc["unknown_ops"] if is_communication(u["name"])]
    assert "2 of 2 ranks (gloo)" in a.stdout and "c1 est. saved" in a.stdout and "exposed" in a.stdout
    assert "straggler" in a.stdout.lower()  # named, or said to be none


def test_an_asynchronous_collective_leaves_the_calls_it_overlaps_alone():
    """A DDP job's trace, recorded (fixtures/ddp_gloo_trace, `--steps 4` of ddp_tiny.py), in which rank 1's
    execution trace nests its main thread's ops under gloo's all_reduce: begun for the main thread and ended by
    gloo's worker, it stayed open on the main thread's ET stack, and its end popped another op. By the ET's links
    the all_reduce, a barrier node, swallowed most of call 3 and call 4's forward, and rank 1 had no candidate;
    which calls that hit changed from run to run. Ops are nested by their Kineto ops, per thread."""
    from collections import Counter

    import advisor

    analyses = [advisor.analyze(ROOT / "tests" / "fixtures" / "ddp_gloo_trace" / f"rank-{k}") for k in (0, 1)]
    for a in analyses:
        ops = a.ops
        assert a.doc["steady_state"]["iterations"] == 3
        # calls 3 and 4 (the first steady call rebuilds DDP's buckets): the same ops
        assert Counter(ops["op"][ops["iteration"] == 1]) == Counter(ops["op"][ops["iteration"] == 2])
    assert ([c["ops"] for c in analyses[0].doc["candidates"]] == [c["ops"] for c in analyses[1].doc["candidates"]]
            == [["aten::relu", "aten::mul", "aten::add"]])


def test_the_registry_knows_communication():
    for name in ("c10d::allreduce_", "c10d::broadcast_", "_c10d_functional::all_gather_into_tensor",
                 "gloo:all_reduce", "nccl:all_reduce", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "record_param_comms"):
        assert lookup(name).cls is OpClass.COMMUNICATION, name
    for name in ("aten::broadcast_tensors", "aten::add", "aten::all", "aten::reduce"):
        assert not is_communication(name), name


def test_a_failing_rank_passes_its_exit_code_through(tmp_path):
    r = _cli("profile", "--nproc-per-node", 2, SCRIPT, "--out", tmp_path, "--device", "cpu", "--",
             "--steps", 2, "--fail-rank", 1, "--exit-code", 3)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "error: rank 1 exited with 3" in r.stderr


def test_bad_input_is_one_line_and_launches_nothing(tmp_path):
    r = _cli("profile", "--nproc-per-node", 2, tmp_path / "missing.py", "--out", tmp_path, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"error: script not found: {tmp_path / 'missing.py'}"]
    r = _cli("profile", "--nproc-per-node", 0, SCRIPT, "--out", tmp_path, timeout=60)
    assert r.returncode == 2 and "--nproc-per-node" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_nproc_inside_a_torchrun_job_is_refused(tmp_path, monkeypatch):
    from advisor.collect.launch import launch
    from advisor.errors import AdvisorError

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(AdvisorError, match="inside a torchrun job"):
        launch(SCRIPT, [], tmp_path, 2)


def test_inside_torchrun_each_rank_writes_its_folder(tmp_path):
    """Wrapping: torchrun starts `python -m advisor profile` as each rank."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "advisor", "profile", str(SCRIPT), "--out", str(tmp_path), "--device", "cpu",
                        "--calls", "3", "--", "--steps", "3"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    metas = [json.loads((tmp_path / "trace" / f"rank-{k}" / "meta.json").read_text()) for k in (0, 1)]
    assert [m["rank"] for m in metas] == [0, 1] and all(m["backend"] == "gloo" for m in metas)
    assert metas[0]["steady_state"]["calls"] == metas[1]["steady_state"]["calls"] == [2, 3]
