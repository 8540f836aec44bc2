"""Every difference between the vLLM releases the plugin supports (0.26 through 0.32), and nothing else.

The rest of the package imports vLLM names from here only, so one file says what moved between releases.
What differs (docs/vllm-0.26-vs-0.32.md), and how it is bridged:

* state tensors on a layer: 0.26's runner assigns ``layer.kv_cache = [conv, ssm]`` (a list of views);
  0.32 calls ``MambaBase.bind_kv_cache(raw)``, which stores a tuple. ``layer_states`` reads either.
* MambaSpec: 0.32 adds fields (prefill checkpoints, num_heads, tokens_per_state, tp_replicated), all
  defaulted. ``make_state_spec`` passes only the fields both releases know.
* CommonAttentionMetadata: 0.26 has a ``seq_lens_cpu`` property, 0.32 only ``seq_lens_cpu_upper_bound``
  (exact unless async scheduling runs with speculative decoding, which the plugin turns off). ``seq_lens_cpu``
  picks one.
* AttentionBackend: 0.26 declares ``get_kv_cache_shape`` abstract; the backend stubs it (harmless on 0.32).
* forward-context metadata: a dict keyed by layer prefix in both, missing (0.32) or None (0.26) in profile
  runs, or a list of dicts under micro-batching (refused).
* read, not run (0.33 / 0.34, docs/vllm-0.33-0.34.md): 0.34 deletes the V1 runner's per-entry state-move
  collector that patches.py (3) wraps; ``v1_state_move_collector`` returns None there.

The tensor- and pipeline-parallel names (parallel linear layers, TP / PP groups, ``make_layers``,
``PPMissingLayer``, ``IntermediateTensors``, the sharded loaders) are long-stable vLLM APIs, the same in both.

Everything here is imported from the same module path in both releases; this file is where a future
rename gets its ``try/except ImportError``.
"""

import torch

from vllm.compilation.decorators import support_torch_compile  # noqa: F401
from vllm.config import get_current_vllm_config
from vllm.distributed import (  # noqa: F401
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: F401
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear  # noqa: F401
from vllm.model_executor.layers.logits_processor import LogitsProcessor  # noqa: F401
from vllm.model_executor.layers.mamba.abstract import MambaBase  # noqa: F401
from vllm.model_executor.model_loader.weight_utils import (  # noqa: F401
    default_weight_loader,
    sharded_weight_loader,
)
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (  # noqa: F401
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.config import VerifyAndUpdateConfig  # noqa: F401
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree, SupportsPP  # noqa: F401
from vllm.model_executor.models.utils import (  # noqa: F401
    PPMissingLayer,
    is_pp_missing_parameter,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)
from vllm.sequence import IntermediateTensors  # noqa: F401
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backend import (  # noqa: F401
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

# Fields of MambaSpec common to 0.26 and 0.32 that the plugin sets.
_SPEC_FIELDS = ("shapes", "dtypes", "block_size", "page_size_padded", "mamba_type", "mamba_cache_mode",
                "num_speculative_blocks")


def plugin_mamba_type() -> MambaAttentionBackendEnum:
    """The spec's mamba_type. vLLM reads it only to pick state copy functions for prefix caching (for the
    plugin's layers patches.py, 3, moves the states instead) and to group layers; the layer hands vLLM its backend
    class directly (``get_attn_backend``), so MAMBA2 (whose copy functions match our layout) is the honest label."""
    return MambaAttentionBackendEnum.MAMBA2


def make_state_spec(spec_cls, *, shapes, dtypes, vllm_config, mamba_type):
    cache = vllm_config.cache_config
    if cache.mamba_block_size is None:
        raise RuntimeError(
            "vllm-mamba2-plugin: cache_config.mamba_block_size is unset, so the architecture was not "
            "configured by the plugin (is its entry in MODELS_CONFIG_MAP? was register() called?)"
        )
    kwargs = dict(
        shapes=shapes,
        dtypes=dtypes,
        block_size=cache.mamba_block_size,
        page_size_padded=getattr(cache, "mamba_page_size_padded", None),
        mamba_type=mamba_type,
        mamba_cache_mode=getattr(cache, "mamba_cache_mode", "none"),
        # Speculative decoding's state ring (spec_decode.py): k more slots per request.
        num_speculative_blocks=num_speculative_tokens(vllm_config),
    )
    assert set(kwargs) == set(_SPEC_FIELDS)
    return spec_cls(**kwargs)


def num_speculative_tokens(vllm_config) -> int:
    spec = vllm_config.speculative_config
    return int(spec.num_speculative_tokens or 0) if spec is not None else 0


def state_dtypes(model_config, cache_config) -> tuple[torch.dtype, torch.dtype]:
    """(conv state dtype, ssm state dtype): honours --mamba-cache-dtype and --mamba-ssm-cache-dtype."""
    return tuple(
        MambaStateDtypeCalculator.mamba2_state_dtype(
            model_config.dtype, cache_config.mamba_cache_dtype, cache_config.mamba_ssm_cache_dtype
        )
    )


def mamba2_state_copy_funcs():
    """vLLM's own copy specs: vLLM 0.32's V2 runner accepts no others (``_populate_metadata`` asserts them)."""
    return MambaStateCopyFuncCalculator.mamba2_state_copy_func()


def seq_lens_cpu(common_attn_metadata) -> torch.Tensor:
    upper = getattr(common_attn_metadata, "seq_lens_cpu_upper_bound", None)
    if upper is not None:
        return upper
    return common_attn_metadata.seq_lens_cpu  # 0.26: a lazily copied property


def v1_state_move_collector():
    """(``vllm.v1.worker.mamba_utils``, its ``collect_mamba_copy_meta``), the V1 runner's prefix-caching state-move
    collector (0.26 - 0.33), or None where this vLLM has none: read, not run on 0.34, which deletes it with the V1
    runner (Model Runner V2 moves states in one fused copy of its own)."""
    from vllm.v1.worker import mamba_utils

    collector = getattr(mamba_utils, "collect_mamba_copy_meta", None)
    return None if collector is None else (mamba_utils, collector)


def compiled_on_cpu() -> bool:
    """Whether the model being built runs on the CPU platform under torch.compile (any mode but NONE)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and int(get_current_vllm_config().compilation_config.mode or 0) != 0


def static_forward_context() -> dict:
    return get_current_vllm_config().compilation_config.static_forward_context


def empty_layer_states() -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([]), torch.tensor([]))


def layer_states(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv pool (slots, W-1, conv_dim), ssm pool (slots, H, P, N)) of one layer, in either release."""
    states = layer.kv_cache
    return states[0], states[1]


def layer_metadata(prefix: str):
    """This layer's metadata for the current step, or None in profile / dummy runs."""
    meta = get_forward_context().attn_metadata
    if meta is None:
        return None
    if isinstance(meta, list):
        raise NotImplementedError("vllm-mamba2-plugin: micro-batching (DBO) is not supported")
    return meta.get(prefix)


def forward_context_layer(layer_name: str):
    return get_forward_context().no_compile_layers[layer_name]


def register_custom_op(name, func, mutates_args, fake_impl) -> None:
    """Register ``torch.ops.vllm.<name>`` once per process (re-imports must not re-register)."""
    if hasattr(torch.ops.vllm, name):
        return
    direct_register_custom_op(op_name=name, op_func=func, mutates_args=mutates_args, fake_impl=fake_impl)


def tp_rank() -> int:
    return get_tensor_model_parallel_rank()


def tp_size() -> int:
    return get_tensor_model_parallel_world_size()


def init_single_rank_groups() -> None:
    """vLLM's parallel groups for one process of one rank, where a layer is built outside an engine (kernel tests,
    benchmarks): the parallel linear layers read the TP group. A no-op where the groups exist."""
    import tempfile

    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
        model_parallel_is_initialized,
    )

    if model_parallel_is_initialized():
        return
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{tempfile.mkdtemp()}/pg")
    ensure_model_parallel_initialized(1, 1)
