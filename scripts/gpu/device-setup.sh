#!/usr/bin/env bash
# Runs ON the GPU machine, from the project root, with the payload carried at $PAYLOAD (default .gpu).
# Installs vLLM + its missing packages into $SITE (default /tmp/site), then builds the two kernel packages
# for sm_90 only: mamba-ssm as pure Python (its Triton Mamba2 kernels need no build; a stand-in module
# takes the place of the Mamba1 selective-scan extension, which Mamba2 never calls) and causal-conv1d's
# CUDA extension forward-only (inference needs no backward). After it: export PYTHONPATH=$SITE
#
# The causal-conv1d build (~50 s) is reused across calls: after building, it leaves
# $OUT/causal_conv1d-sm90.tar.gz (the installed package, ~MBs); copy that file into the payload folder (.gpu/) and later calls unpack it instead of building.
set -euo pipefail
PAYLOAD=$(cd "${PAYLOAD:-.gpu}" && pwd); SITE=${SITE:-/tmp/site}; JOBS=${MAX_JOBS:-16}
mkdir -p "$SITE"
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$PAYLOAD"/deps/*.whl 2>&1 | grep -v "^WARNING" || true
tar xJf "$PAYLOAD/vllm-py.tar.xz" -C "$SITE"
xz -dc "$PAYLOAD/C90.so.xz" > "$SITE/vllm/_C_stable_libtorch.abi3.so"
xz -dc "$PAYLOAD/fa3.so.xz" > "$SITE/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
echo "vllm installed in $(( $(date +%s)-t0 ))s"

B=$(mktemp -d); cd "$B"
for t in "$PAYLOAD"/*.tar.gz; do tar xzf "$t"; done
python3 - <<'PY'
import glob, re
for setup in glob.glob("*/setup.py"):
    s = open(setup).read()
    s = s.replace("    # HACK: The compiler flag",
        "    cc_flag = [f for f in cc_flag if f != '-gencode' and not f.startswith('arch=')]"
        " + ['-gencode', 'arch=compute_90,code=sm_90']\n    # HACK: The compiler flag", 1)
    s = s.replace('"csrc/causal_conv1d_bwd.cu",', "")
    open(setup, "w").write(s)
for cpp in glob.glob("causal_conv1d-*/csrc/causal_conv1d.cpp"):
    s = open(cpp).read()
    for fn in ("causal_conv1d_bwd_cuda", "causal_conv1d_channellast_bwd_cuda"):
        s = s.replace(f"void {fn}(ConvParamsBwd &params, cudaStream_t stream);",
                      f"void {fn}(ConvParamsBwd &params, cudaStream_t stream) "
                      '{ TORCH_CHECK(false, "causal_conv1d backward is not built here"); }')
    open(cpp, "w").write(s)
PY
(cd mamba_ssm-* && MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE python3 -m pip install -q --no-deps --no-build-isolation --target "$SITE" . >/dev/null 2>&1)
cat > "$SITE/selective_scan_cuda.py" <<'PY'
"""Stand-in for mamba-ssm's Mamba1 selective-scan extension, which this test machine does not build."""
def __getattr__(name):
    raise RuntimeError("selective_scan_cuda (Mamba1 kernels) is not built on this machine")
PY
t1=$(date +%s)
if [ -f "$PAYLOAD/causal_conv1d-sm90.tar.gz" ]; then
  tar xzf "$PAYLOAD/causal_conv1d-sm90.tar.gz" -C "$SITE"
  echo "causal-conv1d unpacked from the payload's prebuilt copy in $(( $(date +%s)-t1 ))s"
else
  (cd causal_conv1d-* && CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS=$JOBS python3 -m pip install -q --no-deps --no-build-isolation --target "$SITE" . > "$B/causal_conv1d-build.log" 2>&1) \
    || { tail -30 "$B/causal_conv1d-build.log"; exit 1; }
  echo "causal-conv1d built in $(( $(date +%s)-t1 ))s"
  if [ -n "${OUT:-}" ]; then
    (cd "$SITE" && tar czf "$OUT/causal_conv1d-sm90.tar.gz" causal_conv1d causal_conv1d_cuda*.so causal_conv1d-*.dist-info 2>/dev/null) \
      && echo "prebuilt causal-conv1d saved to \$OUT/causal_conv1d-sm90.tar.gz ($(du -h "$OUT/causal_conv1d-sm90.tar.gz" | cut -f1))"
  fi
fi
PYTHONPATH="$SITE" python3 -c "import vllm, mamba_ssm, causal_conv1d, torch; print('ready: vllm', vllm.__version__, '| mamba_ssm', mamba_ssm.__version__, '| causal_conv1d', causal_conv1d.__version__, '| torch', torch.__version__, '|', torch.cuda.get_device_name())"
