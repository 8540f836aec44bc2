"""register(): idempotent, light, CUDA-free; the switches; the registry entries it makes."""

import os
import subprocess
import sys

import pytest
import torch

import vllm_mamba2_plugin
from conftest import MODEL_VARIANTS, random_prompts, run_engines
from oracle import RecurrentMamba2, oracle_generate

from vllm_mamba2_plugin import tiny_model

PLUGIN_CLASS = "vllm_mamba2_plugin.model.Mamba2PluginForCausalLM"
IN_TREE_CLASS = "vllm.model_executor.models.mamba2.Mamba2ForCausalLM"


def test_register_is_idempotent_and_fills_the_registries():
    from vllm import ModelRegistry
    from vllm.config.compilation import CompilationConfig
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from vllm_mamba2_plugin.manager import Mamba2StateManager
    from vllm_mamba2_plugin.spec import Mamba2StateSpec
    from vllm_mamba2_plugin.validation import Mamba2PluginConfig

    vllm_mamba2_plugin.register()
    vllm_mamba2_plugin.register()
    assert CompilationConfig._attention_ops.count("vllm::mamba2_plugin_mixer") == 1
    assert "Mamba2PluginForCausalLM" in ModelRegistry.get_supported_archs()
    assert MODELS_CONFIG_MAP["Mamba2PluginForCausalLM"] is Mamba2PluginConfig
    assert MODELS_CONFIG_MAP["Mamba2ForCausalLM"] is Mamba2PluginConfig  # override on by default
    spec = Mamba2StateSpec(shapes=((3, 8), (2, 4, 4)), dtypes=(torch.float32, torch.float32), block_size=16)
    assert KVCacheSpecRegistry.get_manager_class(spec) is Mamba2StateManager
    # Built-in specs must still be there (the registry only fills itself while empty).
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, MambaManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    assert KVCacheSpecRegistry.get_manager_class(
        MambaSpec(shapes=((3, 8),), dtypes=(torch.float32,), block_size=16)) is MambaManager
    assert KVCacheSpecRegistry.get_manager_class(
        FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)) is FullAttentionManager


def test_import_and_register_never_touch_cuda():
    code = (
        "import torch, vllm_mamba2_plugin as p; p.register(); "
        "import vllm_mamba2_plugin.model, vllm_mamba2_plugin.kernels.cuda; "
        "import sys; assert 'mamba_ssm' not in sys.modules and 'causal_conv1d' not in sys.modules; "
        "print('cuda_initialized', torch.cuda.is_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "cuda_initialized False" in out.stdout


def test_bad_switch_value_is_refused():
    from vllm_mamba2_plugin import envs

    os.environ["VLLM_MAMBA2_PLUGIN_OVERRIDE"] = "maybe"
    try:
        with pytest.raises(ValueError, match="VLLM_MAMBA2_PLUGIN_OVERRIDE"):
            envs.override_in_tree()
    finally:
        del os.environ["VLLM_MAMBA2_PLUGIN_OVERRIDE"]


@pytest.mark.slow
def test_override_off_keeps_in_tree_mamba2_which_agrees_with_the_recurrence(model_dirs, oracles, tmp_path):
    """VLLM_MAMBA2_PLUGIN_OVERRIDE=0: Mamba2ForCausalLM is vLLM's in-tree class (the second oracle), and the
    plugin stays selectable by its own name in the same environment.

    vLLM's in-tree mixer ignores config.time_step_limit (it passes dt_limit=(0, inf) to its kernels), so the
    n_groups=8 model is rebuilt here without a limit for this comparison."""
    g8 = {k: v for k, v in MODEL_VARIANTS["g8_bias"].items() if k != "time_step_limit"}
    g8_dir = tiny_model.build(str(tmp_path / "g8_nolimit"), tiny_model.TinyMamba2Spec(**g8))
    models = [(model_dirs["g1"], oracles["g1"], MODEL_VARIANTS["g1"]["chunk_size"]),
              (model_dirs["g2_tied"], oracles["g2_tied"], MODEL_VARIANTS["g2_tied"]["chunk_size"]),
              (g8_dir, RecurrentMamba2(g8_dir), g8["chunk_size"])]
    runs, wants = [], []
    for path, oracle, chunk in models:
        prompts = random_prompts([1, chunk + 1, 29], 512, seed=40)
        runs.append({"model": path, "prompts": prompts, "max_tokens": 16})
        wants.append([oracle_generate(oracle, p, 16)[0] for p in prompts])
    runs.append({**runs[1], "llm_kwargs": {"hf_overrides": {"architectures": ["Mamba2PluginForCausalLM"]}}})
    wants.append(wants[1])
    results = run_engines(runs, {"VLLM_MAMBA2_PLUGIN_OVERRIDE": "0"})
    assert [r["model_class"] for r in results] == [IN_TREE_CLASS] * 3 + [PLUGIN_CLASS]
    for result, want in zip(results, wants):
        assert result["tokens"] == want


@pytest.mark.slow
def test_vllm_plugins_switches_the_plugin_on_and_off(model_dirs):
    run = {"model": model_dirs["g1"], "prompts": [[5, 6, 7]], "max_tokens": 4}
    assert run_engines([run], {"VLLM_PLUGINS": ""})[0]["model_class"] == IN_TREE_CLASS
    assert run_engines([run], {"VLLM_PLUGINS": "mamba2"})[0]["model_class"] == PLUGIN_CLASS
