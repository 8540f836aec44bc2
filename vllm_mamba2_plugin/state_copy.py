"""The state moves of vLLM's prefix-caching "align" runner, for all of a request's layers at once.

Before a step's forward pass, vLLM's V1 runner (``v1/worker/mamba_utils.preprocess_mamba``) moves each request
whose running block changes (every cache hit, every prefill chunk that crosses a block) to its new block. In
Python, for every (such request, layer, state), it calls the model's copy function -- vLLM's
``get_conv_copy_spec`` / ``get_temporal_copy_spec``, which the model keeps returning (vLLM 0.32's V2 runner
accepts no others) -- for the source address and element count, indexes the pool again for the destination, and
collects them for one batched copy kernel: two indexings of the pool (dispatched torch ops, microseconds of host
time each) per entry, 51 x 64 x 2 entries in a 2.7b step of 51 cache hits. ``PoolLayout`` computes the same
entries from each pool's base address and strides, in numpy (patches.py, patch 3). The plugin's conv state is
always "SD" ((W-1, D) per block, channel innermost: ``spec.state_shapes``), which is what vLLM's conv copy spec
computes for the default layout. ``tests/test_patches.py`` checks the entries against vLLM's loop.
"""

from dataclasses import dataclass

import numpy as np


@dataclass
class PoolLayout:
    """The state pools of a KV-cache group's layers as arrays, one entry per (layer, state) in the runner's order
    (layer by layer, conv then SSM): base address, bytes per block, bytes of the whole state, and for the conv
    state its rows and the bytes of one row (a speculative step's accepted tokens shift the copied window by whole
    rows; 0 rows for the SSM state). ``fill`` writes vLLM's copy specs of one request's move for every entry at
    once. ``pools``: the pool tensors it was built from (``current``)."""

    base: np.ndarray
    block_bytes: np.ndarray
    state_bytes: np.ndarray
    rows: np.ndarray
    row_bytes: np.ndarray
    is_conv: np.ndarray
    pools: tuple

    @classmethod
    def of(cls, layer_names, forward_context) -> "PoolLayout":
        cols = {k: [] for k in ("base", "block_bytes", "state_bytes", "rows", "row_bytes", "is_conv")}
        pools = []
        for name in layer_names:
            for i, state in enumerate(forward_context[name].kv_cache):
                es, conv = state.element_size(), i == 0
                n = 1
                for d in state.shape[1:]:
                    n *= d
                for k, v in (("base", state.data_ptr()), ("block_bytes", state.stride(0) * es),
                             ("state_bytes", n * es), ("rows", state.shape[1] if conv else 0),
                             ("row_bytes", state.stride(1) * es if conv else 0), ("is_conv", conv)):
                    cols[k].append(v)
                pools.append(state)
        arrays = {k: np.asarray(v, dtype=bool if k == "is_conv" else np.int64) for k, v in cols.items()}
        return cls(**arrays, pools=tuple(pools))

    def current(self, layer_names, forward_context) -> bool:
        """Every layer still has the very pool tensors the layout was built from (a re-allocation, or another
        engine's layers under the same names, rebuilds it)."""
        it = iter(self.pools)
        return all(state is next(it, None) for name in layer_names for state in forward_context[name].kv_cache)

    def fill(self, copy_bufs, offset: int, block_ids, src_idx: int, dst_idx: int, accept_bias: int) -> int:
        """Entries [offset, offset + n) of the runner's copy buffers for one request (accept_bias >= 0); returns
        the new offset. conv: ``state[block_ids[src_idx], accept_bias:]``; SSM:
        ``state[block_ids[src_idx + accept_bias]]``; destination ``state[block_ids[dst_idx]]``."""
        n = len(self.base)
        shift = np.minimum(accept_bias, self.rows) * self.row_bytes  # the conv window's shift (0 for the SSM state)
        src = np.where(self.is_conv, block_ids[src_idx], block_ids[src_idx + accept_bias])
        copy_bufs.src_ptrs.np[offset: offset + n] = self.base + src * self.block_bytes + shift
        copy_bufs.dst_ptrs.np[offset: offset + n] = self.base + block_ids[dst_idx] * self.block_bytes
        copy_bufs.sizes.np[offset: offset + n] = self.state_bytes - shift
        return offset + n
