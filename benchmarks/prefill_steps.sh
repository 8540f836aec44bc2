#!/usr/bin/env bash
# The CUDA prefill on the steps a server makes: for every model and workload, N prefill steps of vLLM's scheduler
# (schedule_steps.py --layouts) through one mixer layer (prefill_layer.py), with bf16 and fp32 SSM states.
#
#   bash benchmarks/prefill_steps.sh                                 # 2.7b and 3072-48-p128-g4-n128, on a GPU
#   MODELS=tiny DEVICE=cpu N=2 PYTHON=.venv/bin/python bash benchmarks/prefill_steps.sh /tmp/p.jsonl  # smoke
#   LAYOUTS=steps.txt bash benchmarks/prefill_steps.sh   # steps read from (or, when missing, added to) steps.txt
#   TREE=/path/to/other/checkout bash benchmarks/prefill_steps.sh   # the same steps through another checkout
#
# Workloads (prefix_cache.py's): chunked prefill without caching ("misses", off), and with caching on: misses,
# hits and the mixed one. With caching the block is the model's SSD chunk (256). Each run's steps are also
# written to OUT as {"model", "workload", "caching", "layouts", "tree"}; compare step_ms_estimate (the metadata
# build + layers x wall time per layer) only between rows of one call. LAYOUTS lets the scheduler run elsewhere
# (it needs no GPU): lines "<model> <workload> <caching> <layouts>". TREE runs that checkout's prefill_layer.py,
# which imports its own package (an A/B of two versions on identical steps).
set -euo pipefail
OUT=${1:-prefill_steps.jsonl}
MODELS=${MODELS:-2.7b,3072-48-p128-g4-n128}
WORKLOADS=${WORKLOADS:-misses:off,misses:on,hits:on,mixed:on}
N=${N:-4}
DEVICE=${DEVICE:-cuda}
STATES=${STATES:-bfloat16,float32}
ITERS=${ITERS:-10}
LAYOUTS=${LAYOUTS:-}
HERE=$(dirname "$0")
TREE=${TREE:-$HERE/..}
PY=${PYTHON:-python3}
for model in ${MODELS//,/ }; do
  for run in ${WORKLOADS//,/ }; do
    workload=${run%:*} caching=${run#*:}
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
    printf '{"model": "%s", "workload": "%s", "caching": "%s", "layouts": "%s", "tree": "%s"}\n' \
      "$model" "$workload" "$caching" "$layouts" "$TREE" >>"$OUT"
    echo "=== $model $workload caching=$caching states=$STATES tree=$TREE"
    $PY "$TREE/benchmarks/prefill_layer.py" --model "$model" --device "$DEVICE" --layouts "$layouts" \
      --block "$block" --state-dtype "$STATES" --iters "$ITERS" --rows 8 --out "$OUT"
  done
done
