#!/usr/bin/env bash
# Builds the GPU test payload: vLLM 0.26.0 (the release built for the GPU machine's torch 2.11 + CUDA 13),
# trimmed to what a Mamba2 model needs on an sm_90 (H100/H200) GPU, the Python packages that machine lacks,
# and the mamba-ssm / causal-conv1d source packages. The whole folder stays under 64 MiB.
# Usage (from the project root): PYTHON=.venv/bin/python scripts/gpu/make-payload.sh [OUT_DIR]
# (default .gpu; add it to .git/info/exclude). PYTHON must import torch, setuptools, wheel, packaging and ninja.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DEST=${1:-.gpu}
VLLM=${VLLM_VERSION:-0.26.0}
mkdir -p "$DEST/deps"; DEST=$(cd "$DEST" && pwd)
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
PIP="python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp"
for n in 17 24 26 27 28 31; do PIP="$PIP --platform manylinux_2_${n}_x86_64"; done
PIP="$PIP --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any"

echo "== vLLM $VLLM wheel"
$PIP -q -d "$WORK" "vllm==$VLLM"
mkdir "$WORK/v" && (cd "$WORK/v" && unzip -q "$WORK"/vllm-*.whl)
V="$WORK/v/vllm"
# Kernels a pure Mamba2 model never loads: other attention/MoE/quant libraries and other Pythons' builds.
rm -rf "$V/vllm-rs" "$V/third_party/deep_gemm" "$V/third_party/fmha_sm100" "$V/third_party/tml_fa4" \
       "$V"/_moe_C*.so "$V"/_flashmla*.so "$V"/_qutlass_C*.so "$V/vllm_flash_attn/_vllm_fa2_C.abi3.so"
mv "$V/vllm_flash_attn/_vllm_fa3_C.abi3.so" "$WORK/fa3.so"   # Hopper-only already; imported at start-up on CUDA
python3 "$HERE/keep_sm_arch.py" "$V/_C_stable_libtorch.abi3.so" "$WORK/C90.so" 90 >/dev/null
rm "$V/_C_stable_libtorch.abi3.so"
xz -T0 -6 -c "$WORK/C90.so" > "$DEST/C90.so.xz"
xz -T0 -6 -c "$WORK/fa3.so" > "$DEST/fa3.so.xz"
(cd "$WORK/v" && tar cf - vllm vllm-*.dist-info | xz -T0 -9 > "$DEST/vllm-py.tar.xz")

echo "== packages vLLM imports that the GPU image lacks"
$PIP -q -d "$DEST/deps" annotated-types apache-tvm-ffi==0.1.15.post2 blake3 cachetools cbor2 distro \
  "fastapi<0.137.0,>=0.133.0" httpcore2 httpx2 jiter "llguidance<1.8.0,>=1.7.0" msgspec "openai>=2.0.0,<3" \
  openai-harmony opentelemetry-api partial-json-parser pybase64 pydantic==2.14.4 pydantic_core==2.50.5 pyzmq \
  sniffio "starlette>=1.0.1" truststore typing-inspection "xgrammar<1.0.0,>=0.2.1" \
  uvicorn python-multipart prometheus-fastapi-instrumentator \
  watchfiles model-hosting-container-standards jmespath supervisor setproctitle   # the OpenAI server's imports

echo "== kernel source packages"
PY=${PYTHON:-python3}   # needs torch, setuptools, wheel, packaging and ninja importable: the kernel sdists import torch to describe themselves
for p in mamba-ssm==2.3.2.post1 causal-conv1d==1.7.0; do
  MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE \
    $PY -m pip download -q --no-deps --no-binary :all: --no-build-isolation -d "$DEST" "$p" >/dev/null 2>&1 ||
    true
done
ls "$DEST"/*.tar.gz >/dev/null 2>&1 || { echo "could not download the kernel sdists" >&2; exit 1; }
cp "$HERE/device-setup.sh" "$HERE/kernel-smoke.py" "$DEST/"
du -sh "$DEST"
