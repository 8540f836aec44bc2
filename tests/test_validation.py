"""Every refused option and bad input gives one clear error naming the fix, before anything half-runs."""

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_llm
from vllm_mamba2_plugin import tiny_model
from vllm_mamba2_plugin.validation import UnsupportedOptionError, check_hf_config

REFUSED = {
    "prefix_caching_block": (dict(enable_prefix_caching=True, block_size=12),
                             "--block-size 12 with prefix caching.*multiple of the model's SSD chunk size \\(8\\)"),
    "prefix_caching_mamba_block": (dict(enable_prefix_caching=True, block_size=16, mamba_block_size=8),
                                   "--mamba-block-size 8 != --block-size 16"),
    "spec_decode_prefix_caching_block": (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                                  "prompt_lookup_max": 3},
                                              enable_prefix_caching=True, block_size=16),
                                         "--block-size 16 with prefix caching.*multiple of both the model's SSD "
                                         "chunk size \\(8\\) and 1 \\+ num_speculative_tokens \\(3\\), e.g. 24"),
    "spec_decode_draft_model": (dict(speculative_config={"method": "draft_model", "model": "{tiny}",
                                                         "num_speculative_tokens": 2}),
                                "speculative decoding method 'draft_model'.*\"method\": \"ngram\""),
    "spec_decode_pipeline": (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                      "prompt_lookup_max": 3}, pipeline_parallel_size=2),
                             "speculative decoding with pipeline parallelism.*Drop --pipeline-parallel-size"),
    "spec_decode_async": (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                   "prompt_lookup_max": 3}, async_scheduling=True),
                          "async scheduling with speculative decoding.*Drop --async-scheduling"),
    # The default tiny model: num_heads 8, n_groups 1, 2 layers.
    "tensor_parallel_3": (dict(tensor_parallel_size=3), "tensor_parallel_size=3 for this model \\(num_heads=8\\)"
                          ".*Valid tensor_parallel_size values: \\[1, 2, 4, 8\\]"),
    "pipeline_parallel_3": (dict(pipeline_parallel_size=3),
                            "pipeline_parallel_size=3 .*num_hidden_layers=2.*Valid pipeline_parallel_size values: "
                            "1 to 2"),
    "pipeline_parallel_eager_cpu": (dict(pipeline_parallel_size=2, enforce_eager=True),
                                    "pipeline parallelism with --enforce-eager on the CPU.*Drop --enforce-eager"),
    "lora": (dict(enable_lora=True), "LoRA.*--enable-lora"),
    "quantization": (dict(quantization="fp8"), "quantized weights.*unquantized"),
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_model.build(str(tmp_path_factory.mktemp("v") / "m"), tiny_model.TinyMamba2Spec())


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_engine_option_is_refused_at_config_time(name, tiny_dir):
    from vllm.engine.arg_utils import EngineArgs

    kwargs, pattern = REFUSED[name]
    if "speculative_config" in kwargs and "model" in kwargs["speculative_config"]:  # the draft: the model itself
        kwargs = dict(kwargs, speculative_config={**kwargs["speculative_config"], "model": tiny_dir})
    with pytest.raises(Exception, match=f"vllm-mamba2-plugin: .*{pattern}") as err:
        EngineArgs(model=tiny_dir, dtype="float32", max_model_len=256, **kwargs).create_engine_config()
    assert "not supported" in str(err.value)


@pytest.mark.parametrize("var, value, pattern", [
    ("VLLM_MAMBA2_PLUGIN_FAST_LAUNCH", "maybe", "VLLM_MAMBA2_PLUGIN_FAST_LAUNCH='maybe' is not a boolean"),
    ("VLLM_MAMBA2_PLUGIN_DIRECT_LAUNCH", "fast", "VLLM_MAMBA2_PLUGIN_DIRECT_LAUNCH='fast' is not a boolean"),
    ("VLLM_MAMBA2_PLUGIN_SSD_CONFIGS", "all", "VLLM_MAMBA2_PLUGIN_SSD_CONFIGS='all' is not supported"),
    ("VLLM_MAMBA2_PLUGIN_KERNELS", "triton", "VLLM_MAMBA2_PLUGIN_KERNELS='triton' is not supported"),
    ("VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS", "2", "FULL_DECODE_GRAPHS='2' is not a boolean"),
])
def test_bad_plugin_switch_is_refused_at_config_time(var, value, pattern, tiny_dir, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv(var, value)
    with pytest.raises(Exception, match=pattern):
        EngineArgs(model=tiny_dir, dtype="float32", max_model_len=256).create_engine_config()


@pytest.fixture
def conv_layout_ds(monkeypatch):
    """VLLM_SSM_CONV_STATE_LAYOUT=DS, past vLLM's caches of its environment and of the layout."""
    import vllm.envs
    from vllm.model_executor.layers.mamba import mamba_utils

    def clear():
        getattr(vllm.envs.__getattr__, "cache_clear", lambda: None)()
        mamba_utils.get_conv_state_layout.cache_clear()

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    clear()
    yield
    monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT")
    clear()


def test_a_channels_first_conv_layout_is_refused_with_prefix_caching(tiny_dir, conv_layout_ds):
    from vllm.engine.arg_utils import EngineArgs

    EngineArgs(model=tiny_dir, dtype="float32", max_model_len=256).create_engine_config()  # no caching: fine
    with pytest.raises(Exception, match="prefix caching with VLLM_SSM_CONV_STATE_LAYOUT=DS .*not supported.*Unset"):
        EngineArgs(model=tiny_dir, dtype="float32", max_model_len=256,
                   enable_prefix_caching=True).create_engine_config()


def test_breakable_cuda_graphs_are_refused_at_config_time(tiny_dir, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    with pytest.raises(Exception, match="vllm-mamba2-plugin: VLLM_USE_BREAKABLE_CUDAGRAPH=1 .*not supported.*Unset"):
        EngineArgs(model=tiny_dir, dtype="float32", max_model_len=256).create_engine_config()


@pytest.mark.parametrize("heads, groups, tp", [(8, 4, 3), (8, 1, 16), (6, 2, 4), (24, 4, 5)])
def test_tp_size_that_does_not_divide_the_heads_is_refused(heads, groups, tp):
    """tp must divide num_heads (groups are copied where they do not split); the error names the valid sizes."""
    from vllm_mamba2_plugin.sharding import valid_tp_sizes
    from vllm_mamba2_plugin.validation import check_parallel_sizes

    cfg = _config(num_heads=heads, n_groups=groups, head_dim=192 // heads)
    valid = valid_tp_sizes(cfg)
    assert tp not in valid
    assert valid == [t for t in range(1, heads + 1) if heads % t == 0]
    par = type("Par", (), dict(tensor_parallel_size=tp, pipeline_parallel_size=1))
    with pytest.raises(UnsupportedOptionError, match=re.escape(f"Valid tensor_parallel_size values: {valid}")):
        check_parallel_sizes(par, cfg)
    for ok in valid:
        par.tensor_parallel_size = ok
        check_parallel_sizes(par, cfg)


@pytest.mark.parametrize("kwargs", [dict(tensor_parallel_size=2), dict(tensor_parallel_size=8),
                                    dict(pipeline_parallel_size=2)])
def test_valid_parallel_sizes_are_accepted_at_config_time(kwargs, tiny_dir):
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(model=tiny_dir, dtype="float32", max_model_len=256, **kwargs).create_engine_config()
    assert cfg.parallel_config.world_size == max(kwargs.values())


def test_refusal_reaches_the_llm_user(tiny_dir):
    with pytest.raises(Exception, match="vllm-mamba2-plugin: --block-size 12 with prefix caching"):
        make_llm(tiny_dir, enable_prefix_caching=True, block_size=12)


def test_prefix_caching_configures_align_with_blocks_of_the_chunk(tiny_dir):
    """Prefix caching: vLLM's "align" scheduling, the Mamba block equal to the KV block, dense retention."""
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(model=tiny_dir, dtype="float32", max_model_len=256, enable_prefix_caching=True,
                     block_size=8).create_engine_config()
    cache = cfg.cache_config
    assert cache.mamba_cache_mode == "align" and cache.mamba_block_size == cache.block_size == 8
    assert getattr(cache, "prefix_cache_retention_interval", None) is None


def _config(**changes):
    base = tiny_model.hf_config_dict(tiny_model.TinyMamba2Spec(), tiny_model.build_tokenizer(512))
    base.update(changes)
    return type("Cfg", (), base)


@pytest.mark.parametrize("changes, pattern", [
    (dict(n_groups=3), "n_groups=3 must divide num_heads=8"),
    (dict(expand=4), "num_heads\\*head_dim = 128 but expand\\*hidden_size = 256"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(rms_norm=False), "rms_norm=False"),
    (dict(time_step_limit=[0.5, 0.1]), "time_step_limit"),
    (dict(state_size=None), "lacks \\['state_size'\\]"),
])
def test_bad_model_config_is_refused(changes, pattern):
    with pytest.raises(UnsupportedOptionError, match=pattern):
        check_hf_config(_config(**changes))
    check_hf_config(_config())  # the unchanged config passes


def _broken_copy(src, dst, edit):
    os.makedirs(dst)
    for name in os.listdir(src):
        if name != "model.safetensors":
            with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
                g.write(f.read())
    weights = load_file(os.path.join(src, "model.safetensors"))
    edit(weights)
    save_file(weights, os.path.join(dst, "model.safetensors"))
    return dst


@pytest.mark.parametrize("case, edit, pattern", [
    ("missing", lambda w: w.pop("backbone.layers.1.mixer.D"), "missing \\['backbone.layers.1.mixer.D'\\]"),
    ("wrong_shape", lambda w: w.__setitem__("backbone.layers.0.mixer.conv1d.weight", torch.zeros(10, 1, 4)),
     "wrong shape.*conv1d.weight: checkpoint \\(10, 1, 4\\)"),
    ("unexpected", lambda w: w.__setitem__("backbone.layers.0.mixer.extra", torch.zeros(3)),
     "unexpected \\['backbone.layers.0.mixer.extra'\\]"),
])
def test_bad_weights_are_refused_with_the_names(case, edit, pattern, tiny_dir, tmp_path):
    bad = _broken_copy(tiny_dir, str(tmp_path / case), edit)
    with pytest.raises(Exception, match=f"vllm-mamba2-plugin: the checkpoint does not match.*{pattern}"):
        make_llm(bad)


def test_config_json_mismatch_names_the_fields(tiny_dir, tmp_path):
    bad = _broken_copy(tiny_dir, str(tmp_path / "cfg"), lambda w: None)
    with open(os.path.join(bad, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = 3  # the checkpoint has 2
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(Exception, match="missing \\['backbone.layers.2"):
        make_llm(bad)


def test_speculation_with_prefix_caching_takes_blocks_of_whole_rings(tiny_dir):
    """k = 2 keeps rings of 3 states: the default Mamba block is lcm(chunk 8, 3) = 24 tokens (spec_decode.py); the
    engine aligns the KV block to it at start-up (the engine test with k = 2 in tests/test_spec_decode.py hits at
    its multiples)."""
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=tiny_dir, dtype="float32", max_model_len=256, enable_prefix_caching=True,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                            "prompt_lookup_max": 3}).create_engine_config()
    assert config.cache_config.mamba_block_size == 24


def test_speculation_with_prefix_caching_is_refused_on_model_runner_v2(tiny_dir, monkeypatch):
    """Model Runner V2 moves states in a fused copy of its own, which the plugin cannot skip (patches.py, 3)."""
    import vllm.envs
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    getattr(vllm.envs.__getattr__, "cache_clear", lambda: None)()
    try:
        with pytest.raises(Exception, match="prefix caching on vLLM's Model Runner V2 .*not supported.*"
                                            "VLLM_USE_V2_MODEL_RUNNER=0"):
            EngineArgs(model=tiny_dir, dtype="float32", max_model_len=256, enable_prefix_caching=True,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                           "prompt_lookup_max": 3}).create_engine_config()
    finally:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
        getattr(vllm.envs.__getattr__, "cache_clear", lambda: None)()
