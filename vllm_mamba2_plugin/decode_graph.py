"""The state slots a FULL decode CUDA graph reads, and the reset of the slots of fresh rows it runs.

With FULL decode graphs (backend.py) the runner replays a graph captured for a batch size whenever a step's rows
are all one token, padding the batch to that size. A captured graph keeps the addresses of its inputs, so:

1. **One persistent buffer per index dtype** (int64 for mamba-ssm's state update, int32 for causal-conv1d's
   update), allocated once at the largest captured batch. Every batch a graph may replay writes its slots into a
   prefix of these buffers, at capture and at every replay, never into a new tensor; metadata of any other
   batch would leave the buffers holding the previous graph step's slots, and the replay would advance those
   requests a second time.
2. **Padding rows hold PAD_SLOT (-1)**: both decode kernels skip such rows (no state read or written, output 0).
   A padding row must never hold a real slot: every padding row would read and write it.
3. **A fresh one-token row runs as a decode from a zeroed state** (a one-token decode from zero is that token's
   prefill), so its slot's conv and SSM states are zeroed in every layer of the group before the step: vLLM
   hands a slot over as its last owner left it. Capture rows are dummies and reset nothing.

Under speculative decoding a graph's batch is R rows of m = 1 + k tokens each (vLLM's uniform decode batch:
padding requests have no token, and the padded token count is R * m; spec_decode.UniformVerify). Each row's
source slot and the (m, R) destination slots go into persistent buffers as above, except that
**padding rows hold slot 0**, vLLM's null block (never a request's: its runner fills padding requests' block
tables with it), because the verification step also copies states between slots by index, which -1 cannot
address; whatever they leave in slot 0 no request reads. A fresh row (a prompt of m tokens, or a one-token
prompt padded with placeholder drafts) starts from its zeroed source slot, as rule 3. With prefix caching a
third buffer holds each row's last destination slot in int32 (the conv update's slot: spec_decode.UniformVerify).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from .spec_decode import UniformVerify

PAD_SLOT = -1  # slot id of a padding row: the decode kernels skip it
NULL_SLOT = 0  # vLLM's null block: the padding rows' slot in a verification step (module docstring)


class DecodeGraphSlots:
    """The persistent slot buffers of one KV-cache group's FULL decode graphs (invariants: module docstring).
    ``pools()`` yields every state pool (conv and SSM, every layer) of the group, for ``zero``."""

    def __init__(self, max_batch: int, device, pools: Callable[[], Iterable[torch.Tensor]], ring: int = 1,
                 prefix_caching: bool = False):
        self.max_batch = max_batch
        self._pools = pools
        self.slots = torch.full((max_batch,), PAD_SLOT, dtype=torch.int64, device=device)
        self.slots_i32 = torch.full((max_batch,), PAD_SLOT, dtype=torch.int32, device=device)
        self.ring = ring
        if ring > 1:  # speculative decoding: each row's source slot, its destination slot per token, the work rows
            self.rows = torch.arange(max_batch, dtype=torch.int64, device=device)
            self.verify_src = torch.full((max_batch,), NULL_SLOT, dtype=torch.int64, device=device)
            self.verify_src_i32 = torch.full((max_batch,), NULL_SLOT, dtype=torch.int32, device=device)
            self.verify_dst = torch.full((ring, max_batch), NULL_SLOT, dtype=torch.int64, device=device)
            self.verify_last_i32 = (torch.full((max_batch,), NULL_SLOT, dtype=torch.int32, device=device)
                                    if prefix_caching else None)

    def write(self, running: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers' first ``num_rows`` entries (int64, int32 views of the persistent buffers): the real rows'
        slots ``running`` ((num_real,) int64), then PAD_SLOT for the padding rows."""
        self.check_batch(num_rows)
        num_real = running.numel()
        slots, slots_i32 = self.slots[:num_rows], self.slots_i32[:num_rows]
        slots[:num_real].copy_(running, non_blocking=True)
        slots[num_real:].fill_(PAD_SLOT)
        slots_i32.copy_(slots)
        return slots, slots_i32

    def write_verify(self, slots: torch.Tensor, num_rows: int) -> UniformVerify:
        """The plan of a batch of ``num_rows`` rows of ``ring`` tokens, as views of the persistent buffers.
        slots: (num_real, ring + 1) int64 device, each real row's ring columns in the order it reads and writes
        them (column 0 the state before its first token, column j + 1 the state after token j); the padding rows
        get NULL_SLOT."""
        self.check_batch(num_rows)
        num_real = slots.shape[0]
        src, src_i32, dst = self.verify_src[:num_rows], self.verify_src_i32[:num_rows], self.verify_dst[:, :num_rows]
        src[:num_real].copy_(slots[:, 0], non_blocking=True)
        dst[:, :num_real].copy_(slots[:, 1:].t(), non_blocking=True)
        src[num_real:].fill_(NULL_SLOT)
        dst[:, num_real:].fill_(NULL_SLOT)
        src_i32.copy_(src)
        last_i32 = None
        if self.verify_last_i32 is not None:
            last_i32 = self.verify_last_i32[:num_rows]
            last_i32.copy_(dst[-1])
        return UniformVerify(src, src_i32, dst, self.rows[:num_rows], last_i32)

    def check_batch(self, num_rows: int) -> None:
        """Refuse a graph batch larger than the buffers (a capture size above max_num_seqs)."""
        if num_rows > self.max_batch:
            raise ValueError(
                f"vllm-mamba2-plugin: a FULL decode CUDA graph of {num_rows} requests exceeds the "
                f"{self.max_batch} persistent state slots; keep cudagraph capture sizes <= max_num_seqs")

    def zero(self, slots: torch.Tensor) -> None:
        """Zero the conv and SSM states of ``slots`` ((n,) int64, on the pools' device) in every layer."""
        if slots.numel() == 0:
            return
        for pool in self._pools():
            pool.index_fill_(0, slots, 0)
