"""One seeded, deterministic model profiled five times gives one analysis (issue: four candidate lists out of
five profiles, 2.6 occurrences a call, `c4` a different pattern from run to run). The model runs PyTorch's
fused encoder layer (`torch._transformer_encoder_layer_fwd`: the script turns the fast path on itself): the
q/k/v buffer it allocates inside comes from no recorded op, so on the CPU a read of it could bind to a
tensor freed at the same address, and which iteration that hit varied with the heap. Candidates are now
counted over the steady iterations that agree (`api._whole_iterations`)."""
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



def profile_and_analyze(script: Path, out: Path) -> list:
    for cmd in (["profile", str(script), "--out", str(out)], ["analyze", str(out)]):
        run = subprocess.run([sys.executable, "-m", "advisor", *cmd], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    doc = json.loads((out / "analysis.json").read_text())
    return [(c["id"], c["title"], c["occurrences"], c["pattern_id"]) for c in doc["candidates"]]


def test_five_profiles_of_a_seeded_model_give_one_analysis(tmp_path):
    script = tmp_path / "enc.py"
    script.write_text(SCRIPT)
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda k: profile_and_analyze(script, tmp_path / f"p{k}"), range(5)))
    assert runs[0], "no candidates"
    assert all(isinstance(n, int) for _, _, n, _ in runs[0]), runs[0]  # whole occurrences a call
    assert all(r == runs[0] for r in runs), runs
