#!/usr/bin/env bash
# The zoo and the suite at one commit in one device call, on a machine of several GPUs: each queue of models
# runs on its own GPU (CUDA_VISIBLE_DEVICES), one model process at a time per GPU as bench/zoo.py and
# bench/suite.py always do, so every ratio is still between numbers of one process on one GPU.
#   OUT=/dir ZOO_COMMIT=abc1234 bash bench/gpu_parallel.sh
# Queues (env, comma-separated; empty skips): ZOO0, ZOO1, ZOO2 (bench/zoo.py --models), SUITE0, SUITE1
# (bench/suite.py --workloads). GPUs are handed out in that order to the queues that are set.
# TRAIN (bench/train.py --models, modes TRAIN_MODES): training steps on the last queue's GPU once that queue is
# done (the suite's queues finish in about half the zoo's time), within the same LIMIT.
# Writes $OUT/run.tar.gz (zoo<i>.{json,md}, suite<i>/bench-*.{md,json,jsonl}, logs) and $OUT/session.log.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
LIMIT=${LIMIT:-560}            # seconds for every queue (the device call's 600 less start-up and packing)
ZOO_TIMEOUT=${ZOO_TIMEOUT:-110}  # seconds per zoo model
SUITE_BUDGET=${SUITE_BUDGET:-500}
RUN=$OUT/run
mkdir -p "$RUN"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
log() { echo "== $(date -u +%T) $*" | tee -a "$OUT/session.log"; }
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
log "$gpus GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"

# Each queue gets its own share of the CPU cores (taskset) and compile threads to match: unpinned, one queue's
# torch.compile and compile workers slowed another's host-bound timing loop (session 21, two queues on one
# 32-core host: GPT-2's patched model timed 10.3, 10.1, 7.6 ms in its three rounds, 7.3 in its selection).
queues=0
for q in ZOO0 ZOO1 ZOO2 SUITE0 SUITE1; do [ -n "${!q:-}" ] && queues=$((queues + 1)); done
[ "$queues" -gt "$gpus" ] && queues=$gpus
cores=$(nproc)
per=$(( cores / (queues > 0 ? queues : 1) ))
export TORCHINDUCTOR_COMPILE_THREADS=$per FUSION_ADVISOR_COMPILE_WORKERS=$(( per < 8 ? per : 8 ))
lastq=
for q in ZOO0 ZOO1 ZOO2 SUITE0 SUITE1; do [ -n "${!q:-}" ] && lastq=$q; done
gpu=0
pids=()
for q in ZOO0 ZOO1 ZOO2 SUITE0 SUITE1; do
    list=${!q:-}
    [ -z "$list" ] && continue
    if [ "$gpu" -ge "$gpus" ]; then log "$q: no GPU left for it ($list)"; continue; fi
    cpus="$((gpu * per))-$((gpu * per + per - 1))"
    i=${q: -1}
    if [[ $q == ZOO* ]]; then
        cmd=(python3 -m bench.zoo --models "$list" --timeout "$ZOO_TIMEOUT" --out "$RUN/zoo$i")
    else
        cmd=(python3 -m bench.suite --workloads "$list" --budget "$SUITE_BUDGET" --out "$RUN/suite$i"
             --logs "$RUN/suite$i/logs")
    fi
    if [ "$q" = "$lastq" ] && [ -n "${TRAIN:-}" ]; then  # the last queue: training steps after it, same GPU
        train=(python3 -m bench.train --models "$TRAIN" --modes "${TRAIN_MODES:-eager,compile,advisor}"
               --steps 15 --rounds 5 --out "$RUN/train")
        log "TRAIN after $q on GPU $gpu: ${train[*]}"
        cmd=(bash -c "$(printf '%q ' "${cmd[@]}"); $(printf '%q ' "${train[@]}") >$(printf '%q' "$RUN/train.log") 2>&1"
             )
    fi
    log "$q on GPU $gpu, CPUs $cpus: ${cmd[*]}"
    CUDA_VISIBLE_DEVICES=$gpu taskset -c "$cpus" timeout --kill-after=10 "$LIMIT" "${cmd[@]}" >"$RUN/$q.log" 2>&1 &
    pids+=($!)
    gpu=$((gpu + 1))
done
for p in "${pids[@]}"; do wait "$p"; log "pid $p rc=$?"; done
tar -czf "$OUT/run.tar.gz" -C "$OUT" run
log "wrote $OUT/run.tar.gz ($(du -h "$OUT/run.tar.gz" | cut -f1))"
