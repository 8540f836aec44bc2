"""Mamba2StateSpec: the per-request state the plugin's layers ask vLLM's KV-cache allocator for, and the sizes
one tensor-parallel rank holds (docs/parallelism.md).

Two states per layer per request slot (one block = one slot, prefix caching off), per TP rank:
    conv state (conv_kernel - 1, conv_dim(config, tp))   the last W-1 conv inputs, channel innermost ("SD")
    ssm state  (num_heads / tp, head_dim, d_state)

It subclasses MambaSpec and adds no fields: every branch of vLLM's v1 engine tests
``isinstance(spec, MambaSpec)``, so allocation, page sizing, grouping and scheduling treat it as Mamba state,
while KVCacheSpecRegistry (which walks the MRO) hands it to our own manager.
"""

from dataclasses import dataclass

from vllm.v1.kv_cache_interface import MambaSpec

from .sharding import local_groups


def conv_dim(config, tp: int = 1) -> int:
    """Channels of the depthwise conv on one rank: its x and its copies of B and C (H·P/tp + 2·G_local·N;
    sharding.py)."""
    return config.num_heads * config.head_dim // tp + 2 * local_groups(config, tp) * config.state_size


def state_shapes(config, tp: int = 1) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """One slot's (conv state, ssm state) shapes on one of ``tp`` ranks for an HF Mamba2 config:
    ((W-1, conv_dim(config, tp)), (H/tp, P, N)).

    The one formula the layers (``Mamba2Mixer.get_state_shape``) and vLLM's start-up sizing
    (``get_mamba_state_shape_from_config``) share. Not vLLM's ``MambaStateShapeCalculator.mamba2_state_shape``:
    that orients the conv state by vLLM's global conv-state layout switch, and the plugin's kernels read "SD"
    (channel innermost) whatever it says."""
    return ((config.conv_kernel - 1, conv_dim(config, tp)),
            (config.num_heads // tp, config.head_dim, config.state_size))


# The states per request of the plugin's layers, each time vLLM's memory check asked them (1 + the speculative
# tokens): patches.py, 6, names the fix from it when they do not fit.
STATES_ASKED: list = []


@dataclass(frozen=True)
class Mamba2StateSpec(MambaSpec):
    """MambaSpec for the plugin's Mamba2 mixer layers (same fields, own manager)."""

    def max_memory_usage_bytes(self, vllm_config) -> int:
        STATES_ASKED.append(1 + self.num_speculative_blocks)
        return super().max_memory_usage_bytes(vllm_config)
