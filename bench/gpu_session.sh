#!/usr/bin/env bash
# One GPU lease, one command: everything this project measures on the H100, in the order that
# matters most, each step time-capped so the whole fits in a 10-minute device call.
#   OUT=/dir bash bench/gpu_session.sh
# Writes under $OUT: suite/bench-<gpu>.{md,json,jsonl}, samples.tar.gz (+ record.log, summary.tsv),
# matmul_fusion.{md,json} when bench/matmul_fusion.py exists, and session.log.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
SUITE_BUDGET=${SUITE_BUDGET:-400}
mkdir -p "$OUT/suite"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
log() { echo "== $(date -u +%T) $*" | tee -a "$OUT/session.log"; }

log "suite (budget ${SUITE_BUDGET}s)"
timeout --kill-after=15 $((SUITE_BUDGET + 60)) python3 bench/suite.py --out "$OUT/suite" --budget "$SUITE_BUDGET" \
    >>"$OUT/session.log" 2>&1
log "suite rc=$?"

log "sample traces: eager attention and SPLADE on cuda"
DEVICES=cuda WORKLOADS="hf_gpt2_eager hf_bert_eager splade" TOTAL_BUDGET=80 OUT=$OUT \
    bash bench/record_samples.sh >>"$OUT/session.log" 2>&1
log "samples rc=$?"

if [ -f bench/matmul_fusion.py ]; then
    log "matmul-anchored fusion microbenchmarks"
    timeout --kill-after=10 ${MATMUL_BUDGET:-70} python3 bench/matmul_fusion.py --out "$OUT/matmul_fusion" \
        >>"$OUT/session.log" 2>&1
    log "matmul_fusion rc=$?"
fi
tail -n 40 "$OUT/session.log"
