"""End to end on CUDA (vLLM 0.26 on the H200): plugin with the upstream kernels vs the step-by-step recurrence
vs vLLM's in-tree Mamba2; eager and piecewise CUDA graphs. Skipped without CUDA (conftest)."""

import sys

import pytest

from conftest import MODEL_VARIANTS, make_llm, prompt_lengths, random_prompts, run_engines, top5_containment
from oracle import oracle_generate

pytestmark = pytest.mark.gpu
VOCAB = 512
MAX_TOKENS = 24


def _gen(llm, prompts, max_tokens=MAX_TOKENS, **kw):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], outs


def _prompts(variant, seed=0):
    return random_prompts(prompt_lengths(MODEL_VARIANTS[variant]["chunk_size"]) + [200], VOCAB,
                          seed=seed + len(variant))


_LLMS = {}


def _llm(model_dir, **kw):
    """One engine per (model, options, FULL-graph switch), shared by the tests (make_llm keeps CUDA engines alive
    for the whole session: see there why)."""
    from vllm_mamba2_plugin import envs

    key = (model_dir, repr(sorted(kw.items())), envs.full_decode_graphs())
    if key not in _LLMS:
        _LLMS[key] = make_llm(model_dir, **dict(dict(max_num_seqs=16), **kw))
    return _LLMS[key]


def test_cuda_kernels_are_the_ones_in_use(model_dirs):
    llm = _llm(model_dirs["g1"])
    names = llm.apply_model(lambda m: type(m).__name__)
    assert names == ["Mamba2PluginForCausalLM"]
    # Imported lazily: not by start-up (profile runs carry no metadata), only by the first real step.
    _gen(llm, [[5, 6, 7]], max_tokens=2)
    assert "mamba_ssm" in sys.modules and "causal_conv1d_cuda" in sys.modules  # causal-conv1d's extension


@pytest.mark.parametrize("variant", ["g1", "g8_bias"])
def test_fp32_eager_greedy_matches_recurrence(variant, model_dirs, oracles):
    prompts = _prompts(variant)
    got, _ = _gen(_llm(model_dirs[variant]), prompts)
    want = [oracle_generate(oracles[variant], p, MAX_TOKENS)[0] for p in prompts]
    assert got == want


@pytest.mark.parametrize("variant", ["g1"])
def test_fp32_eager_chunked_prefill_and_batch_mix(variant, model_dirs, oracles):
    prompts = _prompts(variant, seed=1)
    llm = _llm(model_dirs[variant], max_num_batched_tokens=37)
    batched, _ = _gen(llm, prompts)
    singles = [_gen(llm, [p])[0][0] for p in prompts]
    want = [oracle_generate(oracles[variant], p, MAX_TOKENS)[0] for p in prompts]
    assert batched == want and singles == want


def test_fp32_cuda_graphs_greedy_slot_reuse(model_dirs, oracles, monkeypatch):
    """Piecewise CUDA graphs only (FULL decode graphs switched off: the mixer op is a split point and runs
    eagerly in every step); padded graph batches; slots reused."""
    monkeypatch.setenv("VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS", "0")
    variant = "g2_tied"
    llm = _llm(model_dirs[variant], enforce_eager=False,
               compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16]})
    cc = llm.llm_engine.vllm_config.compilation_config
    assert "vllm::mamba2_plugin_mixer" in (cc.splitting_ops or [])
    assert "FULL" not in str(cc.cudagraph_mode), cc.cudagraph_mode
    prompts = _prompts(variant, seed=2)
    got, _ = _gen(llm, prompts)
    assert got == [oracle_generate(oracles[variant], p, MAX_TOKENS)[0] for p in prompts]
    prompt = prompts[2]
    want = oracle_generate(oracles[variant], prompt, 12)[0]
    for _ in range(3):  # 100 identical prompts through 16 slots, dirtied in between; odd batch sizes pad
        got, _ = _gen(llm, [prompt] * 100, max_tokens=12)
        assert all(g == want for g in got)
        _gen(llm, prompts[:3], max_tokens=5)


def test_bf16_top5_logprobs_contain_each_other(model_dirs, oracles):
    """bf16: check_logprobs_close-style over 64 tokens. Where the greedy tokens first differ, each side's token
    must be in the other's top-5; the sequences are not compared after that."""
    variant = "g1"
    prompts = _prompts(variant, seed=3)
    _, outs = _gen(_llm(model_dirs[variant], dtype="bfloat16"), prompts, max_tokens=64, logprobs=5)
    matched = top5_containment(oracles[variant], prompts, outs, 64)
    assert matched >= 0.5 * 64 * len(prompts), matched


@pytest.mark.slow
def test_in_tree_vllm_agrees_on_cuda(model_dirs, oracles):
    """vLLM's in-tree Mamba2 (the second oracle) in a subprocess with the override off, fp32 eager."""
    variant = "g1"
    prompts = _prompts(variant)
    runs = [{"model": model_dirs[variant], "prompts": prompts, "max_tokens": MAX_TOKENS,
             "llm_kwargs": {"gpu_memory_utilization": 0.04}}]
    [result] = run_engines(runs, {"VLLM_MAMBA2_PLUGIN_OVERRIDE": "0"}, timeout=600)
    assert result["model_class"].endswith("models.mamba2.Mamba2ForCausalLM")
    want = [oracle_generate(oracles[variant], p, MAX_TOKENS)[0] for p in prompts]
    assert result["tokens"] == want


def test_fp32_full_decode_graphs_greedy_slot_reuse(model_dirs, oracles, monkeypatch):
    """The default (VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS=1, set explicitly here): decode-only steps replay FULL
    CUDA graphs (padded batches, a persistent slot buffer, padding rows on PAD_SLOT -1, skipped); mixed steps stay
    piecewise."""
    monkeypatch.setenv("VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS", "1")
    variant = "g8_bias"
    llm = _llm(model_dirs[variant], enforce_eager=False,
               compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16]})
    cc = llm.llm_engine.vllm_config.compilation_config
    assert "FULL" in str(cc.cudagraph_mode), cc.cudagraph_mode
    prompts = _prompts(variant, seed=4)
    got, _ = _gen(llm, prompts)
    assert got == [oracle_generate(oracles[variant], p, MAX_TOKENS)[0] for p in prompts]
    want = oracle_generate(oracles[variant], prompts[1], 12)[0]
    for _ in range(2):  # 37 identical prompts: batches of 16, 16 and 5 (padded to 8)
        got, _ = _gen(llm, [prompts[1]] * 37, max_tokens=12)
        assert all(g == want for g in got)
        _gen(llm, prompts[:3], max_tokens=5)


def test_fresh_one_token_prompts_in_full_decode_graphs(model_dirs, oracles, monkeypatch):
    """A fresh one-token prompt that joins a batch of decodes makes a batch of one-token rows, which vLLM's runner
    replays as a FULL decode graph (its dispatch looks at the shape only). The prompt's slot held an earlier
    request's state. 40 prompts, half of them one token long, through 16 slots with staggered lengths, so that
    newcomers keep joining decode batches; three rounds. (Before the builder zeroed such slots and put such rows
    in the graph's slot buffer: wrong first tokens, margin ~2 logits, and other requests advanced twice.)"""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    monkeypatch.setenv("VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS", "1")
    variant = "g8_bias"
    llm = _llm(model_dirs[variant], enforce_eager=False,
               compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16]})
    prompts = [[7 + i] if i % 2 else random_prompts([2 + i % 5], VOCAB, seed=50 + i)[0] for i in range(40)]
    lengths = [2 + (3 * i) % 11 for i in range(40)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    want = [oracle_generate(oracles[variant], p, n)[0] for p, n in zip(prompts, lengths)]
    for _ in range(3):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
