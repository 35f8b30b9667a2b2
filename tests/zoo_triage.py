"""Triage of the model zoo: every model through tests/test_zoo.py (one pytest process), as a markdown table.

    PYTHONPATH=$PWD python tests/zoo_triage.py [OUT.md] [model,model,...|all] [extra pytest arguments]

Writes a table model x check (ok / FAIL / ERR) with the time per model (optimize, all checks) and, per
check, each failure's message (first line, shortened). Not collected by pytest (no test_ prefix).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ["optimize_completes", "validated", "patched", "same_outputs", "other_shapes", "whole_stack", "train_mode",
          "autograd", "fused_training", "hooks", "generate", "unpatch"]  # tests/test_zoo.py's, in its order


def main(argv: list[str]) -> None:
    out = Path(argv[0]) if argv else ROOT / "ZOO_TRIAGE.md"
    models = argv[1] if len(argv) > 1 else "all"
    xml = Path(tempfile.mkdtemp()) / "zoo.xml"
    env = {**os.environ, "FUSION_ADVISOR_ZOO": models,
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    rc = subprocess.run([sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         "tests/test_zoo.py", f"--junitxml={xml}", "-o", "junit_logging=no", *argv[2:]],
                        cwd=ROOT, env=env).returncode
    if not xml.exists():
        sys.exit(f"pytest ended with exit status {rc} before writing its report")
    res: dict = defaultdict(dict)
    secs: dict = defaultdict(float)
    opt_s = {}
    for tc in ET.parse(xml).getroot().iter("testcase"):
        m = re.match(r"test_(\w+)\[(\w+)\]", tc.get("name"))
        if not m:
            continue
        check, model = m.groups()
        secs[model] += float(tc.get("time") or 0)
        for p in tc.iter("property"):
            if p.get("name") == "optimize_s":
                opt_s[model] = p.get("value")
        bad = tc.find("failure") if tc.find("failure") is not None else tc.find("error")
        skip = tc.find("skipped")
        if skip is not None:
            continue
        if bad is None:
            res[model][check] = ("ok", "")
        else:
            # the assertion's own lines (pytest's `E ` lines up to its introspection), else the message
            lines = [ln[1:].strip() for ln in (bad.text or "").splitlines() if ln.startswith("E ")]
            lines = [ln for ln in lines if not ln.startswith(("assert ", "+  where", "+    where"))]
            msg = " ".join(lines) or (bad.get("message") or "").strip()
            res[model][check] = ("FAIL" if bad.tag == "failure" else "ERR", msg)
    lines = ["| model | optimize s | all checks s | " + " | ".join(CHECKS) + " |",
             "|---|---|---|" + "---|" * len(CHECKS)]
    for model in res:
        cells = [res[model].get(c, ("-", ""))[0] for c in CHECKS]
        lines.append(f"| {model} | {opt_s.get(model, '?')} | {secs[model]:.1f} | " + " | ".join(cells) + " |")
    lines += ["", "## Failure messages", ""]
    for model in res:
        for c in CHECKS:
            st, msg = res[model].get(c, ("-", ""))
            if st in ("FAIL", "ERR") and "optimize did not complete" not in msg:
                short = " ".join(msg.split())
                lines.append(f"- **{model} / {c}**: {short[:1500]}")
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main(sys.argv[1:])
