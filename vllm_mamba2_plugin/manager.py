"""Mamba2StateManager: the cache manager for Mamba2StateSpec.

Without prefix caching (mamba_cache_mode "none") vLLM's MambaManager does what the plugin needs: each running
request owns exactly one block, which is its state slot, and the slot goes back to the pool when the request
ends.

With prefix caching the config asks vLLM for "align" (docs/prefix-caching.md): the runner then copies the state of
the last computed token's block into the block of the step's last token, and the scheduler ends prefill chunks on
block boundaries. vLLM's scheduler would also stop every chunk at its prompt's last boundary; the plugin's layers
write every boundary's state wherever it falls in a step, so building this manager lets a prompt's last chunk run
to its end (patches.py, 4). vLLM's align manager would leave the blocks in between null, keeping one state per
scheduled chunk; this manager allocates a block for every boundary instead and frees each block once a later one
holds the request's state, keeping its hash, so it stays a cache hit until evicted
(tests/test_spec_manager.py checks the block ids step by step).

Under speculative decoding a step may accept drafts across a block boundary; vLLM hashes that block only at the
next step's allocation, after freeing the blocks before the last computed token's. So the manager keeps the k
blocks' worth of tokens before it too (a boundary k or fewer tokens back), and the block is cached.
"""

from vllm.v1.core.single_type_kv_cache_manager import MambaManager

from . import patches
from .spec import Mamba2StateSpec

# MambaManager tests its mode only for "align" (vLLM 0.26 and 0.32); under any other mode it allocates a block
# per block_size tokens and frees the blocks before the last computed token's (get_num_skipped_tokens). "none" is
# a mode both releases define (0.32 dropped 0.26's "all").
EVERY_BOUNDARY = "none"


class Mamba2StateManager(MambaManager):
    def __init__(self, kv_cache_spec: Mamba2StateSpec, *args, **kwargs) -> None:
        mode = getattr(kv_cache_spec, "mamba_cache_mode", "none")
        if mode not in ("none", "align"):
            raise ValueError(
                f"vllm-mamba2-plugin supports mamba_cache_mode 'none' and 'align' (got {mode!r}): leave "
                "--mamba-cache-mode unset"
            )
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.every_boundary = mode == "align"
        if self.every_boundary:
            self.mamba_cache_mode = EVERY_BOUNDARY
            patches.install_scheduler()

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        if self.every_boundary and self.num_speculative_blocks:
            return max(num_computed_tokens - 1 - self.num_speculative_blocks, 0)
        return super().get_num_skipped_tokens(num_computed_tokens)
