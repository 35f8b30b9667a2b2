"""Collector overhead: the Llama sample workload run plainly and under `fusion-advisor profile`.

    python -m bench.profile_overhead                 # --iters 3 and 50, 3 runs each, writes reports/scale/README.md
    python -m bench.profile_overhead --iters 3 --runs 1 --no-report

Both runs are whole processes (`python3 examples/hf_llama.py --device cpu --iters N` against
`python3 -m advisor profile examples/hf_llama.py --out TMP -- --device cpu --iters N`), timed from the
outside, median of --runs, after one unmeasured warm-up of each (file cache). The target is profiled
<= 3x plain. The collector's own phase timings (meta.json collect_s: package pre-import, the profiled
script, export, bandwidth measurement) say where the extra time goes. A third column profiles with
FUSION_ADVISOR_PROFILE_CALLS=3: the profiler stops after the warm-up call and two steady ones, and the
rest of the script runs unprofiled -- what bounds the overhead of long-running scripts.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "hf_llama.py"
TARGET = 3.0


def timed(cmd: list[str], **env) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return time.perf_counter() - t


def measure(iters: int, runs: int) -> dict:
    plain_cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--iters", str(iters)]
    timed(plain_cmd)  # warm-up: file cache, .pyc
    plain, prof, limited, phases = [], [], [], []
    for _ in range(runs):  # interleaved, so drifting machine load hits all alike
        plain.append(timed(plain_cmd))
        for times, env in ((prof, {}), (limited, {"FUSION_ADVISOR_PROFILE_CALLS": "3"})):
            with tempfile.TemporaryDirectory() as out:
                times.append(timed([sys.executable, "-m", "advisor", "profile", str(SCRIPT), "--out", out, "--",
                                    "--device", "cpu", "--iters", str(iters)], **env))
                if not env:
                    meta = json.loads((Path(out) / "trace" / "meta.json").read_text())
                    phases.append({**meta["collect_s"], "script": meta["wall_s"]})
    med = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
    return {"iters": iters, "plain_s": statistics.median(plain), "profiled_s": statistics.median(prof),
            "limited_s": statistics.median(limited), "phases": med, "runs": runs, "loadavg": os.getloadavg()[0]}


def report(rows: list[dict]) -> str:
    lines = ["| --iters | plain | profiled | ratio | profiled, PROFILE_CALLS=3 | ratio | profiled phases (median) "
             "| load avg |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ph = ", ".join(f"{k} {v:.1f} s" for k, v in r["phases"].items())
        lines.append(f"| {r['iters']} | {r['plain_s']:.1f} s | {r['profiled_s']:.1f} s | "
                     f"**{r['profiled_s'] / r['plain_s']:.2f}×** | {r['limited_s']:.1f} s | "
                     f"**{r['limited_s'] / r['plain_s']:.2f}×** | {ph} | {r['loadavg']:.1f} |")
    out = "\n".join(lines)
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        dp, dq = b["plain_s"] - a["plain_s"], b["phases"]["script"] - a["phases"]["script"]
        out += (f"\n\nIterations {a['iters']}→{b['iters']}: plain +{dp:.1f} s, the script under the profiler "
                f"+{dq:.1f} s" + (f" ({dq / dp:.0f}× per iteration)." if dp > 0.3 else " (plain too small to divide by)."))
    for key, what in (("profiled_s", "default"), ("limited_s", "FUSION_ADVISOR_PROFILE_CALLS=3")):
        worst = max(r[key] / r["plain_s"] for r in rows)
        out += f"\n- profiled ≤ {TARGET:.0f}× plain, {what}: **{'met' if worst <= TARGET else 'missed'}** (worst {worst:.2f}×)"
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, nargs="+", default=[3, 50])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--report", type=Path, default=ROOT / "reports" / "scale" / "README.md")
    ap.add_argument("--no-report", action="store_true")
    a = ap.parse_args(argv)
    rows = [measure(i, a.runs) for i in a.iters]
    body = (f"Measured {time.strftime('%Y-%m-%d %H:%M')} by `python -m bench.profile_overhead` "
            f"(examples/hf_llama.py --device cpu, whole processes, median of {a.runs}).\n\n{report(rows)}\n")
    print(body)
    if not a.no_report:
        from bench.scale import write_section

        write_section(a.report, "collector", body)


if __name__ == "__main__":
    main()
