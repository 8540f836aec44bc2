#!/usr/bin/env bash
# The SSD wrappers' tests (tests/kernels/cuda/test_ssd_prefill.py, "fake" backend) against mamba-ssm's real Triton
# SSD kernels, run by Triton's interpreter on the CPU (tests/kernels/cuda/interpret_ssd.py): no GPU needed. 16-bit
# inputs go through the kernels in float32 (numpy has no bfloat16), so the kernels' own bf16 roundings are not
# exercised. Slow, so not part of CI: the boundary-state tests ~7 minutes on 2 cores, the whole file ~17.
#
#   bash scripts/interpret-ssd-tests.sh ["PYTEST -k EXPRESSION"] [TEST FILE ...]
#
# The expression selects among the "fake" tests (default: "boundary or cache_hits"; "ssd": all) of the files
# (default tests/kernels/cuda/test_ssd_prefill.py; test_serving_steps.py runs whole layers). MAMBA_SSM_SDIST:
# mamba-ssm's source package (default .gpu/mamba_ssm-2.3.2.post1.tar.gz, which scripts/gpu/make-payload.sh fetches).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SDIST=${MAMBA_SSM_SDIST:-$ROOT/.gpu/mamba_ssm-2.3.2.post1.tar.gz}
EXPR=${1:-boundary or cache_hits}
shift || true
FILES=("${@:-tests/kernels/cuda/test_ssd_prefill.py}")
[ -f "$SDIST" ] || { echo "no mamba-ssm source package at $SDIST (set MAMBA_SSM_SDIST)" >&2; exit 2; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
tar xzf "$SDIST" -C "$WORK"
SRC=$(echo "$WORK"/mamba_ssm-*/mamba_ssm)
# Only the Triton ops are needed: a package of them, without mamba_ssm/__init__.py (it imports the CUDA extension).
mkdir -p "$WORK/stub/mamba_ssm"
echo '__version__ = "interpreted"' > "$WORK/stub/mamba_ssm/__init__.py"
ln -s "$SRC/ops" "$WORK/stub/mamba_ssm/ops"
ln -s "$SRC/utils" "$WORK/stub/mamba_ssm/utils"
cd "$ROOT"
# MAMBA_DETERMINISTIC=1: one config per kernel, no autotuning (the autotuner benchmarks on a device).
MAMBA_DETERMINISTIC=1 TRITON_INTERPRET=1 PYTHONPATH="$WORK/stub:$ROOT/tests/kernels/cuda" \
  "$ROOT/.venv/bin/python" -m pytest "${FILES[@]}" -q -p no:cacheprovider -p interpret_ssd \
  -k "fake and ($EXPR)"
