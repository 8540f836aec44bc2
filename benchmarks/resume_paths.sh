#!/usr/bin/env bash
# Each resume path of the CUDA prefill on the steps a server makes: for every model and workload, N prefill steps
# of vLLM's scheduler (schedule_steps.py --layouts), one mixer layer per forced path (prefill_layer.py --paths:
# rows plugin/<path>, each path's outputs compared from identical pools), with bf16 and fp32 SSM states.
#
#   bash benchmarks/resume_paths.sh                                  # 2.7b and 3072-48-p128-g4-n128, on a GPU
#   MODELS=tiny DEVICE=cpu N=2 PYTHON=.venv/bin/python bash benchmarks/resume_paths.sh /tmp/p.jsonl  # smoke
#
# Workloads (prefix_cache.py's): chunked prefill without caching ("misses", off), and with caching on: misses,
# hits and the mixed one. With caching the block is the model's SSD chunk (256). A path is worth keeping where
# its step estimate (step_ms_estimate: layers x wall time per layer) beats the others by more than 5 %.
set -euo pipefail
OUT=${1:-resume_paths.jsonl}
MODELS=${MODELS:-2.7b,3072-48-p128-g4-n128}
N=${N:-4}
DEVICE=${DEVICE:-cuda}
PATHS=${PATHS:-auto,rerun,rows,lead-rows,correction}
HERE=$(dirname "$0")
PY=${PYTHON:-python3}
for model in ${MODELS//,/ }; do
  for run in "misses off" "misses on" "hits on" "mixed on"; do
    read -r workload caching <<<"$run"
    layouts=$($PY "$HERE/schedule_steps.py" --model "$model" --workload "$workload" --caching "$caching" \
              --layouts "$N" --quiet | tail -1)
    block=0
    [ "$caching" = on ] && block=256
    for state in bfloat16 float32; do
      echo "=== $model $workload caching=$caching states=$state"
      $PY "$HERE/prefill_layer.py" --model "$model" --device "$DEVICE" --layouts "$layouts" --block "$block" \
        --paths "$PATHS" --state-dtype "$state" --iters 10 --rows 8 --out "$OUT"
    done
  done
done
