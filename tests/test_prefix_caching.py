"""Prefix caching of Mamba2 state (docs/prefix-caching.md) on the CPU: a state per block boundary, reused exactly.

Every greedy token is compared with the float64 recurrence (tests/oracle.py), with and without cache hits; the
hit lengths are checked against the ideal (the deepest block boundary a request can start from), so a cache that
silently misses fails as well as one that resumes from a wrong state.
"""

import pytest

from conftest import make_llm, random_prompts

MAX_TOKENS = 6


def _generate(llm, prompts):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


def _assert_exact(oracle, prompts, tokens):
    for p, got in zip(prompts, tokens):
        want = oracle.generate(p, MAX_TOKENS)[0]
        assert got == want, f"prompt of {len(p)} tokens: {got} != oracle {want}"


def _shared_prefix_prompts(system_len, suffixes, vocab, seed):
    system = random_prompts([system_len], vocab, seed)[0]
    return [system + s for s in random_prompts(suffixes, vocab, seed + 1)]


@pytest.mark.parametrize("variant, budget", [("g1", 16), ("g8_bias", 64)])
def test_shared_prefixes_hit_at_every_block_boundary_and_stay_exact(variant, budget, model_dirs, oracles,
                                                                    monkeypatch):
    """Prompts sharing a system prompt of 2.5 blocks (g8_bias: blocks of 4 tokens, conv width 3, a dt limit),
    prefilled in chunks cut by the token budget; then the same prompts again in another order, and longer
    prompts that extend earlier ones (a conversation's next turn, reaching past blocks cached during decode).
    The first request computes every block; each later one starts from its deepest cached boundary. The runner's
    block moves go through the plugin's batched form (patches.py, patch 3)."""
    from vllm_mamba2_plugin.state_copy import PoolLayout

    moves = []
    fill = PoolLayout.fill
    monkeypatch.setattr(PoolLayout, "fill", lambda self, *a: moves.append(a[2:]) or fill(self, *a))
    llm = make_llm(model_dirs[variant], enable_prefix_caching=True, max_num_batched_tokens=budget)
    bs = llm.llm_engine.vllm_config.cache_config.block_size
    assert bs == llm.llm_engine.vllm_config.model_config.hf_config.chunk_size  # the default: one SSD chunk
    system_len = 2 * bs + bs // 2
    prompts = _shared_prefix_prompts(system_len, [3, 1, 2 * bs + 1, bs], 500, seed=5)

    tokens, cached = _generate(llm, prompts[:1])
    _assert_exact(oracles[variant], prompts[:1], tokens)
    assert cached == [0]
    tokens, cached = _generate(llm, prompts[::-1])
    _assert_exact(oracles[variant], prompts[::-1], tokens)
    own = {len(prompts[0]): (len(prompts[0]) - 1) // bs * bs}  # its own earlier run
    for p, c in zip(prompts[::-1], cached):
        assert c >= (system_len // bs) * bs, (len(p), c)  # at least the shared blocks
        assert c == own.get(len(p), c) and c % bs == 0 and c < len(p)

    turns = [p + t for p, t in zip(prompts, tokens[::-1])]  # prompt + its answer: blocks completed in decode
    more = [t + s for t, s in zip(turns, random_prompts([5] * len(turns), 500, seed=7))]
    tokens, cached = _generate(llm, more)
    _assert_exact(oracles[variant], more, tokens)
    # The previous run fed its prompt and all but its last generated token: blocks within those are cached.
    assert cached == [(len(t) - 1) // bs * bs for t in turns], cached
    assert moves, "the runner moved no state through the plugin's batched block moves"


def test_a_prefix_shorter_than_two_blocks_is_reused(model_dirs, oracles):
    """A shared prefix of one block and a few tokens: one block of hit, exact."""
    llm = make_llm(model_dirs["g1"], enable_prefix_caching=True, max_num_batched_tokens=16)
    bs = llm.llm_engine.vllm_config.cache_config.block_size
    prompts = _shared_prefix_prompts(bs + 3, [4, 9], 500, seed=11)
    _generate(llm, prompts[:1])
    tokens, cached = _generate(llm, prompts[1:])
    _assert_exact(oracles["g1"], prompts[1:], tokens)
    assert cached == [bs]


def test_identical_prompts_in_one_batch_and_after_eviction(model_dirs, oracles):
    """Identical prompts in one step (a block hashed in this step is no hit for its neighbour until computed),
    then enough other prompts to evict the cached blocks from a small pool, then the first prompts again."""
    llm = make_llm(model_dirs["g1"], enable_prefix_caching=True, max_num_batched_tokens=32,
                   num_gpu_blocks_override=48, max_num_seqs=4)
    prompts = _shared_prefix_prompts(40, [2, 2, 2, 2], 500, seed=13)
    prompts[1] = prompts[0]
    tokens, _ = _generate(llm, prompts)
    _assert_exact(oracles["g1"], prompts, tokens)
    others = random_prompts([60] * 8, 500, seed=17)
    tokens, _ = _generate(llm, others)
    _assert_exact(oracles["g1"], others, tokens)
    tokens, cached = _generate(llm, prompts)
    _assert_exact(oracles["g1"], prompts, tokens)
    assert min(cached) < 40, cached  # the shared blocks were evicted (else this test proves nothing)


def _prefix_counters(llm) -> tuple:
    """(queries, hits) of vLLM's prefix-cache counters, summed over their label series."""
    series = [m for m in llm.get_metrics() if m.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")]
    return tuple(sum(m.value for m in series if m.name == name)
                 for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"))


def _vllm_026_on_cuda() -> bool:
    import torch
    import vllm

    return torch.cuda.is_available() and vllm.__version__.startswith("0.26")


@pytest.mark.xfail(_vllm_026_on_cuda(), strict=False,
                   reason="vLLM 0.26's in-process LLMEngine.step drops the scheduler stats of steps without request "
                          "outputs; on the H200 this test read 0 queries and 0 hits while the request's "
                          "num_cached_tokens showed its hit (the OpenAI server's counters count hits there)")
def test_prefix_cache_counters_count_mamba_hits(model_dirs):
    """vLLM's prefix-cache counters count the plugin's hits: a shared prefix of just over one block.

    The counters are read around the second request alone, whose remaining tokens fit one step, so that step
    produces an output: vLLM 0.26's in-process engine drops the stats of steps without request outputs
    (``LLMEngine.step`` records only when ``outputs.outputs`` is non-empty; 0.32 records every step), which can
    hide the first request's multi-step prefill from its counters."""
    llm = make_llm(model_dirs["g1"], enable_prefix_caching=True, max_num_batched_tokens=16,
                   disable_log_stats=False)
    bs = llm.llm_engine.vllm_config.cache_config.block_size
    prompts = _shared_prefix_prompts(bs + 2, [3, 5], 500, seed=19)
    assert len(prompts[1]) - bs <= 16  # the hit request's prefill is one step
    _generate(llm, prompts[:1])
    before = _prefix_counters(llm)
    _, cached = _generate(llm, prompts[1:])
    after = _prefix_counters(llm)
    assert cached == [bs], cached  # the request's own count of tokens from cached states
    delta = (after[0] - before[0], after[1] - before[1])
    assert delta == (len(prompts[1]), bs), (delta, before, after)


def test_preemption_of_requests_with_cached_prefixes(model_dirs, oracles):
    """A pool of 10 blocks for 8 running requests: each holds its running block and takes another at every
    boundary, so decodes run out of blocks and vLLM preempts (recompute). The preempted requests come back through
    the prefix cache; every token stays exact (the test checks that preemption happened)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(model_dirs["g1"], enable_prefix_caching=True, max_num_batched_tokens=32,
                   num_gpu_blocks_override=10, max_num_seqs=8, disable_log_stats=False)
    prompts = _shared_prefix_prompts(20, [3 + i for i in range(8)], 500, seed=31)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == oracles["g1"].generate(p, 40)[0], len(p)
    metrics = {m.name: m for m in llm.get_metrics()}
    assert metrics["vllm:num_preemptions"].value > 0  # else this test proves nothing
    assert metrics["vllm:prefix_cache_hits"].value > 0


@pytest.mark.parametrize("block, budget, system_len, hit", [(8, 16, 19, 16), (16, 8, 40, 32)],
                         ids=["block-of-two-chunks", "block-longer-than-the-step-budget"])
def test_blocks_of_several_chunks(block, budget, system_len, hit, model_dirs, oracles):
    """--block-size a multiple of the chunk (4 tokens here): hits at its boundaries only, still exact. With blocks
    longer than the step budget no step can reach the next boundary from a boundary, so prefill chunks start and
    end inside blocks (patches.py, 4), and every boundary's state is still written where it falls in a step."""
    llm = make_llm(model_dirs["g8_bias"], enable_prefix_caching=True, max_num_batched_tokens=budget,
                   block_size=block)
    assert llm.llm_engine.vllm_config.cache_config.mamba_block_size == block
    prompts = _shared_prefix_prompts(system_len, [2, 6], 500, seed=23)
    _generate(llm, prompts[:1])
    tokens, cached = _generate(llm, prompts[1:])
    _assert_exact(oracles["g8_bias"], prompts[1:], tokens)
    assert cached == [hit]


def test_bf16_weights_and_states_with_cache_hits(model_dirs, oracles):
    """bf16 weights and bf16 states: the cached boundary states are stored in bf16 like every state, so tokens are
    compared check_logprobs_close-style (where the greedy tokens first differ, each side's token is in the
    other's top-5), for requests that started from cached states."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from conftest import top5_containment

    llm = make_llm(model_dirs["g1"], dtype="bfloat16", enable_prefix_caching=True, max_num_batched_tokens=16)
    prompts = _shared_prefix_prompts(21, [3, 9, 14], 500, seed=29)
    _generate(llm, prompts[:1])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[1:]], params, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [16, 16]
    matched = top5_containment(oracles["g1"], prompts[1:], outs, MAX_TOKENS)
    assert matched >= 0.5 * MAX_TOKENS * 2, matched
