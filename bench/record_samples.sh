#!/usr/bin/env bash
# Record sample traces of the example workloads with `fusion-advisor profile`, on cuda and on cpu,
# and pack them into ONE tarball: $OUT/samples.tar.gz, laid out as
#     sample_traces/<name>/trace/{kineto.json.gz,et.json.gz,meta.json}       (cuda)
#     sample_traces/cpu/<name>/trace/{kineto.json.gz,et.json.gz,meta.json}   (cpu)
#     sample_traces/record.log                                                 (everything printed)
#     sample_traces/summary.tsv                                                (device, name, rc, seconds, bytes, args)
# The log and summary are also copied to $OUT/ for reading without unpacking.
#
# Meant for the GPU machine (torch 2.11, Python 3.12, transformers/timm/torchvision, no nvtx package,
# no network); run from anywhere:  OUT=/some/dir bash bench/record_samples.sh
# Knobs (environment): OUT (default ./out), DEVICES (default "cuda cpu"), WORKLOADS (default: every one),
# RUN_TIMEOUT (seconds per profile run, default 240), LIMIT_BYTES (per trace dir, default 5 MB),
# TOTAL_BUDGET (seconds for all runs, default 540: runs that would start after it are skipped, so the
# tarball is always written inside a 10-minute command limit).
# It never stops at a failing workload: each run's exit code is logged and the next one starts.
# A trace dir over LIMIT_BYTES is re-recorded with fewer layers and iterations (never dropped).
set -u -o pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
DEVICES=${DEVICES:-"cuda cpu"}
WORKLOADS=${WORKLOADS:-"seed mlp_block hf_llama hf_gpt2 hf_bert timm_vit tv_resnet50 hf_gpt2_eager hf_bert_eager splade hf_t5_encoder"}
RUN_TIMEOUT=${RUN_TIMEOUT:-240}
TOTAL_BUDGET=${TOTAL_BUDGET:-540}
LIMIT_BYTES=${LIMIT_BYTES:-$((5 * 1024 * 1024))}
PY=${PYTHON:-python3}

mkdir -p "$OUT"
STAGE=$(mktemp -d "${TMPDIR:-/tmp}/fa_samples.XXXXXX")
SAMPLES=$STAGE/sample_traces
mkdir -p "$SAMPLES"
LOG=$SAMPLES/record.log
SUMMARY=$SAMPLES/summary.tsv
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
printf 'device\tname\trc\tseconds\tbytes\targs\n' >"$SUMMARY"

log() { echo "$*" | tee -a "$LOG"; }
START=$(date +%s)

log "== fusion-advisor sample recording, $(date -u +%FT%TZ) on $(hostname)"
log "== root $ROOT, out $OUT, devices: $DEVICES, workloads: $WORKLOADS"
$PY - >>"$LOG" 2>&1 <<'EOF'
import platform, sys
print("python", platform.python_version())
from importlib import metadata
for m in ("torch", "triton", "transformers", "timm", "torchvision", "typer", "rich", "pandas", "nvtx"):
    try:
        mod = __import__(m)
        try:
            v = metadata.version(m)
        except Exception:
            v = getattr(mod, "__version__", "?")
        print(f"{m} {v}")
    except Exception as e:
        print(f"{m} MISSING ({type(e).__name__})")
import torch
print("cuda available:", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
tail -n 12 "$LOG"
if ! $PY -c "import typer, rich, torch" 2>/dev/null; then
    log "!! python3 cannot import typer/rich/torch: fusion-advisor cannot run here (see $LOG)"
fi

# Arguments that shrink a workload's trace: first try, then smaller, then smallest.
shrink_args() {  # name level
    local name=$1 level=$2
    case "$level" in
        0) echo "" ;;
        1) case "$name" in
               hf_*) echo "--iters 2 --layers 1" ;;
               timm_vit) echo "--iters 2 --depth 1" ;;
               *) echo "--iters 2" ;;
           esac ;;
        *) echo "STOP" ;;
    esac
}

workload() {  # name -> "script base-args": variants of an example are named <example>_<variant>
    case "$1" in
        hf_gpt2_eager) echo "hf_gpt2 --attn eager" ;;
        hf_bert_eager) echo "hf_bert --attn eager" ;;
        *) echo "$1" ;;
    esac
}

trace_bytes() {  # dir -> total bytes of its trace files
    local d=$1/trace total=0 f s
    for f in "$d"/kineto.json.gz "$d"/et.json.gz "$d"/meta.json; do
        [ -f "$f" ] && s=$(stat -c %s "$f") && total=$((total + s))
    done
    echo "$total"
}

record() {  # device name
    local device=$1 name=$2 dest level args rc t0 t1 bytes
    if [ "$device" = cuda ]; then dest=$SAMPLES/$name; else dest=$SAMPLES/cpu/$name; fi
    for level in 0 1; do
        args=$(shrink_args "$name" "$level")
        [ "$args" = STOP ] && return 0
        local spec script
        spec=$(workload "$name")
        script=${spec%% *}
        [ "$spec" != "$script" ] && args="${spec#* } $args"
        local left=$((TOTAL_BUDGET - ($(date +%s) - START)))
        if [ "$left" -lt 15 ]; then
            log "!! [$device] $name skipped: the ${TOTAL_BUDGET}s budget is spent"
            printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$device" "$name" "skipped" "0" "0" "$args" >>"$SUMMARY"
            return 0
        fi
        local run_timeout=$(( left < RUN_TIMEOUT ? left : RUN_TIMEOUT ))
        rm -rf "$dest"
        mkdir -p "$dest"
        log ""
        log "== [$device] $name ${args:+(-- $args)}"
        t0=$(date +%s.%N)
        # shellcheck disable=SC2086
        timeout --kill-after=10 "$run_timeout" \
            $PY -m advisor profile "examples/$script.py" --out "$dest" --device "$device" -- $args \
            >>"$LOG" 2>&1 </dev/null
        rc=$?
        t1=$(date +%s.%N)
        bytes=$(trace_bytes "$dest")
        local secs
        secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
            log "!! [$device] $name timed out after ${run_timeout}s"
        fi
        log "-- [$device] $name rc=$rc ${secs}s trace $(awk -v b="$bytes" 'BEGIN{printf "%.2f", b/1048576}') MB"
        for f in "$dest"/trace/*; do [ -f "$f" ] && log "     $(basename "$f") $(stat -c %s "$f") B"; done
        printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$device" "$name" "$rc" "$secs" "$bytes" "$args" >>"$SUMMARY"
        if [ "$bytes" -le "$LIMIT_BYTES" ]; then
            return 0
        fi
        if [ "$(shrink_args "$name" $((level + 1)))" = STOP ]; then
            log "!! [$device] $name trace is $bytes B, over the ${LIMIT_BYTES} B limit even when shrunk; kept"
            return 0
        fi
        log ".. [$device] $name trace is $bytes B, over ${LIMIT_BYTES} B: recording it again, smaller"
    done
}

for device in $DEVICES; do
    if [ "$device" = cuda ] && ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        log "!! no CUDA device visible: skipping the cuda half"
        continue
    fi
    for name in $WORKLOADS; do
        record "$device" "$name"
    done
done
log ""
log "== done in $(( $(date +%s) - START ))s"
log "== summary (device, name, rc, seconds, bytes, args):"
column -t -s $'\t' "$SUMMARY" 2>/dev/null | tee -a "$LOG" || cat "$SUMMARY" | tee -a "$LOG"

tar -C "$STAGE" -czf "$OUT/samples.tar.gz" sample_traces
cp "$LOG" "$SUMMARY" "$OUT/"
log "== wrote $OUT/samples.tar.gz ($(stat -c %s "$OUT/samples.tar.gz") B)"
cp "$LOG" "$OUT/record.log"
rm -rf "$STAGE"
