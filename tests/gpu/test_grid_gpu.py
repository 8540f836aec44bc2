"""The model grid on CUDA (vLLM 0.26): every grid model in every mode, greedy against the float64 recurrence.

Each (model, mode) engine serves ``GRID_PROMPTS`` prompts twice, shuffled, some with ``n = 2`` (grid.serve_twice),
under chunked prefill (a 256-token budget, 8 sequences), so prompts are cut, resumed and packed with others as a
server packs them. Modes: "full" (the default: FULL CUDA graphs for decode-only steps, piecewise for mixed ones),
"piecewise" (VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS=0) and "eager". Skipped without CUDA (conftest).
"""

import os
import subprocess
import sys

import pytest

from conftest import make_llm
from grid import divergences, grid_prompts, serve_twice
from vllm_mamba2_plugin import tiny_model

pytestmark = pytest.mark.gpu
MAX_TOKENS = 24
GRID_PROMPTS = int(os.environ.get("MAMBA2_GRID_PROMPTS", "48"))
MODES = {
    "full": dict(enforce_eager=False, compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]}),
    "piecewise": dict(enforce_eager=False, compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]}),
    "eager": dict(enforce_eager=True),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(tiny_model.GRID))
def test_grid_model_greedy_matches_recurrence(name, mode, grid_dirs, grid_oracles, monkeypatch):
    monkeypatch.setenv("VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS", "0" if mode == "piecewise" else "1")
    spec = tiny_model.GRID[name]
    prompts = grid_prompts(spec.vocab_size, spec.chunk_size, GRID_PROMPTS, seed=spec.seed)
    llm = make_llm(grid_dirs[name], max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
                   **MODES[mode])
    got_prompts, got = serve_twice(llm, prompts, MAX_TOKENS, spec.seed)
    wrong, ties = divergences(grid_oracles[name], got_prompts, got, MAX_TOKENS)
    print(f"grid {name} {mode}: {len(got)} outputs, {len(wrong)} wrong, {ties} near-ties")
    assert not wrong, f"{len(wrong)} of {len(got)} (prompt length, position, margin, got, want): {wrong[:10]}"


def test_engine_loads_after_cpu_torch_work(grid_dirs):
    """A process that ran CPU torch work (its OpenMP threads up) before ``LLM(...)``: vLLM forks the engine core
    (CUDA is not initialised yet), and the model must still load and generate."""
    script = (
        "import torch\n"
        "a = torch.randn(2048, 2048, dtype=torch.float64); (a @ a).sum().item()\n"
        "from vllm import LLM, SamplingParams\n"
        f"llm = LLM(model={grid_dirs['n32g4']!r}, dtype='float32', enforce_eager=True, max_num_seqs=4, "
        "max_num_batched_tokens=128, max_model_len=512, skip_tokenizer_init=True, gpu_memory_utilization=0.04)\n"
        "out = llm.generate([{'prompt_token_ids': [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True))\n"
        "print('GENERATED', list(out[0].outputs[0].token_ids))\n"
    )
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0 and "GENERATED" in proc.stdout, proc.stderr[-3000:]
