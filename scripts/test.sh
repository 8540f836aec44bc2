#!/usr/bin/env bash
# The test suite on a fresh machine: set up .venv, then pytest (CPU tests; `gpu` tests skip without CUDA).
# Two pytest-xdist workers, a file each at a time (tests/conftest.py orders the files); extra arguments go to pytest
# (e.g. -k chunked, -m "not slow"; -n 0 runs in one process).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
"$ROOT/scripts/setup-venv.sh"
cd "$ROOT"
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}
exec "$ROOT/.venv/bin/python" -m pytest tests -q -rs -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder "$@"
