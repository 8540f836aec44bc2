#!/usr/bin/env bash
# Each resume path of the CUDA prefill on the steps a server makes: for every model and workload, N prefill steps
# of vLLM's scheduler (schedule_steps.py --layouts), one mixer layer per forced path (prefill_layer.py --paths:
# rows plugin/<path>, each path's outputs compared from identical pools), with bf16 and fp32 SSM states.
#
#   bash benchmarks/resume_paths.sh                                  # 2.7b and 3072-48-p128-g4-n128, on a GPU
#   MODELS=tiny DEVICE=cpu N=2 PYTHON=.venv/bin/python bash benchmarks/resume_paths.sh /tmp/p.jsonl  # smoke
#   LAYOUTS=steps.txt bash benchmarks/resume_paths.sh   # steps read from (or, when missing, added to) steps.txt
#
# Workloads (prefix_cache.py's): chunked prefill without caching ("misses", off), and with caching on: misses,
# hits and the mixed one. With caching the block is the model's SSD chunk (256). Each run's steps are also
# written to OUT as {"model", "workload", "caching", "layouts"}. A path is worth keeping where its step estimate
# (step_ms_estimate: the metadata build + layers x wall time per layer) beats the others by more than 5 %.
# LAYOUTS lets the scheduler run elsewhere (it needs no GPU): lines "<model> <workload> <caching> <layouts>".
set -euo pipefail
OUT=${1:-resume_paths.jsonl}
MODELS=${MODELS:-2.7b,3072-48-p128-g4-n128}
N=${N:-4}
DEVICE=${DEVICE:-cuda}
PATHS=${PATHS:-auto,rerun,rows,lead-rows,correction}
STATES=${STATES:-bfloat16,float32}
LAYOUTS=${LAYOUTS:-}
HERE=$(dirname "$0")
PY=${PYTHON:-python3}
for model in ${MODELS//,/ }; do
  for run in "misses off" "misses on" "hits on" "mixed on"; do
    read -r workload caching <<<"$run"
    layouts=""
    if [ -n "$LAYOUTS" ] && [ -f "$LAYOUTS" ]; then
      layouts=$(awk -v m="$model" -v w="$workload" -v c="$caching" '$1==m && $2==w && $3==c {print $4}' "$LAYOUTS")
    fi
    if [ -z "$layouts" ]; then
      layouts=$($PY "$HERE/schedule_steps.py" --model "$model" --workload "$workload" --caching "$caching" \
                --layouts "$N" --quiet | tail -1)
      [ -n "$LAYOUTS" ] && echo "$model $workload $caching $layouts" >>"$LAYOUTS"
    fi
    block=0
    [ "$caching" = on ] && block=256
    printf '{"model": "%s", "workload": "%s", "caching": "%s", "layouts": "%s"}\n' \
      "$model" "$workload" "$caching" "$layouts" >>"$OUT"
    echo "=== $model $workload caching=$caching states=$STATES"
    $PY "$HERE/prefill_layer.py" --model "$model" --device "$DEVICE" --layouts "$layouts" --block "$block" \
      --paths "$PATHS" --state-dtype "$STATES" --iters 10 --rows 8 --out "$OUT"
  done
done
