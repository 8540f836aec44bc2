"""Plain-PyTorch Mamba-2 kernels: the CPU compute path of the plugin and the oracle for the CUDA path.

No vLLM, no mamba_ssm: only torch. Everything runs on whatever device the inputs live on, but it is written
for CPU (float32 and bfloat16 inputs; all arithmetic is done in float32).

Notation follows the Mamba-2 paper ("Transformers are SSMs", Dao & Gu 2024) and mamba-ssm's
``modules/ssd_minimal.py``:

    T  packed tokens (all sequences of the batch back to back)      S  sequences, bounds in cu_seqlens (S+1,)
    H  heads            P  head dim            G  B/C groups (head h reads group h // (H // G))
    N  state size       W  conv width          D  conv channels (conv_dim) -- or the skip vector D(H,)
    l / s  positions inside a chunk (l = output/target, s = source),  c  chunk index

The selective SSM, per head, with a scalar-times-identity A (the SSD restriction):

    h_t = exp(dt_t * A) h_{t-1} + dt_t * x_t ⊗ B_t          h: (P, N)
    y_t = h_t · C_t  (+ D * x_t)

Unrolled, y_l = sum_{s <= l} (C_l · B_s) * exp(sum_{k=s+1..l} dt_k A) * dt_s x_s + C_l · (decay_{0..l} h_0),
a masked (causal) "attention" whose mask is the 1-semiseparable decay matrix L = exp(segsum(dt A)).
The chunked algorithm computes that quadratic form inside chunks and passes states between chunks.

State layouts match what vLLM allocates per slot (docs/architecture.md §2):
    conv state (W-1, D)  -- the last W-1 inputs, oldest first, channel innermost ("SD" layout)
    ssm state  (H, P, N)
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .interface import ConvResult, PrefillBatch, ScanResult

STATE_UPDATE_INDEX_DTYPE = torch.int64  # (interface.Mamba2Kernels) any integer type indexes the pool

__all__ = [
    "segsum",
    "plan_prefill",
    "ssd_chunk_scan",
    "causal_conv1d",
    "conv_states_at",
    "conv_update",
    "ssm_state_update",
    "process_dt",
    "gated_rms_norm",
    "warm_up",
]


# --------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------


def segsum(a: torch.Tensor) -> torch.Tensor:
    """Stable segment sum: out[..., i, j] = sum_{k=j+1..i} a[..., k] for i >= j, -inf above the diagonal.

    a: (..., L)  ->  (..., L, L)

    exp(segsum(a)) is the 1-semiseparable decay matrix L of the paper (zero above the diagonal).
    Computed as a masked cumsum rather than ``cumsum[i] - cumsum[j]`` so that no large, nearly equal partial
    sums are subtracted (same trick as ssd_minimal.segsum).
    """
    L = a.size(-1)
    a = a[..., None].expand(*a.shape, L)  # (..., L(i), L(j)) with value a[i]
    strict = torch.ones(L, L, dtype=torch.bool, device=a.device).tril(-1)
    a = a.masked_fill(~strict, 0.0)  # keep a[i] only for j < i, i.e. k in (j, i]
    out = torch.cumsum(a, dim=-2)  # sum over i' <= i of a[i'] (for i' > j)
    lower = torch.ones(L, L, dtype=torch.bool, device=a.device).tril(0)
    return out.masked_fill(~lower, float("-inf"))


def seq_bounds(batch: PrefillBatch) -> list:
    """The batch's host bounds as a list, checked non-decreasing."""
    cu = batch.cu_seqlens_cpu.tolist()
    if any(b < a for a, b in zip(cu[:-1], cu[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu}")
    return cu


def plan_prefill(cu_seqlens_cpu, has_initial_state_cpu, num_tokens, chunk_size, conv_width, device,
                 boundary_offsets=None):
    """The reference kernels work from the batch's bounds directly: no per-step plan (see cuda.plan_prefill)."""
    return None


def warm_up(layer, projected, decode_graphs):
    """Nothing to compile or autotune (see cuda.warm_up)."""


def row_range(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """t[a:b], without a slice op when that is all of t (a prefill-only step without padding, the usual case):
    prefill steps are host-bound, and each torch op costs a few microseconds of host time per layer."""
    return t if a == 0 and b == t.shape[0] else t[a:b]


def select_initial(
    initial_states: Optional[torch.Tensor],
    has_initial_state: Optional[torch.Tensor],
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Per-sequence start state: initial_states where has_initial_state, else zeros.

    vLLM never zeroes a state slot on allocation, so a fresh request's slot may hold anything, NaN included.
    torch.where (not a multiply by 0/1) keeps such garbage out: NaN * 0 is still NaN.
    """
    if initial_states is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    init = initial_states.to(dtype)
    if tuple(init.shape) != tuple(shape):
        raise ValueError(f"initial_states has shape {tuple(init.shape)}, expected {tuple(shape)}")
    if has_initial_state is None:
        return init
    keep = has_initial_state.to(device=device, dtype=torch.bool).view(-1, *([1] * (len(shape) - 1)))
    return torch.where(keep, init, torch.zeros(shape, dtype=dtype, device=device))


def heads_per_group(H: int, G: int) -> int:
    """H // G, refusing a head count that the groups do not divide."""
    if G <= 0 or H % G != 0:
        raise ValueError(f"nheads ({H}) must be a multiple of ngroups ({G})")
    return H // G


# --------------------------------------------------------------------------------------------------------
# SSD (selective state space, Mamba-2) scan
# --------------------------------------------------------------------------------------------------------


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    batch: PrefillBatch,
    initial_states: Optional[torch.Tensor] = None,
    D: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_limit: Tuple[float, float] = (0.0, float("inf")),
    state_dtype: torch.dtype = torch.float32,
) -> ScanResult:
    """Chunked SSD scan over a packed varlen batch.

    x: (T, H, P)  dt: (T, H) already processed (softplus(dt+bias), clamped) -- positive step sizes; or raw
      when dt_bias (H,) is given: then dt = process_dt(dt, dt_bias, dt_limit) first
    A: (H,) negative reals   B, C: (T, G, N) with H % G == 0 (head h uses group h // (H//G))
    batch: the sequence bounds (S+1,) in the packed token dim, which sequences resume, the chunk length
      (``interface.PrefillBatch``)
    initial_states: (S, H, P, N) or None (zeros). Sequences that do not resume (batch.resumes False) start
      from zeros EVEN IF initial_states holds garbage (NaN/inf included).
    D: (H,) (or (H, P)) or None -> y += D[h] * x
    returns ScanResult: y (T, H, P) in x.dtype, final_states (S, H, P, N) in state_dtype (computed in float32)
    Tokens outside [cu_seqlens[0], cu_seqlens[-1]) (e.g. padding) get y = 0.
    With batch.boundary_offsets (per sequence, token counts 0 < o <= its length, ascending) also
    boundary_states, (M, H, P, N) in state_dtype: the state after the first o tokens of each, in order (M
    offsets in all). (Prefix caching keeps the states at block boundaries.) They are the states entering
    chunks: the chunk length is cut to divide every offset, which changes the cost, not the result.

    Recurrence: h_t = exp(dt_t*A) h_{t-1} + dt_t * x_t ⊗ B_t ; y_t = h_t · C_t (+ D x_t).

    Algorithm (ssd_minimal, made varlen): each sequence is cut into chunks of chunk_size (the last one padded
    with dt = 0, x = B = C = 0: a padded step has decay exp(0) = 1 and no input, so it changes no state and
    its output is dropped). All chunks of all sequences are then processed together:
      1. intra-chunk outputs, the quadratic masked form  Y_diag = (C B^T ∘ L) (dt x)
      2. each chunk's own end state, as if it started from zero
      3. inter-chunk state passing: a short sequential loop over chunk index, all sequences at once
      4. the contribution of the incoming state to each chunk's outputs  Y_off = C · (decay h_prev)
    One function on purpose (the length is the docstring and the four steps): like ssd_minimal, the oracle reads
    top to bottom in the paper's notation, every step on the same chunk layout.
    """
    T, H, P = x.shape
    G, N = B.shape[-2], B.shape[-1]
    R = heads_per_group(H, G)  # heads per group
    cs = int(batch.chunk_size)
    if cs <= 0:
        raise ValueError("chunk_size must be positive")
    dev = x.device
    f32 = torch.float32
    boundary_offsets = batch.boundary_offsets

    cu = seq_bounds(batch)
    S = len(cu) - 1
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    # The result does not depend on the chunk length, only the cost does: when every sequence is shorter
    # than a chunk, one chunk of the longest length avoids padding short prompts to the model's chunk_size
    # (the quadratic intra-chunk part would otherwise cost chunk_size^2 per chunk).
    cs = max(1, min(cs, max(lens, default=1)))
    if boundary_offsets is not None:
        cs = _boundary_chunk(cs, lens, boundary_offsets)
    nch = [(n + cs - 1) // cs for n in lens]
    n_chunks = sum(nch)
    max_nch = max(nch, default=0)

    if dt_bias is not None:
        dt = process_dt(dt, dt_bias, dt_limit)
    h0 = select_initial(initial_states, batch.resumes, (S, H, P, N), f32, dev)

    if n_chunks == 0:  # every offset is > 0: no sequence has one
        none = None if boundary_offsets is None else h0.new_zeros(0, H, P, N, dtype=state_dtype)
        return ScanResult(x.new_zeros(T, H, P), h0.to(state_dtype, copy=True), none)

    # ---- gather tokens into (c, l) chunk layout; index T points at an all-zero pad row ----------------
    seq_lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
    seq_start_t = torch.tensor(cu[:-1], dtype=torch.long, device=dev)
    chunk_seq = torch.repeat_interleave(torch.arange(S, device=dev), torch.tensor(nch, device=dev))  # (c,)
    first_chunk = torch.tensor([0] + nch[:-1], dtype=torch.long, device=dev).cumsum(0)  # (S,)
    chunk_k = torch.arange(n_chunks, device=dev) - first_chunk[chunk_seq]  # chunk index within its sequence
    pos = chunk_k[:, None] * cs + torch.arange(cs, device=dev)[None, :]  # (c, l) position within sequence
    valid = pos < seq_lens_t[chunk_seq][:, None]
    tok = torch.where(valid, seq_start_t[chunk_seq][:, None] + pos, torch.full_like(pos, T))  # (c, l)

    def chunked(t: torch.Tensor) -> torch.Tensor:
        t = t.to(f32)
        t = torch.cat([t, t.new_zeros(1, *t.shape[1:])], dim=0)  # pad row at index T
        return t[tok]  # (c, l, ...)

    xc = chunked(x).view(n_chunks, cs, G, R, P)  # (c, l, g, r, p)
    dtc = chunked(dt).view(n_chunks, cs, G, R)  # (c, l, g, r)
    Bc = chunked(B)  # (c, l, g, n)
    Cc = chunked(C)  # (c, l, g, n)
    Af = A.to(f32).view(G, R)

    # Discretisation (ZOH for A, Euler for B as in Mamba-2): Ā = exp(dt A), B̄ x = dt x B.
    dA = (dtc * Af).permute(0, 2, 3, 1)  # (c, g, r, l): log-decay of each step, <= 0
    dA_cumsum = torch.cumsum(dA, dim=-1)  # (c, g, r, l): log-decay from chunk start to l (inclusive)
    xdt = xc * dtc[..., None]  # (c, l, g, r, p)

    # 1. Intra-chunk (diagonal blocks): y_l = sum_{s<=l} (C_l·B_s) exp(segsum)_{l,s} dt_s x_s.
    #    C_l·B_s depends only on the group, so compute it once per group and broadcast over its R heads.
    CB = torch.einsum("clgn,csgn->cgls", Cc, Bc)  # (c, g, l, s)
    Lmat = torch.exp(segsum(dA))  # (c, g, r, l, s), zero above the diagonal
    Y_diag = torch.einsum("cgrls,csgrp->clgrp", CB[:, :, None] * Lmat, xdt)

    # 2. Each chunk's end state from its own inputs: sum_s exp(dA_cumsum[-1] - dA_cumsum[s]) dt_s x_s ⊗ B_s.
    decay_to_end = torch.exp(dA_cumsum[..., -1:] - dA_cumsum)  # (c, g, r, l)
    chunk_states = torch.einsum("clgn,cgrl,clgrp->cgrpn", Bc, decay_to_end, xdt)  # (c, g, r, p, n)
    chunk_decay = torch.exp(dA_cumsum[..., -1])  # (c, g, r): total decay across the chunk

    # 3. Inter-chunk recurrence h_c = decay_c h_{c-1} + states_c, sequentially over the chunk index but for
    #    all sequences at once. Scatter into an (S, max_nch) grid; missing chunks are identity steps
    #    (decay 1, no input), so after the loop h is every sequence's final state (h0 for empty sequences).
    grid = chunk_seq * max_nch + chunk_k  # (c,) flat position in the (S, max_nch) grid
    decay_grid = torch.ones(S * max_nch, G, R, dtype=f32, device=dev)
    decay_grid[grid] = chunk_decay
    states_grid = torch.zeros(S * max_nch, G, R, P, N, dtype=f32, device=dev)
    states_grid[grid] = chunk_states
    decay_grid = decay_grid.view(S, max_nch, G, R, 1, 1)
    states_grid = states_grid.view(S, max_nch, G, R, P, N)

    h = h0.view(S, G, R, P, N)
    incoming = []  # state entering chunk k, per sequence
    for k in range(max_nch):
        incoming.append(h)
        h = decay_grid[:, k] * h + states_grid[:, k]
    final_states = h.reshape(S, H, P, N)
    h_prev = torch.stack(incoming, dim=1).view(S * max_nch, G, R, P, N)[grid]  # (c, g, r, p, n)

    # 4. Incoming state's contribution: y_l += C_l · (exp(dA_cumsum[l]) h_prev).
    Y_off = torch.einsum("clgn,cgrpn,cgrl->clgrp", Cc, h_prev, torch.exp(dA_cumsum))

    Y = Y_diag + Y_off
    if D is not None:
        Df = D.to(f32)
        Df = (Df[:, None] if Df.dim() == 1 else Df).view(G, R, -1)  # (g, r, 1 or p)
        Y = Y + xc * Df

    # Scatter back to packed order; every pad position writes the dummy row T, which is dropped.
    y = torch.zeros(T + 1, H, P, dtype=f32, device=dev)
    y[tok.reshape(-1)] = Y.reshape(n_chunks * cs, H, P)
    if boundary_offsets is None:
        return ScanResult(y[:T].to(x.dtype), final_states.to(state_dtype))
    # The state after o tokens of sequence s enters its chunk o // cs (the final state when o is its length).
    entering = torch.stack(incoming + [h], dim=1).view(S, max_nch + 1, H, P, N)
    rows = [(s, o // cs) for s, offs in enumerate(boundary_offsets) for o in offs]
    at = entering[[r for r, _ in rows], [k for _, k in rows]] if rows else entering.new_zeros(0, H, P, N)
    return ScanResult(y[:T].to(x.dtype), final_states.to(state_dtype), at.to(state_dtype))


def _boundary_chunk(cs: int, lens: list, boundary_offsets) -> int:
    """The largest chunk length <= cs that divides every boundary offset."""
    _check_offsets(lens, boundary_offsets)
    for offs in boundary_offsets:
        for o in offs:
            cs = math.gcd(cs, o)
    return cs


def _check_offsets(lens: list, boundary_offsets) -> None:
    """One list of offsets per sequence, each 0 < o <= the sequence's length."""
    if len(boundary_offsets) != len(lens):
        raise ValueError(f"boundary_offsets has {len(boundary_offsets)} entries for {len(lens)} sequences")
    for n, offs in zip(lens, boundary_offsets):
        for o in offs:
            if not 0 < o <= n:
                raise ValueError(f"boundary offset {o} outside a sequence of {n} tokens")


# --------------------------------------------------------------------------------------------------------
# depthwise causal conv1d
# --------------------------------------------------------------------------------------------------------


def check_activation(activation: Optional[str]) -> bool:
    """Whether to apply SiLU (the conv's only activation; "swish" is its other name), refusing any other."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    return activation is not None


def activate(y: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    return F.silu(y) if check_activation(activation) else y


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    batch: PrefillBatch,
    initial_states: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
) -> ConvResult:
    """Depthwise causal conv over a packed varlen batch.

    x: (T, D)  weight: (D, W)  bias: (D,) or None  batch: bounds (from 0) and resume flags
    initial_states: (S, W-1, D) or None -- the last W-1 inputs before each sequence, oldest first
      ("SD" layout: dim innermost); sequences that do not resume use zeros (garbage-safe)
    activation: "silu" or None
    returns ConvResult: out (T, D) in x.dtype, final_states (S, W-1, D) in x.dtype: the last W-1 inputs of
      each sequence, including initial-state entries when the sequence is shorter than W-1 (zeros if no
      initial state). Tokens outside [cu_seqlens[0], cu_seqlens[-1]) get out = 0.

    out_t = act(bias + sum_{k=0..W-1} weight[:, k] * u_{t-(W-1)+k}), where u is the sequence preceded by its
    W-1 state inputs; weight[:, W-1] multiplies the current token (causal-conv1d / nn.Conv1d convention).

    Implementation: lay the batch out as [state_0, seq_0, state_1, seq_1, ...] (each state W-1 rows), take
    all length-W windows with unfold, and keep the window ending at every real token.
    """
    T, Dm = x.shape
    W = weight.shape[-1]
    K = W - 1
    dev = x.device
    f32 = torch.float32

    cu = seq_bounds(batch)
    S = len(cu) - 1
    if cu[0] != 0 and S > 0:
        raise ValueError("cu_seqlens must start at 0")
    T_used = cu[-1] if S > 0 else 0
    if T_used > T:
        raise ValueError(f"cu_seqlens ends at {T_used} but x has only {T} tokens")

    init = select_initial(initial_states, batch.resumes, (S, K, Dm), f32, dev)  # (S, K, D)
    if T_used == 0:  # nothing to convolve: every final state is its (selected) initial state
        return ConvResult(x.new_zeros(T, Dm), init.to(x.dtype))

    lens = torch.tensor([b - a for a, b in zip(cu[:-1], cu[1:])], dtype=torch.long, device=dev)
    seq_of_tok = torch.repeat_interleave(torch.arange(S, device=dev), lens)  # (T_used,)
    # Row of token t in the extended layout: shifted by the K state rows of its own and every earlier sequence.
    tok_row = torch.arange(T_used, device=dev) + (seq_of_tok + 1) * K
    # Rows of sequence s's state block: cu[s] + s*K + j.
    state_row = (torch.tensor(cu[:-1], dtype=torch.long, device=dev) + torch.arange(S, device=dev) * K)[
        :, None
    ] + torch.arange(K, device=dev)[None, :]  # (S, K)

    ext = torch.zeros(T_used + S * K, Dm, dtype=f32, device=dev)
    ext[tok_row] = x[:T_used].to(f32)
    ext[state_row.reshape(-1)] = init.reshape(S * K, Dm)

    # The window ending at tok_row starts K rows earlier (unfold window i covers rows i..i+K).
    windows = ext.unfold(0, W, 1)  # (rows - K, D, W)
    win = windows[tok_row - K]  # (T_used, D, W)
    y = (win * weight.to(f32)).sum(-1)
    if bias is not None:
        y = y + bias.to(f32)
    y = activate(y, activation)

    out = x.new_zeros(T, Dm)
    out[:T_used] = y.to(x.dtype)

    # Final state: the last K rows of each [state_s, seq_s] block (which reach into state_s when len < K).
    end_row = torch.tensor(cu[1:], dtype=torch.long, device=dev) + (torch.arange(S, device=dev) + 1) * K
    final_rows = end_row[:, None] - K + torch.arange(K, device=dev)[None, :]  # (S, K)
    final_states = ext[final_rows.reshape(-1)].view(S, K, Dm).to(x.dtype)
    return ConvResult(out, final_states)


def conv_states_at(
    x: torch.Tensor,
    width: int,
    batch: PrefillBatch,
    initial_states: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The conv state after the first o tokens of each sequence, for each o of ``batch.boundary_offsets`` (per
    sequence, 0 < o <= its length): its last W-1 inputs, reaching into the initial state when o < W-1.

    x: (T, D) conv inputs  initial_states: (S, W-1, D) or None (sequences that do not resume: zeros)
    returns (M, W-1, D) in x.dtype, in the order of the offsets (M in all). (Prefix caching keeps them at
    block boundaries.)"""
    cu = seq_bounds(batch)
    S, K, Dm = len(cu) - 1, width - 1, x.shape[-1]
    boundary_offsets = batch.boundary_offsets
    if boundary_offsets is None:
        raise ValueError("the batch has no boundary offsets")
    _check_offsets([b - a for a, b in zip(cu[:-1], cu[1:])], boundary_offsets)
    init = select_initial(initial_states, batch.resumes, (S, K, Dm), x.dtype, x.device)
    out = []
    for s, offs in enumerate(boundary_offsets):
        seq = torch.cat([init[s], x[cu[s]: cu[s + 1]]])  # (K + len, D): the state rows, then the inputs
        out += [seq[o: o + K] for o in offs]
    return torch.stack(out) if out else x.new_zeros(0, K, Dm)


def conv_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    state_indices: torch.Tensor,
    activation: Optional[str] = "silu",
) -> torch.Tensor:
    """One decode step for a batch of requests, updating the state pool in place.

    x: (B, D), or (B, L, D): L tokens per row, one after another (a verification step's)
    conv_states: (num_slots, W-1, D) pool, modified in place at rows state_indices
    weight: (D, W)  bias: (D,) or None
    state_indices: (B,) int64 slot per row: distinct slots, or a negative id for a padding row (see
      ``_padding``). Returns out, shaped as x, in x.dtype; padding rows give 0.
    """
    if x.dim() == 3:
        return torch.stack([conv_update(x[:, i], conv_states, weight, bias, state_indices, activation)
                            for i in range(x.shape[1])], dim=1)
    idx, real = _padding(state_indices, conv_states.device)
    f32 = torch.float32
    state = conv_states[idx].to(f32)  # (B, W-1, D), a gathered copy
    window = torch.cat([state, x.to(f32)[:, None, :]], dim=1)  # (B, W, D), oldest first
    y = torch.einsum("bwd,dw->bd", window, weight.to(f32))
    if bias is not None:
        y = y + bias.to(f32)
    y = torch.where(real[:, None], activate(y, activation), 0.0)  # 0, not 0 * garbage
    # Shift left by one: drop the oldest input, append the current one.
    conv_states[idx] = window[:, 1:].to(conv_states.dtype)
    return y.to(x.dtype)


def _padding(state_indices: torch.Tensor, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(slot ids with padding rows sent to slot 0, bool mask of the real rows).

    A negative slot id marks a padding row (FULL CUDA-graph batches padded to a captured size; vLLM's
    PAD_SLOT_ID). The CUDA kernels skip such rows: no state read or written, output 0. Here the padding rows'
    outputs are 0 too, and their state update lands in slot 0 -- vLLM's null block, which the block pool never
    gives a request -- because skipping them would need a data-dependent shape (a host sync, and no CUDA-graph
    capture)."""
    idx = state_indices.to(device=device, dtype=torch.long)
    return idx.clamp(min=0), idx >= 0


# --------------------------------------------------------------------------------------------------------
# SSM one-step update (decode)
# --------------------------------------------------------------------------------------------------------


def ssm_state_update(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state_indices: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One decode step of the SSM recurrence, updating the pool in place.

    ssm_states: (num_slots, H, P, N) pool (any float dtype; compute in float32, store back in pool dtype)
    x: (B, H, P)  dt: (B, H) processed step sizes -- or raw, with dt_bias (H,) / dt_softplus: the step size is
    then softplus(dt + dt_bias) (``process_dt`` without a limit)  A: (H,)  B, C: (B, G, N)
    state_indices: (B,) int64, distinct, or negative for a padding row (``_padding``: output 0)
    D: (H,) (or (H, P)) or None  returns y: (B, H, P) in x.dtype, written into ``out`` (any strides) if given.

    h = exp(dt A) h + dt x ⊗ B ;  y = h · C + D x. y is read from the float32 state before it is rounded to
    the pool dtype (as mamba-ssm's selective_state_update does).
    """
    Bsz, H, P = x.shape
    G, N = B.shape[-2], B.shape[-1]
    R = heads_per_group(H, G)
    f32 = torch.float32
    idx, real = _padding(state_indices, ssm_states.device)

    h = ssm_states[idx].to(f32).view(Bsz, G, R, P, N)
    if dt_bias is not None:
        dt = dt.to(f32) + dt_bias.to(f32)
    if dt_softplus:
        dt = F.softplus(dt.to(f32))
    dtf = dt.to(f32).reshape(Bsz, G, R)
    xf = x.to(f32).view(Bsz, G, R, P)
    Bf = B.to(f32)  # (B, g, n), shared by the R heads of a group
    Cf = C.to(f32)

    decay = torch.exp(dtf * A.to(f32).view(G, R))  # (B, g, r)
    h = decay[..., None, None] * h + (xf * dtf[..., None])[..., None] * Bf[:, :, None, None, :]
    y = torch.einsum("bgrpn,bgn->bgrp", h, Cf)
    if D is not None:
        Df = D.to(f32)
        Df = (Df[:, None] if Df.dim() == 1 else Df).view(G, R, -1)
        y = y + xf * Df
    ssm_states[idx] = h.view(Bsz, H, P, N).to(ssm_states.dtype)
    y = torch.where(real[:, None, None], y.view(Bsz, H, P), 0.0).to(x.dtype)
    return y if out is None else out.copy_(y)


# --------------------------------------------------------------------------------------------------------
# small pieces of the mixer
# --------------------------------------------------------------------------------------------------------


def process_dt(
    dt_raw: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: Tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """softplus(dt_raw + dt_bias) in float32, clamped to dt_limit (HF Mamba2 time_step_limit).

    dt_raw: (..., H)  dt_bias: (H,)  returns float32 (..., H).
    softplus uses torch's default threshold 20 (linear above it), as mamba-ssm's kernels do.
    """
    dt = F.softplus(dt_raw.to(torch.float32) + dt_bias.to(torch.float32))
    lo, hi = dt_limit
    if lo != 0.0 or hi != float("inf"):  # softplus > 0 already: the default limit is a no-op
        dt = dt.clamp(min=lo, max=hi)
    return dt


def gated_rms_norm(
    x: torch.Tensor,
    z: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Mamba2 gated RMSNorm with norm_before_gate=False: y = rmsnorm_per_group(x * silu(z)) * weight.

    x, z: (T, d_inner) (any leading dims); weight: (d_inner,); the RMS is taken over each contiguous group of
    group_size channels (group_size = d_inner // n_groups) -- as mamba-ssm's RMSNormGated(group_size=...) and
    vLLM do (NOT over the whole width as HF transformers' CPU path does; see docs/architecture.md §6: that is only
    equivalent for n_groups == 1). Compute in float32, return x.dtype. z = None means no gate.
    out: optional buffer of x's shape, written and returned.
    """
    d = x.shape[-1]
    if group_size <= 0 or d % group_size != 0:
        raise ValueError(f"d_inner ({d}) must be a multiple of group_size ({group_size})")
    h = x.to(torch.float32)
    if z is not None:
        h = h * F.silu(z.to(torch.float32))
    hg = h.view(*h.shape[:-1], d // group_size, group_size)
    hg = hg * torch.rsqrt(hg.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = (hg.view(h.shape) * weight.to(torch.float32)).to(x.dtype)
    if out is None:
        return y
    out.copy_(y.view(out.shape))
    return out
