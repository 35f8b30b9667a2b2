"""`fusion-advisor profile` on a script of many calls records a bounded window by default and says how to
record more (a loop of 20,000 small calls profiled whole took 835 s and 12.6 GB)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import sys, torch
m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU())
x = torch.randn(4, 16)
for _ in range(int(sys.argv[1])):
    with torch.no_grad():
        m(x)
"""


def test_a_long_script_is_profiled_in_a_bounded_window_that_says_how_to_profile_more(tmp_path):
    from advisor.collect.schedule import DEFAULT_ACTIVE

    script = tmp_path / "many.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "advisor", "profile", str(script), "--out", str(tmp_path / "o"),
                        "--", "300"], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr[-2000:]
    meta = json.loads((tmp_path / "o" / "trace" / "meta.json").read_text())
    assert meta["profile_calls"] == 1 + DEFAULT_ACTIVE and meta["module_calls"] == 300
    assert len(meta["steady_state"]["iterations"]) == DEFAULT_ACTIVE
    assert f"profiled calls 1-{1 + DEFAULT_ACTIVE} of the 300 the script made" in r.stdout
    assert "--calls N or --schedule WAIT,WARMUP,ACTIVE profiles others" in r.stdout
