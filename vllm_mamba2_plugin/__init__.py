"""vllm-mamba2-plugin: serve Mamba2 state-space LMs on vLLM's V1 engine.

vLLM calls ``register()`` (entry point ``vllm.general_plugins`` -> ``mamba2``) in every process it starts:
front end, engine core, workers, and the registry-inspection subprocess. It must therefore be idempotent,
import little, and never touch CUDA: the model class is registered by its "module:Class" string, so the model
code (and the CUDA kernels behind it) is imported only where vLLM builds the model. On a vLLM release outside the
supported ones it registers only a refusal (version_gate.py).
"""

__version__ = "0.1.0"

PLUGIN_ARCH = "Mamba2PluginForCausalLM"
HF_ARCH = "Mamba2ForCausalLM"
MODEL_CLASS_PATH = "vllm_mamba2_plugin.model:Mamba2PluginForCausalLM"
REFUSAL_CLASS_PATH = "vllm_mamba2_plugin.version_gate:UnsupportedVllmModel"
MIXER_OP = "vllm::mamba2_plugin_mixer"

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from . import envs, version_gate

    version = version_gate.vllm_release()
    if not version_gate.is_supported(version) and not envs.unverified_vllm():
        _register_refusal(version)
        _registered = True
        return
    from vllm import ModelRegistry
    from vllm.config.compilation import CompilationConfig
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from .manager import Mamba2StateManager
    from .spec import Mamba2StateSpec
    from .validation import Mamba2PluginConfig

    archs = [PLUGIN_ARCH] + ([HF_ARCH] if envs.override_in_tree() else [])
    for arch in archs:
        # Re-registering an existing name replaces it: this is how the plugin takes over Mamba2ForCausalLM.
        ModelRegistry.register_model(arch, MODEL_CLASS_PATH)
        # Sets mamba_block_size and refuses unsupported engine options before any worker starts.
        MODELS_CONFIG_MAP[arch] = Mamba2PluginConfig

    # Built-in specs register only into an empty registry, so fill it first, then add ours (MRO lookup).
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(Mamba2StateSpec, Mamba2StateManager, uniform_type_base_spec=MambaSpec)

    # Piecewise CUDA graphs split the compiled model at these ops; ours reads per-step state and metadata.
    if MIXER_OP not in CompilationConfig._attention_ops:
        CompilationConfig._attention_ops.append(MIXER_OP)
    _register_mamba_ssm_format()
    from . import patches

    patches.install_everywhere()
    _registered = True


def _register_refusal(version: str) -> None:
    """An unsupported vLLM: the in-tree Mamba2 keeps its name; the plugin's own name fails at start-up, saying
    why (version_gate.py)."""
    import logging

    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from . import version_gate

    ModelRegistry.register_model(PLUGIN_ARCH, REFUSAL_CLASS_PATH)
    MODELS_CONFIG_MAP[PLUGIN_ARCH] = version_gate.RefuseUnsupportedVllm
    logging.getLogger(__name__).warning(version_gate.unsupported_message(version))


def _register_mamba_ssm_format() -> None:
    """mamba_ssm's checkpoints (state-spaces/mamba2-*): --config-format mamba_ssm, and found by "auto" through the
    "hf" slot (patches.py, 2; mamba_ssm_format.py)."""
    from vllm.transformers_utils import config as vllm_config_utils

    from .mamba_ssm_format import FORMAT, parser_classes

    mamba_ssm_parser, hf_or_mamba_ssm_parser = parser_classes()
    parsers = vllm_config_utils._CONFIG_FORMAT_TO_CONFIG_PARSER
    parsers[FORMAT] = mamba_ssm_parser
    if not getattr(parsers["hf"], "detects_mamba_ssm", False):
        hf_or_mamba_ssm_parser.detects_mamba_ssm = True
        parsers["hf"] = hf_or_mamba_ssm_parser
