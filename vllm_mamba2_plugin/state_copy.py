"""The copy specs of vLLM's prefix-caching "align" runner: where the state to copy starts, and its length.

Before a step's forward pass, vLLM 0.26's runner (``v1/worker/mamba_utils.preprocess_mamba``) moves each
request whose running block changes (every cache hit, every prefill chunk that crosses a block) to its new block:
in Python, for every (such request, layer, state), it calls the model's copy function for the source address
and element count and collects them for one batched copy kernel. A step of 51 cache hits at the 2.7b shape makes
51 x 64 x 2 calls. vLLM's own functions (``get_conv_copy_spec`` / ``get_temporal_copy_spec``) index the state
tensor for it (a select and a slice: dispatched torch ops, several microseconds of host time each) and read the
conv-state layout switch from the environment per call; these compute the same numbers from the tensor's base
address and strides. The conv state is always "SD" here (``spec.state_shapes``: (W-1, D) per block, channel
innermost, whatever vLLM's layout switch says). ``tests/test_state_copy.py`` checks them against vLLM's.

Signature (vLLM's ``MambaStateCopyFunc``): (state pool (blocks, ...), the request's block ids, the index of the
source block among them, accepted tokens) -> MambaCopySpec(start_addr, num_elements).
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import compat


def conv_copy_spec(state, block_ids, cur_block_idx: int, num_accepted_tokens: int):
    """The conv state of block ``block_ids[cur_block_idx]`` from row num_accepted_tokens - 1 on: with speculative
    tokens the window shifts by the accepted ones (``state[block, offset:]``)."""
    block, offset = block_ids[cur_block_idx], min(num_accepted_tokens - 1, state.shape[1])
    start = state.data_ptr() + (block * state.stride(0) + offset * state.stride(1)) * state.element_size()
    return compat.MambaCopySpec(start_addr=start, num_elements=(state.shape[1] - offset) * state.shape[2])


def ssm_copy_spec(state, block_ids, cur_block_idx: int, num_accepted_tokens: int):
    """The whole SSM state of block ``block_ids[cur_block_idx + num_accepted_tokens - 1]``."""
    block = block_ids[cur_block_idx + num_accepted_tokens - 1]
    start = state.data_ptr() + block * state.stride(0) * state.element_size()
    n = 1
    for d in state.shape[1:]:
        n *= d
    return compat.MambaCopySpec(start_addr=start, num_elements=n)


STATE_COPY_FUNCS = (conv_copy_spec, ssm_copy_spec)  # in the order of the layer's states: (conv, ssm)


@dataclass
class PoolLayout:
    """The state pools of a KV-cache group's layers as arrays, one entry per (layer, state) in the runner's order
    (layer by layer, conv then SSM): base address, bytes per block, bytes of the whole state, and for the conv
    state its rows and the bytes of one row (a speculative step's accepted tokens shift the copied window by whole
    rows; 0 rows for the SSM state). ``fill`` writes what the copy specs above give for one request's move, for
    every entry at once (patches.py, patch 3)."""

    base: np.ndarray
    block_bytes: np.ndarray
    state_bytes: np.ndarray
    rows: np.ndarray
    row_bytes: np.ndarray
    is_conv: np.ndarray
    first: Optional[tuple]  # (layer name, base address of its first pool): where the pools were

    @classmethod
    def of(cls, layer_names, forward_context) -> "PoolLayout":
        cols = {k: [] for k in ("base", "block_bytes", "state_bytes", "rows", "row_bytes", "is_conv")}
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
        arrays = {k: np.asarray(v, dtype=bool if k == "is_conv" else np.int64) for k, v in cols.items()}
        return cls(**arrays, first=(layer_names[0], cols["base"][0]) if layer_names else None)

    def current(self, forward_context) -> bool:
        """The pools are still where they were (vLLM allocates them once; a re-allocation rebuilds the layout)."""
        return self.first is None or forward_context[self.first[0]].kv_cache[0].data_ptr() == self.first[1]

    def fill(self, copy_bufs, offset: int, block_ids, src_idx: int, dst_idx: int, accept_bias: int) -> int:
        """Entries [offset, offset + n) of the runner's copy buffers for one request; returns the new offset."""
        n = len(self.base)
        shift = np.minimum(accept_bias, self.rows) * self.row_bytes  # conv_copy_spec's window shift (0: SSM)
        src = np.where(self.is_conv, block_ids[src_idx], block_ids[src_idx + accept_bias])
        copy_bufs.src_ptrs.np[offset: offset + n] = self.base + src * self.block_bytes + shift
        copy_bufs.dst_ptrs.np[offset: offset + n] = self.base + block_ids[dst_idx] * self.block_bytes
        copy_bufs.sizes.np[offset: offset + n] = self.state_bytes - shift
        return offset + n
