"""Mamba2StateManager: the cache manager for Mamba2StateSpec.

vLLM's MambaManager already does what the plugin needs with mamba_cache_mode "none": each running request
owns exactly one block, which is its state slot, and the slot goes back to the pool when the request ends.
This subclass pins that contract: it refuses the prefix-caching modes ("all"/"align"), which the plugin's
kernels do not implement (they would need per-block state checkpoints), instead of letting them half-run.
"""

from vllm.v1.core.single_type_kv_cache_manager import MambaManager

from .spec import Mamba2StateSpec


class Mamba2StateManager(MambaManager):
    def __init__(self, kv_cache_spec: Mamba2StateSpec, *args, **kwargs) -> None:
        mode = getattr(kv_cache_spec, "mamba_cache_mode", "none")
        if mode != "none":
            raise ValueError(
                f"vllm-mamba2-plugin supports mamba_cache_mode='none' only (got {mode!r}): "
                "prefix caching is not supported yet; run without --enable-prefix-caching"
            )
        super().__init__(kv_cache_spec, *args, **kwargs)
