"""Mamba2StateSpec: the per-request state the plugin's layers ask vLLM's KV-cache allocator for.

Two states per layer per request slot (one block = one slot, prefix caching off):
    conv state (conv_kernel - 1, conv_dim)   the last W-1 conv inputs, channel innermost ("SD" layout)
    ssm state  (num_heads, head_dim, d_state)

It subclasses MambaSpec and adds no fields: every branch of vLLM's v1 engine tests
``isinstance(spec, MambaSpec)``, so allocation, page sizing, grouping and scheduling treat it as Mamba state,
while KVCacheSpecRegistry (which walks the MRO) hands it to our own manager.
"""

from dataclasses import dataclass

from vllm.v1.kv_cache_interface import MambaSpec


def conv_dim(config) -> int:
    """Channels of the depthwise conv: x, B and C of every head and group (H·P + 2·G·N)."""
    return config.num_heads * config.head_dim + 2 * config.n_groups * config.state_size


def state_shapes(config) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """One slot's (conv state, ssm state) shapes for an HF Mamba2 config: ((W-1, conv_dim), (H, P, N)).

    The one formula the layers (``Mamba2Mixer.get_state_shape``) and vLLM's start-up sizing
    (``get_mamba_state_shape_from_config``) share. Not vLLM's ``MambaStateShapeCalculator.mamba2_state_shape``:
    that orients the conv state by vLLM's global conv-state layout switch, and the plugin's kernels read "SD"
    (channel innermost) whatever it says."""
    return (config.conv_kernel - 1, conv_dim(config)), (config.num_heads, config.head_dim, config.state_size)


@dataclass(frozen=True)
class Mamba2StateSpec(MambaSpec):
    """MambaSpec for the plugin's Mamba2 mixer layers (same fields, own manager)."""
