"""patches.py: prompt token ids outside the model's vocabulary are refused in the front end (a 4xx), with and
without a tokenizer, instead of reaching the engine's embedding lookup."""

import inspect
from types import SimpleNamespace

import pytest

from vllm_mamba2_plugin import patches


def test_out_of_vocabulary_finds_the_offending_id():
    assert patches.out_of_vocabulary([0, 5, 511], 512) is None
    assert patches.out_of_vocabulary([5, 512], 512) == 512
    assert patches.out_of_vocabulary([-1, 5, 10**6], 512) == -1


@pytest.fixture
def patched(monkeypatch):
    """InputProcessor._validate_model_input replaced by a recorder, then the patch installed over it."""
    from vllm.v1.engine.input_processor import InputProcessor

    seen = []
    monkeypatch.setattr(InputProcessor, "_validate_model_input", lambda self, inp, *a, **kw: seen.append(inp))
    monkeypatch.setattr(InputProcessor, "_validate_params", lambda self, params, *a, **kw: seen.append(params))
    monkeypatch.setattr(patches, "_installed", set())
    patches.install()
    return InputProcessor._validate_model_input, seen


def _processor(arch):
    return SimpleNamespace(model_config=SimpleNamespace(architectures=[arch], get_vocab_size=lambda: 512))


@pytest.mark.parametrize("ids", [[5, 512], [5, 1_000_000], [-3, 5]])
def test_plugin_models_refuse_out_of_vocabulary_prompt_ids(patched, ids):
    from vllm.exceptions import VLLMValidationError

    validate, seen = patched
    with pytest.raises(VLLMValidationError, match="out of vocabulary: this model's token ids are 0..511"):
        validate(_processor("Mamba2ForCausalLM"), {"type": "token", "prompt_token_ids": ids}, "decoder")
    assert seen == []  # refused before vLLM's own checks


def test_valid_prompts_and_other_models_pass_through(patched):
    validate, seen = patched
    validate(_processor("Mamba2ForCausalLM"), {"type": "token", "prompt_token_ids": [0, 511]}, "decoder")
    validate(_processor("LlamaForCausalLM"), {"type": "token", "prompt_token_ids": [5, 10**6]}, "decoder")
    validate(_processor("Mamba2ForCausalLM"), {"type": "embeds", "prompt_embeds": None}, "decoder")
    assert len(seen) == 3


def test_install_is_idempotent(patched):
    from vllm.v1.engine.input_processor import InputProcessor

    validate, _ = patched
    patches.install()
    assert InputProcessor._validate_model_input is validate


def _params_processor(arch, speculative: bool):
    return SimpleNamespace(model_config=SimpleNamespace(architectures=[arch]),
                           vllm_config=SimpleNamespace(speculative_config=object() if speculative else None))


def test_sampling_is_refused_under_speculation_for_plugin_models_only(patched):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    validate, seen = InputProcessor._validate_params, patched[1]
    sampled, greedy = SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)
    with pytest.raises(VLLMValidationError, match="temperature=0.7 with speculative decoding.*use temperature 0"):
        validate(_params_processor("Mamba2ForCausalLM", True), sampled, ("generate",))
    validate(_params_processor("Mamba2ForCausalLM", True), greedy, ("generate",))
    validate(_params_processor("Mamba2ForCausalLM", False), sampled, ("generate",))
    validate(_params_processor("LlamaForCausalLM", True), sampled, ("generate",))
    assert seen == [sampled, greedy, sampled, sampled]  # vLLM's own checks ran first every time


# ---- patch 3: the prefix-caching runner's state moves -------------------------------------------------------------

def _pools(dtype, blocks=7, K=3, D=40, H=4, P=6, N=8, pad=24):
    """(conv (blocks, K, D), ssm (blocks, H, P, N)) views of one buffer of padded pages, as vLLM's KV-cache tensors
    for a Mamba layer: each state at its offset in the block's page, the page stride larger than both."""
    import torch

    es = torch.empty(0, dtype=dtype).element_size()
    conv_n, ssm_n = K * D, H * P * N
    page = conv_n + ssm_n + pad
    raw = torch.zeros(blocks * page * es, dtype=torch.uint8).view(dtype)
    return (raw.as_strided((blocks, K, D), (page, D, 1)),
            raw.as_strided((blocks, H, P, N), (page, P * N, N, 1), conv_n))


def _mixer_standin(pools):
    """An object the patch takes for one of the plugin's mixer layers (its class), holding ``pools``."""
    from vllm_mamba2_plugin.mixer import Mamba2Mixer

    layer = Mamba2Mixer.__new__(Mamba2Mixer)
    object.__setattr__(layer, "kv_cache", list(pools))
    return layer


def _runner_fixture(monkeypatch, layers=3, blocks=9, ours=True, dtypes=None, spec_blocks=0):
    """What vLLM's runner hands collect_mamba_copy_meta: copy buffers (vLLM's dtypes: uint64 addresses, int32
    sizes), a KV-cache config of one Mamba group, the forward context's layers with their (conv, ssm) pools, a
    request's block ids, and vLLM's copy functions in this release's form."""
    import numpy as np
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec
    from vllm.v1.worker import mamba_utils

    # vLLM's own function, also where an engine of an earlier test in this process installed patch 3 over it
    monkeypatch.setattr(mamba_utils, "collect_mamba_copy_meta", inspect.unwrap(mamba_utils.collect_mamba_copy_meta))
    by_type = hasattr(mamba_utils, "_get_mamba_spec_for_layer")  # 0.32 looks the functions up by Mamba type
    if by_type:
        monkeypatch.setattr(mamba_utils, "_get_mamba_spec_for_layer", lambda g, n: SimpleNamespace(mamba_type="m2"))
    names = [f"backbone.layers.{i}.mixer" for i in range(layers)]
    dtypes = dtypes or [torch.bfloat16] * layers
    ctx = {n: (_mixer_standin if ours else lambda p: SimpleNamespace(kv_cache=list(p)))(_pools(dt, blocks=blocks))
           for n, dt in zip(names, dtypes)}
    cfg = SimpleNamespace(kv_cache_groups=[SimpleNamespace(
        layer_names=names, kv_cache_spec=SimpleNamespace(num_speculative_blocks=spec_blocks))])
    funcs = (get_conv_copy_spec, get_temporal_copy_spec)

    def bufs():
        return SimpleNamespace(offset=0, src_ptrs=SimpleNamespace(np=np.zeros(64, dtype=np.uint64)),
                               dst_ptrs=SimpleNamespace(np=np.zeros(64, dtype=np.uint64)),
                               sizes=SimpleNamespace(np=np.zeros(64, dtype=np.int32)))

    req = SimpleNamespace(block_ids=[[4, 7, 1, 8, 2]])
    return mamba_utils, cfg, ctx, bufs, req, {"m2": funcs} if by_type else funcs


def _install(monkeypatch, mamba_utils):
    """patch 3 installed for this test only (the original restored afterwards); returns the patched function."""
    monkeypatch.setattr(mamba_utils, "collect_mamba_copy_meta", mamba_utils.collect_mamba_copy_meta)
    monkeypatch.setattr(patches, "_installed", set())
    patches.install_worker()
    return mamba_utils.collect_mamba_copy_meta


def _count_fills(monkeypatch):
    from vllm_mamba2_plugin.state_copy import PoolLayout

    fills, fill = [], PoolLayout.fill
    monkeypatch.setattr(PoolLayout, "fill", lambda self, *a: fills.append(a) or fill(self, *a))
    return fills


def _same(a, b) -> bool:
    return a.offset == b.offset and all((getattr(a, k).np == getattr(b, k).np).all()
                                        for k in ("src_ptrs", "dst_ptrs", "sizes"))


def test_under_speculation_the_plugins_groups_move_no_state(monkeypatch):
    """With speculative blocks the layers read each state in its ring column (spec_decode.py): vLLM's move would
    overwrite one, so the patched collector writes nothing for the plugin's groups (vLLM's own loop would)."""
    mamba_utils, cfg, ctx, bufs, req, funcs = _runner_fixture(monkeypatch, spec_blocks=3)
    original = mamba_utils.collect_mamba_copy_meta
    patched = _install(monkeypatch, mamba_utils)
    want, got = bufs(), bufs()
    original(want, cfg, funcs, [0], 1, 2, 1, req, ctx)
    patched(got, cfg, funcs, [0], 1, 2, 1, req, ctx)
    assert want.offset == 3 * 2 and got.offset == 0


def test_batched_state_moves_equal_vllms_loop(monkeypatch):
    """The patched collect_mamba_copy_meta writes the entries vLLM's own loop writes (same addresses, sizes,
    order), for moves with 0-2 accepted speculative tokens and several requests in a row, on bf16 and fp32 pools;
    a no-op move writes nothing. The batched form does the work (not vLLM's loop behind it)."""
    import torch

    mamba_utils, cfg, ctx, bufs, req, funcs = _runner_fixture(
        monkeypatch, dtypes=[torch.bfloat16, torch.float32, torch.bfloat16])
    original = mamba_utils.collect_mamba_copy_meta
    patched = _install(monkeypatch, mamba_utils)
    assert patched is not original and patched.__wrapped__ is original
    fills = _count_fills(monkeypatch)
    want, got = bufs(), bufs()
    for src, dst, bias in ((1, 2, 0), (0, 3, 1), (1, 3, 2), (2, 2, 0)):
        original(want, cfg, funcs, [0], src, dst, bias, req, ctx)
        patched(got, cfg, funcs, [0], src, dst, bias, req, ctx)
    assert want.offset == 3 * 3 * 2 and _same(got, want)
    assert len(fills) == 3


def test_other_models_and_odd_moves_go_through_vllms_loop(monkeypatch):
    """Layers that are not the plugin's, and a negative accepted-token bias, take vLLM's own function."""
    mamba_utils, cfg, ctx, bufs, req, funcs = _runner_fixture(monkeypatch, ours=False)
    original = mamba_utils.collect_mamba_copy_meta
    patched = _install(monkeypatch, mamba_utils)
    fills = _count_fills(monkeypatch)
    want, got = bufs(), bufs()
    original(want, cfg, funcs, [0], 1, 2, 0, req, ctx)
    patched(got, cfg, funcs, [0], 1, 2, 0, req, ctx)
    assert _same(got, want) and want.offset == 6 and not fills
    _, cfg, ctx, bufs, req, funcs = _runner_fixture(monkeypatch)
    want, got = bufs(), bufs()
    original(want, cfg, funcs, [0], 2, 3, -1, req, ctx)
    patched(got, cfg, funcs, [0], 2, 3, -1, req, ctx)
    assert _same(got, want) and not fills


def test_batched_state_moves_follow_new_pools_of_any_layer(monkeypatch):
    """A layout is rebuilt when any layer's pools change (re-allocation; another engine's layers under the same
    names), not only the first layer's."""
    import torch

    mamba_utils, cfg, ctx, bufs, req, funcs = _runner_fixture(monkeypatch)
    original = mamba_utils.collect_mamba_copy_meta
    patched = _install(monkeypatch, mamba_utils)
    b = bufs()
    patched(b, cfg, funcs, [0], 1, 2, 0, req, ctx)
    for name in list(ctx)[1:]:  # new, differently shaped pools for the later layers only
        ctx[name].kv_cache[:] = _pools(torch.bfloat16, blocks=12, D=48)
    want, got = bufs(), bufs()
    got.__dict__.update({k: v for k, v in b.__dict__.items() if k.startswith("_")})  # the same runner's cache
    original(want, cfg, funcs, [0], 1, 2, 0, req, ctx)
    patched(got, cfg, funcs, [0], 1, 2, 0, req, ctx)
    assert _same(got, want)


def test_the_model_keeps_vllms_copy_specs():
    """vLLM 0.32's V2 runner (its default on CUDA) asserts that the copy functions are its own
    (``_populate_metadata``): the model hands both runners vLLM's, and patch 3 recognises its layers instead."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec

    from vllm_mamba2_plugin.model import Mamba2PluginForCausalLM

    assert tuple(Mamba2PluginForCausalLM.get_mamba_state_copy_func()) == (get_conv_copy_spec, get_temporal_copy_spec)
    assert {tuple(f) for f in Mamba2PluginForCausalLM.get_mamba_state_copy_funcs(["m2"]).values()} == {
        (get_conv_copy_spec, get_temporal_copy_spec)}


# ---- patch 4: a prompt's last prefill chunk runs to the prompt's end ---------------------------------------------

@pytest.mark.parametrize("start, new, want", [
    (0, 2200, 2200),     # the whole prompt: no stop at its last boundary (vLLM's would end it at 2048)
    (0, 1500, 1280),     # ends inside the prompt: on the last boundary within the chunk
    (2048, 152, 152),    # the prompt's tail
    (1280, 200, 0),      # no boundary within: wait for a step with room
    (1300, 100, 100),    # began inside a block (a chunk that ran as the budget gave it): runs on
    (2200, 1, 1),        # decode
])
def test_prefill_chunks_end_on_boundaries_or_the_prompts_end(start, new, want):
    assert patches.prefill_chunk(start, new, prefill_end=2200, block=256, budget=8192) == want


def test_a_block_longer_than_the_budget_runs_as_the_budget_gives_it():
    assert patches.prefill_chunk(0, 512, prefill_end=4000, block=1024, budget=512) == 512


def _scheduler_stub(specs):
    return SimpleNamespace(cache_config=SimpleNamespace(block_size=256), max_num_scheduled_tokens=8192,
                           kv_cache_config=SimpleNamespace(
                               kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec) for spec in specs]))


def _plugin_spec():
    import torch

    from vllm_mamba2_plugin.spec import Mamba2StateSpec

    return Mamba2StateSpec(shapes=((3, 40), (4, 6, 8)), dtypes=(torch.float32,) * 2, block_size=256)


def test_plugin_schedulers_take_the_plugins_chunks_and_others_vllms(monkeypatch):
    """patch 4 on the scheduler: the plugin's rule for a scheduler of the plugin's states, from the request's
    computed tokens plus the hit ones; any other scheduler (another Mamba spec, a mix, no groups) goes through
    vLLM's function with its arguments."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import MambaSpec

    calls = []

    def vllms(self, request, num_new_tokens, *args):
        calls.append((num_new_tokens, args))
        return 11

    monkeypatch.setattr(Scheduler, "_mamba_block_aligned_split", vllms)
    monkeypatch.setattr(patches, "_installed", set())
    patches.install_scheduler()
    split = Scheduler._mamba_block_aligned_split
    assert split is not vllms and split.__wrapped__ is vllms
    ours = _plugin_spec()
    theirs = MambaSpec(shapes=ours.shapes, dtypes=ours.dtypes, block_size=ours.block_size)
    request = SimpleNamespace(num_computed_tokens=0, num_prompt_tokens=2200, num_tokens=2200)
    assert split(_scheduler_stub([ours]), request, 2200) == 2200
    assert split(_scheduler_stub([ours]), request, 1400, 100, 56) == 1536 - 156  # after a hit of 156 tokens
    assert calls == []
    for specs in ([theirs], [ours, theirs], []):
        assert split(_scheduler_stub(specs), request, 100, 7, 3) == 11
    assert calls == [(100, (7, 3))] * 3
    patches.install_scheduler()
    assert Scheduler._mamba_block_aligned_split is split


def test_the_state_move_patch_stands_aside_without_vllms_v1_collector(monkeypatch):
    """vLLM 0.34 has no V1 runner and no collect_mamba_copy_meta: installing the patch changes nothing there."""
    from vllm.v1.worker import mamba_utils

    from vllm_mamba2_plugin import patches

    monkeypatch.delattr(mamba_utils, "collect_mamba_copy_meta")
    patches._batch_state_moves()
    assert not hasattr(mamba_utils, "collect_mamba_copy_meta")


def _vllm_config():
    return SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode="none"))


@pytest.mark.parametrize("spec_blocks", [3, 0], ids=["drafts", "no-drafts"])
def test_states_that_do_not_fit_because_of_the_drafts_name_that_fix(monkeypatch, spec_blocks):
    """patch 6: vLLM's check fails (one request's states exceed the cache); with drafts the error counts the 1 + k
    states and names the k that fits, without them vLLM's own error stays. It is installed by register()."""
    import dataclasses

    import torch
    from vllm.v1.core import kv_cache_utils

    import vllm_mamba2_plugin
    from vllm_mamba2_plugin.spec import Mamba2StateSpec

    vllm_mamba2_plugin.register()
    assert hasattr(kv_cache_utils._check_enough_kv_cache_memory, "__wrapped__")
    spec = dataclasses.replace(Mamba2StateSpec(shapes=((3, 40), (4, 6, 8)), dtypes=(torch.float32,) * 2,
                                               block_size=256), num_speculative_blocks=spec_blocks)
    per_state = spec.page_size_bytes
    need = lambda: 24 * spec.max_memory_usage_bytes(_vllm_config())  # noqa: E731 -- 24 layers
    available = 24 * per_state * 2 + 5 if spec_blocks else 24 * per_state - 5  # with drafts two states fit: k = 1
    want = ("num_speculative_tokens=3 every request keeps 1 \\+ 3 = 4 Mamba2 states.*lower num_speculative_tokens "
            "to at most 1, or give the cache more memory" if spec_blocks else "KV cache is needed")
    with pytest.raises(ValueError, match=want):
        kv_cache_utils._check_enough_kv_cache_memory(available, need, 2048, lambda am: 0)
    kv_cache_utils._check_enough_kv_cache_memory(24 * per_state * (1 + spec_blocks), need, 2048, lambda am: 0)


def test_when_not_even_one_draft_fits_the_fix_is_to_serve_without_drafts():
    msg = patches.drafts_do_not_fit(4, 4 * 100, 150)
    assert "serve without --speculative-config (not even one draft fits)" in msg
