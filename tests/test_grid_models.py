"""The model grid on the CPU (the reference kernels): every grid model served under continuous batching and
chunked prefill, greedy against the float64 recurrence. The same check runs on CUDA in every graph mode
(tests/gpu/test_grid_gpu.py); the OpenAI server runs it too (tests/scripts/test_serve_load.py)."""

import pytest

from conftest import engine
from grid import divergences, grid_prompts, serve_twice

from vllm_mamba2_plugin import tiny_model

MAX_TOKENS = 12


@pytest.mark.parametrize("name", list(tiny_model.GRID))
def test_grid_model_greedy_matches_recurrence(name, grid_dirs, grid_oracles):
    spec = tiny_model.GRID[name]
    prompts = grid_prompts(spec.vocab_size, spec.chunk_size, 12, seed=spec.seed, max_len=300)
    # A 96-token budget cuts most prompts into several chunks, resumed from their saved states.
    llm = engine(grid_dirs[name], max_num_seqs=6, max_num_batched_tokens=96, max_model_len=512)
    got_prompts, got = serve_twice(llm, prompts, MAX_TOKENS, spec.seed)
    wrong, ties = divergences(grid_oracles[name], got_prompts, got, MAX_TOKENS)
    assert not wrong, f"{len(wrong)} of {len(got)} (prompt length, position, margin, got, want): {wrong[:10]}"


def test_grid_checkpoints_do_not_depend_on_the_cpu_that_builds_them():
    """float32 log rounds differently per CPU vector unit (AVX2 / AVX-512): A_log is rounded from float64, so a grid
    checkpoint built on another machine has the same bytes, and the oracle answers cached for it still match."""
    import torch

    for name, spec in tiny_model.GRID.items():
        want = torch.log(torch.arange(1, spec.num_heads + 1, dtype=torch.float64)).float()
        assert torch.equal(tiny_model.wide_weights(spec)["backbone.layers.0.mixer.A_log"], want), name
