"""patches.py: prompt token ids outside the model's vocabulary are refused in the front end (a 4xx), with and
without a tokenizer, instead of reaching the engine's embedding lookup."""

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


# ---- patch 3: the prefix-caching runner's state moves -------------------------------------------------------------

def _runner_fixture(monkeypatch, layers=3, blocks=9):
    """What vLLM's runner hands collect_mamba_copy_meta: copy buffers, a KV-cache config of one Mamba group, the
    forward context's layers with their (conv, ssm) pools (vLLM-style padded pages), a request's block ids."""
    import numpy as np
    import torch
    from vllm.v1.worker import mamba_utils

    from test_state_copy import _pools

    if hasattr(mamba_utils, "_get_mamba_spec_for_layer"):  # 0.32 looks the copy functions up by Mamba type
        monkeypatch.setattr(mamba_utils, "_get_mamba_spec_for_layer", lambda g, n: SimpleNamespace(mamba_type="m2"))
    names = [f"backbone.layers.{i}.mixer" for i in range(layers)]
    ctx = {n: SimpleNamespace(kv_cache=_pools(torch.bfloat16, blocks=blocks)) for n in names}
    cfg = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=names)])

    def bufs():
        return SimpleNamespace(offset=0, **{k: SimpleNamespace(np=np.zeros(64, dtype=np.int64))
                                            for k in ("src_ptrs", "dst_ptrs", "sizes")})

    req = SimpleNamespace(block_ids=[[4, 7, 1, 8, 2]])
    return mamba_utils, cfg, ctx, bufs, req


def _install(monkeypatch, mamba_utils):
    """patch 3 installed for this test only (the original restored afterwards); returns the patched function."""
    monkeypatch.setattr(mamba_utils, "collect_mamba_copy_meta", mamba_utils.collect_mamba_copy_meta)
    monkeypatch.setattr(patches, "_installed", set())
    patches.install_worker()
    return mamba_utils.collect_mamba_copy_meta


def test_batched_state_moves_equal_vllms_loop(monkeypatch):
    """The patched collect_mamba_copy_meta writes the entries vLLM's own loop writes with the plugin's copy specs
    (same addresses, sizes, order), for moves with 0-2 accepted speculative tokens and several requests in a row;
    a no-op move writes nothing; other models' copy functions go through vLLM's loop."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec

    from vllm_mamba2_plugin.state_copy import STATE_COPY_FUNCS

    mamba_utils, cfg, ctx, bufs, req = _runner_fixture(monkeypatch)
    original = mamba_utils.collect_mamba_copy_meta
    patched = _install(monkeypatch, mamba_utils)
    assert patched is not original and patched.__wrapped__ is original
    by_type = hasattr(mamba_utils, "_get_mamba_spec_for_layer")  # 0.32: a dict by Mamba type; 0.26: the tuple
    funcs = {"m2": STATE_COPY_FUNCS} if by_type else STATE_COPY_FUNCS
    theirs = {"m2": (get_conv_copy_spec, get_temporal_copy_spec)} if by_type else (get_conv_copy_spec,
                                                                                    get_temporal_copy_spec)
    for fs in (funcs, theirs):
        want, got = bufs(), bufs()
        for src, dst, bias in ((1, 2, 0), (0, 3, 1), (1, 3, 2), (2, 2, 0)):
            original(want, cfg, fs, [0], src, dst, bias, req, ctx)
            patched(got, cfg, fs, [0], src, dst, bias, req, ctx)
        assert got.offset == want.offset == 3 * 3 * 2
        for k in ("src_ptrs", "dst_ptrs", "sizes"):
            assert (getattr(got, k).np == getattr(want, k).np).all(), k


def test_batched_state_moves_follow_reallocated_pools(monkeypatch):
    import torch

    from test_state_copy import _pools
    from vllm_mamba2_plugin.state_copy import STATE_COPY_FUNCS

    mamba_utils, cfg, ctx, bufs, req = _runner_fixture(monkeypatch)
    original = mamba_utils.collect_mamba_copy_meta
    if hasattr(mamba_utils, "_get_mamba_spec_for_layer"):
        STATE_COPY_FUNCS = {"m2": STATE_COPY_FUNCS}  # noqa: N806  (0.32's form)
    patched = _install(monkeypatch, mamba_utils)
    patched(bufs(), cfg, STATE_COPY_FUNCS, [0], 1, 2, 0, req, ctx)
    for layer in ctx.values():  # new pools (e.g. after the KV cache is re-allocated)
        layer.kv_cache = _pools(torch.bfloat16, blocks=9)
    want, got = bufs(), bufs()
    original(want, cfg, STATE_COPY_FUNCS, [0], 1, 2, 0, req, ctx)
    patched(got, cfg, STATE_COPY_FUNCS, [0], 1, 2, 0, req, ctx)
    assert (got.src_ptrs.np == want.src_ptrs.np).all() and (got.dst_ptrs.np == want.dst_ptrs.np).all()
