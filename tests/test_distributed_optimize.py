"""Issue 50, item 3: `advisor.optimize(train=True, interpret=True)` on the ranks of a two-rank gloo job (the CPU): a
tiny HF Llama inside `DistributedDataParallel` and one `fully_shard`-ed (FSDP2) train through the fused forwards and
backwards with the gradients of an unpatched twin wrapped the same way, and every rank keeps rank 0's state. One job
is shared by the tests (tests/fixtures/optimize_ranks.py; about a minute on two cores)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "fixtures" / "optimize_ranks.py"
STEPS = 3
WRAPPERS = ("ddp", "fsdp2")


def _fsdp2_missing() -> str | None:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as e:
        return f"this torch has no FSDP2 (`torch.distributed.fsdp.fully_shard`): {e}; bench/distributed.py covers it"
    return None


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    if _fsdp2_missing():
        pytest.skip(_fsdp2_missing())
    out = tmp_path_factory.mktemp("optimize-ranks")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(SCRIPT), "--out", str(out), "--steps", str(STEPS)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return out, [json.loads((out / f"rank-{k}.json").read_text()) for k in (0, 1)]


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_wrapped_model_trains_fused_with_the_unpatched_gradients(ranks, wrapper):
    """Each rank trains on its own batch; the gradients after every step, synchronised by DDP's all-reduce or
    FSDP2's reduce-scatter, are the unpatched twin's, and the steps ran fused sites (no silent fallback)."""
    _, results = ranks
    for rank, result in enumerate(results):
        r = result[wrapper]
        assert r["grad_max_diff"] < 1e-5 * max(r["grad_max"], 1.0), (rank, r)
        assert r["losses"] == pytest.approx(r["twin_losses"], rel=1e-5)
        assert r["fused_runs"] >= STEPS, (rank, r)  # at least one fused site per step, forward and backward
        assert "counted on one training step" in r["training"], r["training"]
    # the ranks' batches differ, their synchronised gradients do not: the losses differ, the twins' steps agree
    assert results[0][wrapper]["losses"] != results[1][wrapper]["losses"]


def _state(apply: dict) -> str:
    """apply.json without what is a rank's own: its folder, its wall seconds, its rank, whether its kernels were in
    the generator's cache (the ranks share it: the first to generate a kernel stores it for the other)."""
    def mine(key: str) -> bool:
        return key in ("phases_s", "distributed", "seconds", "cached")

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if not mine(k)}
        return [strip(v) for v in x] if isinstance(x, list) else x
    return re.sub(r"/rank-\d+/", "/rank-K/", json.dumps(strip(apply), sort_keys=True))


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_every_rank_keeps_rank_zeros_state(ranks, wrapper):
    """The plan (rank 0's analysis: a rank's own profile may number or group its patterns otherwise), the output
    checks and the training decision are broadcast from rank 0: both ranks' apply.json hold one state, and say so."""
    out, results = ranks
    applies = [json.loads(Path(results[k][wrapper]["apply"]).read_text()) for k in (0, 1)]
    assert [Path(results[k][wrapper]["apply"]).parent for k in (0, 1)] == [out / wrapper / f"rank-{k}" for k in (0, 1)]
    assert _state(applies[0]) == _state(applies[1])
    assert applies[0]["runs"]["fused_launches_per_call"] > 0
    for k, a in enumerate(applies):
        d = a["distributed"]
        assert (d["rank"], d["world_size"], d["backend"], d["decided_by"]) == (k, 2, "gloo", 0)
        assert {"plan", "output checks", "training count"} <= set(d["agreed"]), d
    assert applies[0]["distributed"]["agreed"] == applies[1]["distributed"]["agreed"]


def test_outside_a_job_nothing_is_agreed():
    from advisor import agreement

    assert agreement.job() is None
    assert agreement.agreed({"x": 1}, "anything") == {"x": 1} and agreement.everywhere(False, "anything") is False
    with agreement.recorded() as so_far:
        agreement.agreed(1, "anything")
    assert so_far() is None
