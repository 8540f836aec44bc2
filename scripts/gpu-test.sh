#!/usr/bin/env bash
# Runs ON the GPU machine, from the repository root, with the payload carried at .gpu/
# (built on the CPU machine by: PYTHON=.venv/bin/python scripts/gpu/make-payload.sh .gpu).
#
#   bash scripts/gpu-test.sh                       # default step: the gpu-marked tests
#   bash scripts/gpu-test.sh "python3 -m pytest -m gpu tests/kernels -q -rs" "python3 examples/x.py"
#   GPU_BENCH=1 GPU_BENCH_ARGS="..." bash scripts/gpu-test.sh   # + benchmarks/throughput.py, if present
#
# Planning (H200, 10-minute calls; a call costs its wall time plus ~60-90 s of start-up and transfers):
# setup 45-70 s (110 s when causal-conv1d is built). Triton compiles dominate on a fresh machine (nothing is cached):
# with MAMBA_DETERMINISTIC=1 every new (dtype, shape family) of the SSD kernels costs ~100-150 s of compiles, so
# tests/kernels cannot run in one call cold: split it by file (test_norm + the boundary-state cases of
# test_ssd_prefill + test_end_to_end + test_serving_steps + test_triton_launch: ~390 s; test_ssd_prefill + test_conv
# + test_warmup: ~135 s after a server run compiled the same kernels). tests/gpu: ~380 s for the prefix-caching
# file and the first six engine tests, a bf16 engine ~120 s of it; the in-tree test compiles vLLM's own kernels in a
# subprocess (give it a call's remainder of >= 200 s). scripts/serve_load.py with the tiny serving model: 180-240 s
# of server start-up cold (~80 s with a carried triton-autotune.tgz and warm compiles) plus ~10 s of load -- give it
# `timeout` >= 300; a throughput.py cell pair 250-400 s. Run fp32 engine tests with MAMBA_DETERMINISTIC=1:
# otherwise every warm-up layout is autotuned and one engine test can take minutes.
#
# Logs go to $OUT (what the device tool brings back; at most 8 files come back) or /tmp/gpu-out:
#   setup.log (device setup + project install), env.log (nvidia-smi, versions), one log per step
#   (gpu-tests.log for the default, else step<N>.log), bench.log, summary.txt.
# A failing step does not stop the next one; the script exits non-zero if any step failed.
# Setup uses the project's copy scripts/gpu/device-setup.sh: the first call also returns
# causal_conv1d-sm90.tar.gz under $OUT; copy it into .gpu/ and later calls skip the ~50 s kernel build.
# Triton autotuning of the SSD kernels costs ~10 s per new (shape, dtype) on a cold cache (bf16; fp32 with IEEE
# products far more: benchmarks/RESULTS.md, Exactness); MAMBA_DETERMINISTIC=1 makes mamba-ssm use one fixed
# config per kernel -- but only where TRITON_CACHE_AUTOTUNING is not "1": with it (as below, and as vLLM itself
# sets it when unset: vllm/env_override.py) mamba-ssm autotunes every config and caches the result. So a step
# that wants fixed configs runs with TRITON_CACHE_AUTOTUNING=0 (run_step does it; unsetting is not enough).
# Autotuning results persist: TRITON_CACHE_AUTOTUNING=1 stores each kernel's timings in Triton's cache, and after
# every step the script packs them into $OUT/triton-autotune.tgz (kilobytes). Copy that file into .gpu/ and the
# next call starts with them. scripts/gpu/triton-autotune.tgz is the committed copy (101 kernels: the benchmark
# shapes, a decode-grid shape, prefix-cache steps, the serving harness's model and grid-model layouts): refresh
# it when a call returns more. (Same configs as a fresh autotune would choose; start-up times of runs with a carried file are not
# comparable with cold ones.)
set -euo pipefail
LOG=${OUT:-/tmp/gpu-out}
mkdir -p "$LOG"
T0=$(date +%s)
export GPU_TEST_T0=$T0  # steps can budget their time against the call's limit: $(( $(date +%s) - GPU_TEST_T0 ))

PAYLOAD=.gpu bash scripts/gpu/device-setup.sh 2>&1 | tee "$LOG/setup.log"
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 MAMBA2_TESTS_INSTAFAIL=1
export TRITON_CACHE_AUTOTUNING=1
# vLLM's torch.compile cache redirects TRITON_CACHE_DIR into a per-config-hash directory under ~/.cache/vllm
# (vllm/compilation/compiler_interface.py:463-480, v0.26) as soon as a model is compiled, so in CUDA-graph runs the
# autotuning timings would not reach the Triton cache saved below. Disabling that cache keeps Triton's own
# directory; on a fresh machine nothing is cached anyway, so it costs no compile time.
export VLLM_DISABLE_COMPILE_CACHE=${VLLM_DISABLE_COMPILE_CACHE:-1}
# Exported, not only used here: torch's Inductor sets TRITON_CACHE_DIR to its own directory when it is unset
# (torch/_inductor/runtime/triton_heuristics.py: `if os.getenv("TRITON_CACHE_DIR") is None: os.environ[...] =
# triton_cache_dir(...)`), and from then on every Triton kernel of that process -- mamba-ssm's and vLLM's SSD
# kernels too -- keeps its autotuning there, and graph-mode engines (compiled by Inductor) would not save their
# autotuning into the directory packed below.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
TRITON_CACHE=$TRITON_CACHE_DIR
mkdir -p "$TRITON_CACHE"
# The newest tunings: a .gpu/ copy (returned by an earlier call), else the committed one (a fresh checkout has
# no .gpu/ tunings).
TUNINGS=.gpu/triton-autotune.tgz
[ -f "$TUNINGS" ] || TUNINGS=scripts/gpu/triton-autotune.tgz
if [ -f "$TUNINGS" ]; then
  tar xzf "$TUNINGS" -C "$TRITON_CACHE"
  echo "autotuning results restored from $TUNINGS: $(tar tzf "$TUNINGS" | grep -c autotune.json) kernels" |
    tee -a "$LOG/setup.log"
fi
save_autotune() {  # the autotuning timings only (the compiled kernels are large and quick to rebuild)
  (cd "$TRITON_CACHE" && find . -name '*.autotune.json' | tar czf "$LOG/triton-autotune.tgz" -T -) || true
}
python3 -m pip install -q --no-deps --no-build-isolation --upgrade --target /tmp/site . 2>&1 | tee -a "$LOG/setup.log"

{
  nvidia-smi || true
  python3 - <<'PY' || true
import torch, triton
print("torch", torch.__version__, "| cuda", torch.version.cuda, "| triton", triton.__version__,
      "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA")
for m in ("vllm", "mamba_ssm", "causal_conv1d", "vllm_mamba2_plugin"):
    try:
        mod = __import__(m)
        print(m, getattr(mod, "__version__", "?"), mod.__file__)
    except Exception as e:  # report, do not stop
        print(m, "IMPORT FAILED:", repr(e))
PY
} > "$LOG/env.log" 2>&1
echo "setup done in $(( $(date +%s) - T0 ))s" | tee "$LOG/summary.txt"

if [ "$#" -gt 0 ]; then
  STEPS=("$@")
else
  # -v and --timeout (pytest-timeout is on the GPU image): a hung test dumps its stack and the run goes on,
  # instead of the whole step being killed with its captured output.
  STEPS=("python3 -m pytest -m gpu tests -v -rs --timeout 180 -p no:cacheprovider")
fi
if [ "${#STEPS[@]}" -gt 4 ]; then
  echo "warning: ${#STEPS[@]} steps -> more than 8 log files; only 8 come back from the device" | tee -a "$LOG/summary.txt"
fi

FAILED=0
run_step() {  # run_step <log file> <command>
  local log=$1 cmd=$2 t rc
  t=$(date +%s)
  # mamba-ssm's MAMBA_DETERMINISTIC=1 (one fixed config per kernel, no autotuning) is switched back to FULL
  # autotuning by TRITON_CACHE_AUTOTUNING=1 (mamba_ssm/utils/determinism.py:66): measured on the H200, one
  # kernel test then took 52 s instead of ~1 s (fp32 warm-ups: benchmarks/RESULTS.md, Exactness).
  # Steps that ask for determinism get "0": unset, vLLM's import sets it back to "1" in every process.
  if [[ "${MAMBA_DETERMINISTIC:-}" == 1* || "$cmd" == *MAMBA_DETERMINISTIC=1* ]]; then cmd="export TRITON_CACHE_AUTOTUNING=0; $cmd"; fi
  echo "=== $cmd" | tee -a "$LOG/summary.txt"
  set +e
  bash -c "$cmd" 2>&1 | tee "$LOG/$log"
  rc=${PIPESTATUS[0]}
  set -e
  echo "    rc=$rc in $(( $(date +%s) - t ))s -> $log" | tee -a "$LOG/summary.txt"
  save_autotune
  if [ "$rc" -ne 0 ]; then FAILED=$((FAILED + 1)); fi
}

for i in "${!STEPS[@]}"; do
  if [ "$#" -eq 0 ]; then name=gpu-tests.log; else name="step$((i + 1)).log"; fi
  run_step "$name" "${STEPS[$i]}"
done

if [ "${GPU_BENCH:-0}" = "1" ]; then
  if [ -f benchmarks/throughput.py ]; then
    run_step bench.log "python3 benchmarks/throughput.py ${GPU_BENCH_ARGS:-}"
  else
    echo "GPU_BENCH=1 but benchmarks/throughput.py does not exist: skipped" | tee -a "$LOG/summary.txt"
  fi
fi

echo "total $(( $(date +%s) - T0 ))s, $FAILED failed step(s)" | tee -a "$LOG/summary.txt"
[ "$FAILED" -eq 0 ]
