"""Speculative decoding: the state ring that makes a verification step's rollback exact.

With ``--speculative-config`` a step gives each decoding request up to 1 + k query tokens: the token sampled last
step and up to k drafted ones. The model runs them all; the sampler keeps a prefix, and the next step starts after
the last accepted token. An SSM cannot drop tokens from its state, so the state after every token of the step is
kept, and the next step starts from the right one.

The ring (num_speculative_blocks = k extra blocks per request, m = 1 + k state slots in its block-table row): the
state after the token at position p (0-based, of the whole sequence) lives in column ``ring_column(p)`` =
(-1 - p) mod m. A step's tokens at positions c .. c+q-1 (c = tokens computed before it, q <= m) read the column of
c-1 and write those of c .. c+q-1. Any m consecutive positions have distinct columns, so within a step no column
is written twice, and the one read first is overwritten last (by position c+m-1), after it was read. Rejection
only lowers the next step's c, so the next step reads the column of its own last computed token: no
accepted-token count is needed (the scheduler's num_computed_tokens says it all). Without speculation m = 1 and
every state is column 0, the plain layout.

With prefix caching (blocks of bs tokens, bs a multiple of m) the ring moves along the row with the sequence: the
column is p // bs + (-1 - p) mod m. A block boundary's position p = t·bs - 1 has column t - 1, the block vLLM
hashes for tokens [0, t·bs), so the cached state is where a cache hit reads it, and it is the last position to
write that column: every later position writes columns >= t. Any m consecutive positions still have distinct
columns (bs a multiple of m), all within the row's live blocks (the block of c-1 up to the block of the step's
last token + k: what vLLM's Mamba manager allocates with k speculative blocks). The runner's own "align" moves,
which would put a state where vLLM's layout expects it, are skipped (patches.py, 3).

The tokens of a decoding request run one position at a time through the decode kernels (the upstream one-token
updates, which update a slot in place): position i copies the state of its source column into its destination
column, then updates that slot (a uniform batch of 1 + k tokens per row follows ``UniformVerify`` instead:
mixer._verify_uniform). So the outputs and states are the plain decode step's, token for token. A row on the
prefill path short enough to carry drafts keeps its state after every token too (``prefill_ring``).
docs/speculative-decoding.md has the whole design.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from .kernels.interface import block_boundary_offsets, upload


def ring_column(positions: torch.Tensor, ring: int, block_size: int = 0) -> torch.Tensor:
    """The block-table column of the state after each position (host int64, -1: before the first token, column
    0 of block 0), for a ring of ``ring`` states; ``block_size``: prefix caching's blocks (0: none)."""
    base = positions.clamp(min=0) // block_size if block_size else 0
    return base + (-1 - positions) % ring


@dataclass(frozen=True)
class VerifyPosition:
    """Position i of a step's decoding rows: the n rows with more than i query tokens.

    tokens:  (n,) int64 device: each token's row in the step's decode block
    src:     (n,) int64 device: the slot holding the state before the token (the ring column of position - 1)
    dst:     (n,) int64 device: the slot that holds the state after it
    dst_i32: the same as dst, int32 (the conv kernel's index type)
    """

    tokens: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    dst_i32: torch.Tensor


class UniformVerify(NamedTuple):
    """A decode block of R rows of m = 1 + k tokens each (the FULL-graph plan, decode_graph.py): row r's tokens are
    rows r*m .. r*m + m - 1 of the block. A row reads its column before its first token and writes all m columns;
    without prefix caching the last token's column is the one read first.

    src:      (R,) int64 device: each row's slot before its first token
    src_i32:  the same, int32 (the conv kernel's index type)
    dst:      (m, R) int64 device: dst[j] the slots of the states after token j (dst[m - 1] == src without prefix
              caching)
    rows:     (R,) int64 device, 0 .. R - 1: the slots of the mixer's work copy of the rows' states
    last_i32: with prefix caching, (R,) int32 device, dst[m - 1]: the conv update runs on a copy of the source state
              there, since the source may be a cached block's (a hit's or a boundary's), which must stay as it is
    """

    src: torch.Tensor
    src_i32: torch.Tensor
    dst: torch.Tensor
    rows: torch.Tensor
    last_i32: Optional[torch.Tensor] = None


def verify_positions(table: torch.Tensor, query_start_cpu: torch.Tensor, context_lens: torch.Tensor,
                     ring: int, block_size: int = 0) -> tuple[VerifyPosition, ...]:
    """The positions of a decode block of R rows (query_start_cpu (R+1,) host bounds from 0, context_lens (R,)
    host, every row resuming: context > 0), built on the host and uploaded once. table: the rows' block-table
    rows (R, >= ring) on the device; block_size: prefix caching's (0: none)."""
    starts, ends = query_start_cpu[:-1].tolist(), query_start_cpu[1:].tolist()
    context = context_lens.tolist()
    rows, positions, tokens, sizes = [], [], [], []
    for i in range(max((e - s for s, e in zip(starts, ends)), default=0)):
        active = [r for r, (s, e) in enumerate(zip(starts, ends)) if e - s > i]
        rows += active
        positions += [context[r] + i for r in active]
        tokens += [starts[r] + i for r in active]
        sizes.append(len(active))
    positions = torch.tensor(positions, dtype=torch.int64)
    src, dst = ring_column(positions - 1, ring, block_size), ring_column(positions, ring, block_size)
    dev = upload(torch.stack([torch.tensor(rows, dtype=torch.int64), src, dst,
                              torch.tensor(tokens, dtype=torch.int64)]), table.device)
    src_slots = table[dev[0], dev[1]].to(torch.int64)
    dst_slots = table[dev[0], dev[2]].to(torch.int64)
    dst_i32 = dst_slots.to(torch.int32)
    return tuple(VerifyPosition(*parts) for parts in zip(dev[3].split(sizes), src_slots.split(sizes),
                                                           dst_slots.split(sizes), dst_i32.split(sizes)))


class PrefillRing(NamedTuple):
    """Where a step's prefill rows keep their states in the ring (spec_decode's module docstring)."""

    slots: torch.Tensor  # (S,) int64 device: the column of each row's last token (its final state)
    initial_slots: torch.Tensor  # (S,) int64 device: the column of the token before its first (a resumed state)
    boundary_offsets: Optional[list]  # per row, the token counts after which a state is kept; None: none anywhere
    boundary_slots: Optional[torch.Tensor]  # (M,) int64 device: their columns, in order


def prefill_ring(table: torch.Tensor, context_lens: torch.Tensor, query_lens: torch.Tensor,
                 ring: int, block_size: int = 0) -> PrefillRing:
    """The ring's slots for rows on the prefill path (table: their block-table rows; context_lens, query_lens:
    host). A row of at most ``ring`` tokens may carry drafts (vLLM pads a one-token prompt with placeholder drafts
    to keep decode batches uniform, and a row the runner did not sort among the decodes is still verified): its
    state after every token is kept, as the verification positions keep theirs. With prefix caching
    (``block_size``) a row also keeps the state at each block boundary it crosses, in that block."""
    context, queries = context_lens.tolist(), query_lens.tolist()
    S = len(queries)
    offsets = []
    for c, q in zip(context, queries):
        kept = set(range(1, q)) if q <= ring else set()
        if block_size:
            kept.update(block_boundary_offsets(c, q, block_size))
        offsets.append(sorted(kept))
    rows = list(range(S)) * 2 + [r for r in range(S) for _ in offsets[r]]
    positions = ([c + q - 1 for c, q in zip(context, queries)] + [c - 1 for c in context]
                 + [context[r] + o - 1 for r in range(S) for o in offsets[r]])
    cols = ring_column(torch.tensor(positions, dtype=torch.int64), ring, block_size)
    dev = upload(torch.stack([torch.tensor(rows, dtype=torch.int64), cols]), table.device)
    slots, initial, boundary = table[dev[0], dev[1]].to(torch.int64).split([S, S, len(rows) - 2 * S])
    if not boundary.numel():
        return PrefillRing(slots, initial, None, None)
    return PrefillRing(slots, initial, offsets, boundary)
