"""One seeded, deterministic model profiled five times gives one analysis (issue: four candidate lists out of
five profiles, 2.6 occurrences a call, `c4` a different pattern from run to run). The model runs PyTorch's
fused encoder layer (`torch._transformer_encoder_layer_fwd`: the script turns the fast path on itself), whose
q/k/v buffer is allocated inside `_transform_bias_rescale_qkv`, an op outside the graph. Storage ids are
addresses: where the heap handed that buffer a block a node's output had freed, its reads bound to that node,
and which calls that hit depended on what else the process allocated, and when (a loaded machine). A storage
an op outside the graph allocates now starts a new tensor (`etnodes._allocations`), and the test below churns
the heap and the timing on purpose."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import torch, torch.nn as nn
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.TransformerEncoderLayer(128, 4, 512, activation="gelu", batch_first=True,
                                                       norm_first=True) for _ in range(4)]).eval()
    x = torch.randn(2, 16, 128)
    torch.backends.mha.set_fastpath_enabled(True)  # the script's own choice, over the profiler's module-level paths
    with torch.no_grad():
        for _ in range(6):
            model(x)
""")

# The same model, with a pre-hook on each layer that allocates and frees memory the profiler does not see and
# sleeps, a different amount in every call (seeded by argv): each call's tensors come from another heap layout,
# at other times, as on a machine that other processes load.
CHURNED = SCRIPT.replace("with torch.no_grad():", textwrap.dedent("""\
    import random, sys, time
    import numpy as np
    rng, held = random.Random(int(sys.argv[1])), []

    def churn(*_):
        global held
        held = held[rng.randrange(len(held) + 1):] + [np.empty(rng.randrange(4096, 20000), np.float32)
                                                     for _ in range(rng.randrange(4))]
        time.sleep(rng.random() / 500)

    for layer in model:
        layer.register_forward_pre_hook(churn)
    with torch.no_grad():"""))


def profile_and_analyze(script: Path, out: Path, *argv: str) -> list:
    for cmd in (["profile", str(script), "--out", str(out), *(["--", *argv] if argv else [])], ["analyze", str(out)]):
        run = subprocess.run([sys.executable, "-m", "advisor", *cmd], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    doc = json.loads((out / "analysis.json").read_text())
    # every steady call grouped its ops alike: none was left out of the candidates as grouped otherwise
    assert "left_out_of_candidates" not in doc["steady_state"], doc["steady_state"]
    return [(c["id"], c["title"], c["occurrences"], c["pattern_id"]) for c in doc["candidates"]]


def test_five_profiles_of_a_seeded_model_give_one_analysis(tmp_path):
    script = tmp_path / "enc.py"
    script.write_text(SCRIPT)
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda k: profile_and_analyze(script, tmp_path / f"p{k}"), range(5)))
    assert runs[0], "no candidates"
    assert all(isinstance(n, int) for _, _, n, _ in runs[0]), runs[0]  # whole occurrences a call
    assert all(r == runs[0] for r in runs), runs


def test_a_churned_heap_and_jittered_calls_give_the_same_analysis(tmp_path):
    script = tmp_path / "churned.py"
    script.write_text(CHURNED)
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda seed: profile_and_analyze(script, tmp_path / f"s{seed}", str(seed)), (1, 2)))
    assert runs[0] and all(isinstance(n, int) for _, _, n, _ in runs[0]), runs[0]
    assert runs[0] == runs[1], runs


def test_one_trace_analysed_in_processes_of_other_hash_seeds_gives_one_analysis_json():
    """Sets and dicts of strings iterate in an order the process's hash seed decides: an analysis of one trace must
    not show it (the candidates' `shared` overlaps came out in another order from run to run)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("import json, advisor; d = advisor.analyze('sample_traces/hf_llama').doc; "
            "print(json.dumps(d['candidates']))")
    outs = set()
    for seed in ("1", "2", "3", "4"):
        env = {**__import__("os").environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(root)}
        done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        outs.add(done.stdout)
    assert len(outs) == 1, [json.loads(o)[0].get("shared") for o in outs]
