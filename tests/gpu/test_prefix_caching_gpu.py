"""Prefix caching on CUDA (vLLM 0.26 on the H200) with CUDA graphs: the upstream kernels' boundary states,
vLLM's runner copies between blocks outside the graphs, and the decode graphs' slot buffer following each
request's running block. The eager cases are tests/test_prefix_caching.py, which runs on the GPU as it is.
Skipped without CUDA (conftest)."""

import pytest

from conftest import make_llm, random_prompts
from test_prefix_caching import _assert_exact, _generate, _shared_prefix_prompts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("full_graphs", ["1", "0"], ids=["full-decode-graphs", "piecewise"])
def test_shared_prefixes_with_cuda_graphs_stay_exact(full_graphs, model_dirs, oracles, monkeypatch):
    """g8_bias (blocks of 4 tokens): a system prompt of 2.5 blocks, prefilled in budget-cut chunks; the same prompts
    again (hits), then each conversation's next turn (hits on blocks completed in decode, inside the graphs)."""
    monkeypatch.setenv("VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS", full_graphs)
    variant = "g8_bias"
    llm = make_llm(model_dirs[variant], enable_prefix_caching=True, max_num_batched_tokens=64, max_num_seqs=16,
                   enforce_eager=False, compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16]})
    assert ("FULL" in str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)) == (full_graphs == "1")
    bs = llm.llm_engine.vllm_config.cache_config.block_size
    system_len = 2 * bs + bs // 2
    prompts = _shared_prefix_prompts(system_len, [3, 1, 2 * bs + 1, bs, 7, 2], 500, seed=41)
    oracle = oracles[variant]

    tokens, cached = _generate(llm, prompts[:1])
    _assert_exact(oracle, prompts[:1], tokens)
    tokens, cached = _generate(llm, prompts[::-1])
    _assert_exact(oracle, prompts[::-1], tokens)
    assert all(c >= system_len // bs * bs for c in cached), cached

    turns = [p + t for p, t in zip(prompts, tokens[::-1])]
    more = [t + s for t, s in zip(turns, random_prompts([5] * len(turns), 500, seed=43))]
    tokens, cached = _generate(llm, more)
    _assert_exact(oracle, more, tokens)
    assert cached == [(len(t) - 1) // bs * bs for t in turns], cached


def test_many_requests_through_few_slots_with_cache_hits(model_dirs, oracles, monkeypatch):
    """FULL decode graphs, 48 requests over 8 slots sharing a prefix of 1.25 blocks (g1: blocks of 8), three rounds:
    slots reused by requests that start from cached states."""
    monkeypatch.setenv("VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS", "1")
    variant = "g1"
    llm = make_llm(model_dirs[variant], enable_prefix_caching=True, max_num_batched_tokens=32, max_num_seqs=8,
                   enforce_eager=False, compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]})
    prompts = _shared_prefix_prompts(10, [1 + i % 9 for i in range(48)], 500, seed=47)
    for _ in range(3):
        tokens, cached = _generate(llm, prompts)
        _assert_exact(oracles[variant], prompts, tokens)
    assert min(cached) >= 8, cached
