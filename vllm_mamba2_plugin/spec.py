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


@dataclass(frozen=True)
class Mamba2StateSpec(MambaSpec):
    """MambaSpec for the plugin's Mamba2 mixer layers (same fields, own manager)."""
