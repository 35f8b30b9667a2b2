#!/usr/bin/env bash
# Re-render the example reports committed under reports/examples/: for each H100 sample trace,
# analysis.json + report.txt + report.html, checked in headless Chromium with a screenshot.
#   bash bench/example_reports.sh
set -euo pipefail
cd "$(dirname "$0")/.."
for trace in sample_traces/*/trace; do
    name=$(basename "$(dirname "$trace")")
    [ "$name" = cpu ] && continue
    out=reports/examples/$name
    mkdir -p "$out"
    python3 -m advisor analyze "sample_traces/$name" --out "$out" >/dev/null
    # Paths in analysis.json point at the repo's sample traces, not at this machine's checkout.
    python3 - "$out/analysis.json" <<'PY'
import json, os, sys
p = sys.argv[1]
doc = json.load(open(p))
doc["source"] = {k: os.path.relpath(v) if v else v for k, v in doc["source"].items()}
json.dump(doc, open(p, "w"), indent=1)
PY
    COLUMNS=120 python3 -m advisor report "$out" >/dev/null
    python3 tests/browser_check.py "$out/report.html" --screenshot "reports/screenshots/$name.png" --height 1400
    echo "$name: $(du -sh "$out" | cut -f1)"
done
