"""The depthwise causal conv: causal-conv1d's CUDA forward (prefill) and update (decode) extensions.

Contract and notation: ``reference.causal_conv1d`` / ``reference.conv_update`` (T tokens, S sequences, D
channels, W conv width, K = W-1 state rows; the pool is "SD": (slots, K, D), channel innermost). Line numbers:
causal-conv1d 1.7.0.

* ``causal_conv1d``: ONE call of the channel-last forward extension (``causal_conv1d_cuda.causal_conv1d_fwd``,
  what ``causal_conv1d_fn`` reaches through an autograd Function and a custom op) with seq_idx. The kernel's
  own ``initial_states`` serve only the first sequence (causal_conv1d_fwd.cu:237, 306: the first L-chunk,
  tagged with seq_idx[0]), and final states are refused with seq_idx (causal_conv1d_interface.py:27-30), so:
  fresh prompts are read in place from the projection (``_in_place``); otherwise through an extended buffer
  [init_0, seq_0, init_1, seq_1, ...] whose K state rows per sequence carry that sequence's seq_idx, so the
  kernel convolves through them (``_extended``). Final states are a gather of each sequence's last K inputs.
  No host sync.
* ``conv_update``: ONE call of the update extension (what ``causal_conv1d_update`` reaches through a custom op)
  with int32 conv_state_indices on the pool's transposed view (slots, D, K) (strides (slot, 1, D)), for one token
  per row or L (a verification step's); the C++ checks only shapes and dtypes, strides are free
  (causal_conv1d.cpp:479-531, causal_conv1d_update.cu:55-57).

Why the direct calls: a prefill step is host-bound (benchmarks/prefill_layer.py), and the custom-op dispatch
adds host time to every call, i.e. to every layer of every step that runs the mixer eagerly.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import reference
from ..interface import ConvResult, PrefillBatch
from ..reference import select_initial
from . import upstream
from .varlen_plan import ResumePath, VarlenPlan, add_boundaries, conv_plan, plan_of


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    batch: PrefillBatch,
    initial_states: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
) -> ConvResult:
    """Depthwise causal conv over a packed varlen batch (contract: reference.causal_conv1d).

    x: (T, D)  weight: (D, W)  bias: (D,) or None  batch: bounds from 0, resume flags, the step's plan
    initial_states: (S, W-1, D) or None ("SD" layout)
    returns ConvResult: out (T, D) in x.dtype, final_states (S, W-1, D) in x.dtype.

    Two layouts, both ONE causal-conv1d launch with seq_idx: in place (``_in_place``) when every sequence has
    >= W-1 tokens, there is no padding, x's rows are 16-byte aligned with a row stride that is a multiple of 8,
    and at most ``CONV_RECOMPUTE_MAX`` sequences resume a state; otherwise the extended buffer
    (``_extended``). The row indices come from the batch's plan (``plan_prefill``, built once per step); a batch
    without one is planned here from its host bounds. (Unlike the reference, bounds not starting at 0 are not
    detected here.)
    """
    T, Dm = x.shape
    W = weight.shape[-1]
    reason = upstream.conv_unsupported(W, x.dtype, weight.dtype)
    if reason is None and Dm % 8 != 0:
        # seq_idx needs the channel-last kernel (causal_conv1d.cpp:193), which needs dim % 8 == 0 (:179).
        reason = f"causal-conv1d's channel-last (varlen) kernel needs conv_dim % 8 == 0, got {Dm}"
    if reason is not None:
        upstream.fallback(reason)
        return reference.causal_conv1d(x, weight, bias, batch, initial_states, activation)
    silu = reference.check_activation(activation)
    plan = plan_of(batch, initial_states is not None, T, (W,), x.device)
    if plan.S <= 0:
        return ConvResult(x.new_zeros(T, Dm), x.new_zeros(0, W - 1, Dm))
    if bias is not None and bias.dtype != weight.dtype:
        bias = bias.to(weight.dtype)  # causal_conv1d.cpp:186: bias dtype must equal weight dtype
    cp = conv_plan(plan, W - 1)
    rows_ok = cp.in_place and x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
    if rows_ok and (initial_states is None or plan.conv_recomputes_resumed()):
        return ConvResult(*_in_place(x, weight, bias, plan, initial_states, silu))
    return ConvResult(*_extended(x, weight, bias, plan, initial_states, batch.resumes, silu))


def conv_states_at(
    x: torch.Tensor,
    width: int,
    batch: PrefillBatch,
    initial_states: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Prefix caching's conv states at block boundaries (contract: reference.conv_states_at): a gather of x's rows
    indexed from the step's plan (``varlen_plan.ConvBoundaryRows``), and of initial-state rows for an offset
    closer than K tokens to its sequence's start in the step. A batch without a plan goes to the reference.
    returns (M, W-1, D) in x.dtype."""
    plan = batch.plan
    if plan is None or batch.boundary_offsets is None:
        return reference.conv_states_at(x, width, batch, initial_states)
    K, Dm = width - 1, x.shape[-1]
    add_boundaries(plan, batch.boundary_offsets)  # set already where the batch was planned with them
    rows = plan.conv_boundary[K]
    out = x.index_select(0, rows.x_rows)
    if rows.pick is not None:
        init = select_initial(initial_states, batch.resumes, (plan.S, K, Dm), x.dtype, x.device)
        out = torch.cat([out, init.reshape(plan.S * K, Dm)]).index_select(0, rows.pick)
    return out.view(-1, K, Dm)


def _in_place(x, weight, bias, plan: VarlenPlan, initial_states, silu: bool):
    """x itself, read through its channel-last view (1, D, T), strides (D, 1, row stride): the kernel reads
    8-channel vectors (16 bytes) at row starts (causal_conv1d.cpp:175-181 checks the strides) and zero-pads
    each sequence's start where seq_idx changes. A lone resumed sequence that opens the batch takes the kernel's
    initial_states, which it gives the K positions before the row, tagged with seq_idx[0]
    (causal_conv1d_fwd.cu:237, 304-312); any other resumed sequence's first K outputs, the only ones that read
    its saved state, are recomputed from it (one small launch each). Final states: each sequence's last K
    inputs (>= K tokens each, so never the saved state)."""
    T, Dm = x.shape
    K = weight.shape[-1] - 1
    native = initial_states is not None and plan.path is ResumePath.NATIVE
    init0 = initial_states[0].to(x.dtype).t().unsqueeze(0) if native else None  # (1, D, K), unit channel stride
    y = _conv_fwd(x.t().unsqueeze(0), weight, bias, plan.seq_idx_row, silu, init0)[0].t()
    for s in [] if native or initial_states is None else plan.resumed:
        # One sequence, no seq_idx: the form in which the kernel takes initial_states (causal_conv1d.cpp:211-223).
        a = plan.cu[s]
        init_s = initial_states[s].to(x.dtype).t().unsqueeze(0)  # (1, D, K), unit channel stride
        y[a: a + K] = _conv_fwd(x[a: a + K].t().unsqueeze(0), weight, bias, None, silu, init_s)[0].t()
    return y, x.index_select(0, conv_plan(plan, K).last_row).view(plan.S, K, Dm)


def _extended(x, weight, bias, plan: VarlenPlan, initial_states, has_initial_state, silu: bool):
    """The extended buffer, E = T + S*K rows, every row exactly once:
        row(init_s[j]) = cu[s] + s*K + j          row(token t of seq s) = t + (s+1)*K
        tokens t >= cu[S] (padding)  -> t + S*K, with seq_idx -1 (the kernel writes 0 for seq_idx < 0),
    where each sequence's K initial-state rows carry its seq_idx, so the kernel convolves through them."""
    T, Dm = x.shape
    K, S = weight.shape[-1] - 1, plan.S
    cp = conv_plan(plan, K, extended=True)
    # (S, K, D) in x.dtype, zeros where not flagged (garbage-safe; a step of cache hits has none to mask); only
    # read below.
    flags = None if plan.all_resume else has_initial_state
    init = select_initial(initial_states, flags, (S, K, Dm), x.dtype, x.device)
    # index_copy_ / index_select, not advanced indexing: the same kernels' work for less host time (prefill steps
    # are host-bound: benchmarks/prefill_layer.py).
    ext = torch.empty(cp.E, Dm, dtype=x.dtype, device=x.device)  # fresh, contiguous: 16-byte aligned rows
    ext.index_copy_(0, cp.tok_row, x)
    ext.index_copy_(0, cp.state_row, init.reshape(S * K, Dm))
    out = _conv_fwd(ext.t().unsqueeze(0), weight, bias, cp.seq_idx.unsqueeze(0), silu)
    y = out[0].t().index_select(0, cp.tok_row)  # (T, D); padding tokens are 0
    return y, ext.index_select(0, cp.final_row).view(S, K, Dm)


def _conv_fwd(xv: torch.Tensor, weight, bias, seq_idx: Optional[torch.Tensor], silu: bool,
              initial_states: Optional[torch.Tensor] = None) -> torch.Tensor:
    """causal-conv1d's forward extension called directly, as its ``causal_conv1d_fn`` would (no autograd
    Function, no custom-op dispatch). xv: (1, D, L) channel-last view; seq_idx: (1, L) int32 contiguous
    (causal_conv1d.cpp:195-198) or None; initial_states: (1, D, K) with unit channel stride, xv's dtype, or
    None. The output is allocated channel-last, (1, D, L) with strides (L*D, 1, D): the channel-last kernel
    writes channels at unit stride (causal_conv1d_fwd.cu:233)."""
    L, Dm = xv.shape[2], xv.shape[1]
    out = torch.empty(1, L, Dm, dtype=xv.dtype, device=xv.device).transpose(1, 2)
    upstream.kernels().conv_fwd(xv, weight, bias, seq_idx, initial_states, out, None, silu)
    return out


def conv_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    state_indices: torch.Tensor,
    activation: Optional[str] = "silu",
) -> torch.Tensor:
    """One decode step, updating the pool in place (contract: reference.conv_update).

    x: (B, D), or (B, L, D): L tokens per row in one call  conv_states: (num_slots, W-1, D) pool (any slot
    stride, inner dims contiguous)  weight: (D, W)  bias: (D,) or None  state_indices: (B,) int
    returns out shaped as x, in x.dtype.
    """
    Bsz = x.shape[0]
    reason = upstream.conv_unsupported(weight.shape[-1], x.dtype, weight.dtype)
    if reason is None and conv_states.dtype not in upstream.CONV_DTYPES:
        reason = f"causal-conv1d does not support conv state dtype {conv_states.dtype}"
    # The kernel offsets the pool by slot * stride(0) in 32-bit unsigned arithmetic (ConvParamsBase strides
    # are uint32_t, causal_conv1d.h:10-27; causal_conv1d_update.cu:55-57): a pool spanning >= 2^32 elements
    # would wrap around.
    if reason is None and conv_states.shape[0] * conv_states.stride(0) >= 2**32:
        reason = "the conv state pool spans >= 2^32 elements (causal-conv1d uses 32-bit offsets)"
    if reason is not None:
        upstream.fallback(reason)
        return reference.conv_update(x, conv_states, weight, bias, state_indices, activation)
    if Bsz == 0:
        return x.new_empty(x.shape)
    silu = reference.check_activation(activation)
    # int32, stride 1 (causal_conv1d.cpp:519-522); negative entries would be skipped (update.cu:47-54).
    idx = upstream.unit_stride(state_indices.to(device=conv_states.device, dtype=torch.int32))
    if bias is not None and bias.dtype != weight.dtype:
        bias = bias.to(weight.dtype)  # causal_conv1d.cpp:500
    # conv_state dtype must equal x dtype (causal_conv1d.cpp:479): store x in the pool's dtype.
    xs = x if x.dtype == conv_states.dtype else x.to(conv_states.dtype)
    xs = xs.unsqueeze(1) if xs.dim() == 2 else xs  # (B, L, D)
    out = torch.empty_like(xs, memory_format=torch.contiguous_format)
    # x and out as (B, D, L) views, pool view (slots, D, W-1): the kernel runs each channel's L tokens in turn,
    # shifting its state left and appending each, in place (update.cu:74-102).
    upstream.kernels().conv_update(xs.transpose(1, 2), conv_states.transpose(-1, -2), weight, bias,
                                   out.transpose(1, 2), silu, None, idx)
    out = out.view(x.shape)
    return out if out.dtype == x.dtype else out.to(x.dtype)
