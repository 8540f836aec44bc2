#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv, build the embedded default model (a small random Mamba2
# checkpoint + tokenizer, deterministic), and serve it through vLLM + the plugin: prints text and tokens/s.
# Extra arguments go to examples/offline_generate.py (e.g. --model /path/to/hf/mamba2 --max-tokens 128).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
"$ROOT/scripts/setup-venv.sh"
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}
exec "$ROOT/.venv/bin/python" "$ROOT/examples/offline_generate.py" "$@"
