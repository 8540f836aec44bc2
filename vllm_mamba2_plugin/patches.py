"""Patches of vLLM internals the plugin makes, one entry each: what, why, the releases it was verified on, and
when to delete it. Each is installed from ``Mamba2PluginConfig.verify_and_update_config`` (the front-end process,
only when the plugin serves the model), is idempotent, and acts only on engines of the plugin's architectures.

1. Prompt token ids are checked against the model's vocabulary (``InputProcessor._validate_model_input``).
   What: before vLLM's own checks, every prompt token id must lie in [0, vocab_size); otherwise the request is
   refused with ``VLLMValidationError`` (the server answers 400 "Token id ... is out of vocabulary").
   Why: vLLM checks ids only against a tokenizer, so with ``--skip-tokenizer-init`` nothing is checked, and 0.26
   never checks negative ids. An id outside the embedding table reaches the embedding lookup in the engine: a
   device-side assert on CUDA, an index error on the CPU, and the engine dies for every client.
   Verified: vLLM 0.26.0 (GPU) and 0.32.0 (CPU): ``tests/test_patches.py``, ``scripts/serve_load.py --bad-inputs``.
   Delete when: vLLM itself refuses out-of-range ids with and without a tokenizer in every supported release.

2. Config detection of mamba_ssm checkpoints (``vllm.transformers_utils.config._CONFIG_FORMAT_TO_CONFIG_PARSER``).
   What: ``register()`` (every process, since it decides which config a model gets) puts the mamba_ssm parser under
   the format "mamba_ssm" and a subclass of vLLM's ``HFConfigParser`` under "hf" that hands a config.json without
   ``model_type`` but with ``d_model`` / ``n_layer`` to the mamba_ssm parser (``mamba_ssm_format.py``) and every
   other config to vLLM's own parse.
   Why: ``--config-format auto`` picks "hf" whenever a config.json exists, and HF's parser cannot read mamba_ssm's
   config.json (no ``model_type``); without this, a state-spaces checkpoint would need ``--config-format mamba_ssm``.
   The entries are set directly, not through ``register_config_parser``, which logs a warning for the replaced "hf"
   slot in every process.
   Verified: vLLM 0.32.0 (CPU): ``tests/test_mamba_ssm_format.py``. The same names exist in 0.26.0.
   Delete when: vLLM's "auto" detection asks registered parsers, or vLLM reads mamba_ssm configs itself.
"""

from . import HF_ARCH, PLUGIN_ARCH, envs

_installed: set = set()


def plugin_archs() -> set:
    return {PLUGIN_ARCH} | ({HF_ARCH} if envs.override_in_tree() else set())


def install() -> None:
    if "token_ids" not in _installed:
        _check_prompt_token_ids()
        _installed.add("token_ids")


def out_of_vocabulary(token_ids, vocab_size: int):
    """The first id of ``token_ids`` outside [0, vocab_size), or None."""
    lo, hi = min(token_ids), max(token_ids)
    if lo < 0:
        return lo
    if hi >= vocab_size:
        return hi
    return None


def _check_prompt_token_ids() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._validate_model_input

    def _validate_model_input(self, prompt_input, *args, **kwargs):
        ids = None if prompt_input.get("type") == "embeds" else prompt_input.get("prompt_token_ids")
        if ids and set(self.model_config.architectures or ()) & plugin_archs():
            vocab = self.model_config.get_vocab_size()
            bad = out_of_vocabulary(ids, vocab)
            if bad is not None:
                raise VLLMValidationError(
                    f"Token id {bad} is out of vocabulary: this model's token ids are 0..{vocab - 1}",
                    parameter="prompt", value=bad)
        return original(self, prompt_input, *args, **kwargs)

    _validate_model_input.__wrapped__ = original
    InputProcessor._validate_model_input = _validate_model_input
