"""Mamba2StateSpec: the per-request state the plugin's layers ask vLLM's KV-cache allocator for, and the sizes
one tensor-parallel rank holds (docs/parallelism.md).

Two states per layer per request slot (one block = one slot, prefix caching off), per TP rank:
    conv state (conv_kernel - 1, conv_dim / tp)   the last W-1 conv inputs, channel innermost ("SD" layout)
    ssm state  (num_heads / tp, head_dim, d_state)

It subclasses MambaSpec and adds no fields: every branch of vLLM's v1 engine tests
``isinstance(spec, MambaSpec)``, so allocation, page sizing, grouping and scheduling treat it as Mamba state,
while KVCacheSpecRegistry (which walks the MRO) hands it to our own manager.
"""

from dataclasses import dataclass

from vllm.v1.kv_cache_interface import MambaSpec


def valid_tp_sizes(config) -> list[int]:
    """TP sizes the model splits by: tp divides num_heads, and n_groups too unless n_groups == 1 (then every rank
    keeps a copy of the one group), as vLLM's in-tree MambaMixer2 requires."""
    H, G = config.num_heads, config.n_groups
    return [tp for tp in range(1, H + 1) if H % tp == 0 and (G % tp == 0 or G == 1)]


def extended_groups(config, tp: int = 1) -> int:
    """G_ext: groups counted across all ranks, copies included. n_groups, or tp when the single group is copied
    to every rank (vLLM's ``extra_groups_for_head_shards``)."""
    return tp if config.n_groups == 1 and tp > 1 else config.n_groups


def local_groups(config, tp: int = 1) -> int:
    """Groups of B and C one rank holds: n_groups / tp, or the one copied group."""
    return extended_groups(config, tp) // tp


def conv_dim(config, tp: int = 1) -> int:
    """Channels of the depthwise conv on one rank: its x, B and C (H·P/tp + 2·G_local·N)."""
    return config.num_heads * config.head_dim // tp + 2 * local_groups(config, tp) * config.state_size


def state_shapes(config, tp: int = 1) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """One slot's (conv state, ssm state) shapes on one of ``tp`` ranks for an HF Mamba2 config:
    ((W-1, conv_dim / tp), (H/tp, P, N)).

    The one formula the layers (``Mamba2Mixer.get_state_shape``) and vLLM's start-up sizing
    (``get_mamba_state_shape_from_config``) share. Not vLLM's ``MambaStateShapeCalculator.mamba2_state_shape``:
    that orients the conv state by vLLM's global conv-state layout switch, and the plugin's kernels read "SD"
    (channel innermost) whatever it says."""
    return ((config.conv_kernel - 1, conv_dim(config, tp)),
            (config.num_heads // tp, config.head_dim, config.state_size))


@dataclass(frozen=True)
class Mamba2StateSpec(MambaSpec):
    """MambaSpec for the plugin's Mamba2 mixer layers (same fields, own manager)."""
