"""CUDA kernels: thin wrappers over mamba-ssm (Triton SSD, state update, gated RMSNorm) and causal-conv1d.

Same functions, signatures and semantics as ``reference.py`` (read it for the contract and the notation:
T tokens, S sequences, H heads, P head dim, G groups, N state size, W conv width, K = W-1, D channels).
mamba_ssm / causal_conv1d are imported lazily, on the first call (``_kernels()``): importing mamba_ssm loads
the Mamba1 extension and sets a global Triton allocator, which must never happen at plugin import.

What each wrapper does, and why (line numbers: mamba-ssm 2.3.2.post1, causal-conv1d 1.7.0):

* ``ssd_chunk_scan``: ONE packed ``mamba_chunk_scan_combined`` call for all sequences, with seq_idx,
  cu_seqlens and return_varlen_states and NO initial states; initial states are then added exactly in torch.
  The kernel cannot take a per-sequence initial state in a packed batch: ``initial_states`` is per batch row
  (ssd_combined.py:369) and, with seq_idx, only reaches the row's FIRST sequence (state passing starts from
  it and resets whenever seq_idx changes, ssd_state_passing.py:64-80; chunk scan applies the previous state
  only to tokens whose seq_idx equals the previous token's, ssd_chunk_scan.py:98-113), while varlen final
  states require batch == 1 (ssd_combined.py:390). One call per continuing sequence would work but costs
  5 Triton launches per sequence (vLLM's V2 runner can send many 1-token rows that carry state). SSD is
  linear in h0, so the exact fix is
      y_t   += C_t · (exp(sum_{k=start..t} dt_k A) h0)        final += exp(sum_{k in seq} dt_k A) h0,
  computed in float32 for the continuing sequences only, batched over fixed-size token blocks (see
  ``_add_initial_state``). Rows flagged has_initial_state False never read initial_states (torch.where).
  Host sync: sizes (cu_seqlens, has_initial_state) are needed on the host; pass CPU tensors (the metadata
  has them: query_start_loc_p_cpu, has_initial_state_p_cpu) to make it free, otherwise one .tolist().
* ``causal_conv1d``: ONE ``causal_conv1d_fn`` call (channel-last, seq_idx) over an extended buffer
  [init_0, seq_0, init_1, seq_1, ...] where each sequence's K initial-state rows carry that sequence's
  seq_idx, so the kernel convolves through them; the same kernel with ``initial_states`` would again only
  serve the first sequence (causal_conv1d_fwd.cu:237, 306: initial_states only for the first L-chunk, tagged
  with seq_idx[0]). Final states are a torch gather of the last K rows of each [init_s, seq_s] block, since
  ``return_final_states`` is refused with seq_idx (causal_conv1d_interface.py:27-30). No host sync.
* ``conv_update``: ONE ``causal_conv1d_update(..., conv_state_indices=int32)`` on the pool's transposed view
  (slots, D, K) (strides (slot, 1, D)); the C++ checks only shapes/dtypes, strides are free
  (causal_conv1d.cpp:479-531, causal_conv1d_update.cu:55-57).
* ``ssm_state_update``: ONE ``selective_state_update(..., state_batch_indices=int64)`` in the multi-head
  form with dt/A/dt_bias/D broadcast by stride-0 ``expand`` (takes the kernel's TIE_HDIM scalar path).
* ``gated_rms_norm``: ``rmsnorm_fn(group_size=..., norm_before_gate=False)``.
* ``process_dt``: plain torch (reference's).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import List, Optional, Sequence, Tuple

import torch

from . import reference
from .reference import _select_initial, process_dt  # noqa: F401  (process_dt is part of the interface)

__all__ = [
    "ssd_chunk_scan",
    "causal_conv1d",
    "conv_update",
    "ssm_state_update",
    "process_dt",
    "gated_rms_norm",
]

logger = logging.getLogger(__name__)

_KERNELS: Optional[SimpleNamespace] = None
_INSTALL_HINT = (
    "vllm_mamba2_plugin's CUDA path needs the mamba-ssm and causal-conv1d packages: "
    "pip install mamba-ssm causal-conv1d (or: pip install 'vllm-mamba2-plugin[cuda]'); "
    "or set VLLM_MAMBA2_PLUGIN_KERNELS=reference to use the plain-torch kernels"
)


def _kernels() -> SimpleNamespace:
    """The upstream kernel entry points, imported once, on first use (never at module import)."""
    global _KERNELS
    if _KERNELS is None:
        try:
            from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
            from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn
            from mamba_ssm.ops.triton.selective_state_update import selective_state_update
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        except ImportError as e:
            raise ImportError(f"{_INSTALL_HINT} (import failed: {e})") from e
        _KERNELS = SimpleNamespace(
            mamba_chunk_scan_combined=mamba_chunk_scan_combined,
            selective_state_update=selective_state_update,
            rmsnorm_fn=rmsnorm_fn,
            causal_conv1d_fn=causal_conv1d_fn,
            causal_conv1d_update=causal_conv1d_update,
        )
    return _KERNELS


_warned: set = set()


def _fallback(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("vllm_mamba2_plugin: %s; using the plain-torch reference kernel for it", reason)


_CONV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # causal_conv1d.cpp:160-161, 477-478


def _conv_unsupported(dim: int, width: int, x_dtype, w_dtype) -> Optional[str]:
    if not 2 <= width <= 4:  # causal_conv1d.cpp:182, 496
        return f"causal-conv1d supports conv widths 2..4, not {width}"
    if x_dtype not in _CONV_DTYPES or w_dtype not in _CONV_DTYPES:
        return f"causal-conv1d does not support dtypes {x_dtype}/{w_dtype}"
    return None


# --------------------------------------------------------------------------------------------------------
# SSD chunked scan (prefill)
# --------------------------------------------------------------------------------------------------------


def _host_bounds(
    cu_seqlens: torch.Tensor, has_initial_state: Optional[torch.Tensor], have_init: bool
) -> Tuple[List[int], List[bool]]:
    """cu_seqlens and has_initial_state as host lists, with at most one device->host transfer."""
    S = cu_seqlens.numel() - 1
    if not have_init:
        return cu_seqlens.tolist(), [False] * S
    if has_initial_state is None:
        return cu_seqlens.tolist(), [True] * S
    if cu_seqlens.device.type != "cpu" and has_initial_state.device == cu_seqlens.device:
        both = torch.cat([cu_seqlens.to(torch.int64), has_initial_state.to(torch.int64).view(-1)]).tolist()
        return both[: S + 1], [bool(v) for v in both[S + 1:]]
    return cu_seqlens.tolist(), [bool(v) for v in has_initial_state.view(-1).tolist()]


def _add_initial_state(
    y: torch.Tensor,
    fin: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    C: torch.Tensor,
    seq_idx: torch.Tensor,
    cu_k: Sequence[int],
    cu_k_dev: torch.Tensor,
    init_pos: Sequence[int],
    h0: torch.Tensor,
    block: int,
) -> torch.Tensor:
    """Add the initial states' contribution to a zero-initial-state SSD result (exact: SSD is linear in h0).

    y: (Tu, H, P) float32 outputs of the kernel; fin: (S', H, P, N) float32 final states, updated in place.
    dt: (Tu, H) processed; A: (H,); C: (Tu, G, N); seq_idx: (Tu,) int sequence of each token (0..S'-1);
    cu_k / cu_k_dev: (S'+1) bounds (host list / device); init_pos: host list of the sequences (0..S'-1,
    all non-empty) that carry a state; h0: (len(init_pos), H, P, N) float32 their initial states.
    Returns y + correction (new tensor).

    With a(t) = exp(sum_{k=start..t} dt_k A) (inclusive: h_t includes step t's decay):
        y_t += a(t) · (C_t · h0)     final += a(end-1) · h0.
    The C_t · h0 contraction needs h0 per token; gathering it per token would cost T·H·P·N memory, so tokens
    are grouped in blocks of <= ``block`` tokens of one sequence (last block padded with a dummy token) and
    each block is one small matmul against its sequence's h0: memory ~ (T_init/block + S_init)·H·P·N, the
    same order as the kernel's own per-chunk state tensor.
    """
    Tu, H, P = y.shape
    G, N = C.shape[-2], C.shape[-1]
    R = H // G
    dev = y.device
    I = len(init_pos)

    # Log-decays summed in float64 over the packed batch, then differenced at sequence starts: float32
    # cumsums over thousands of tokens would lose ~1e-3 absolute in the exponent.
    dA = dt.to(torch.float64) * A.to(torch.float64)  # (Tu, H)
    csum = torch.cat([dA.new_zeros(1, H), dA.cumsum(0)])  # csum[i] = sum_{k<i}
    tok_start = cu_k_dev.to(torch.long)[seq_idx.long()]  # (Tu,)
    decay_tok = torch.exp(csum[1:] - csum[tok_start]).to(torch.float32)  # (Tu, H) a(t)

    starts = [cu_k[i] for i in init_pos]
    ends = [cu_k[i + 1] for i in init_pos]
    st = torch.tensor(starts, dtype=torch.long).to(dev, non_blocking=True)
    en = torch.tensor(ends, dtype=torch.long).to(dev, non_blocking=True)
    total = torch.exp(csum[en] - csum[st]).to(torch.float32)  # (I, H)
    pos = torch.tensor(list(init_pos), dtype=torch.long).to(dev, non_blocking=True)
    fin[pos] += total[:, :, None, None] * h0

    # Token blocks (built on the host from host sizes, then one small copy).
    lens = [e - s for s, e in zip(starts, ends)]
    blk = max(1, min(block, 1 << (max(lens) - 1).bit_length()))
    nblk = [(n + blk - 1) // blk for n in lens]
    b_seq = torch.repeat_interleave(torch.arange(I), torch.tensor(nblk))  # (nb,)
    first = torch.tensor([0] + nblk[:-1]).cumsum(0)
    b_k = torch.arange(len(b_seq)) - first[b_seq]
    tok = torch.tensor(starts)[b_seq, None] + b_k[:, None] * blk + torch.arange(blk)[None, :]  # (nb, blk)
    tok = torch.where(tok < torch.tensor(ends)[b_seq, None], tok, torch.full_like(tok, Tu))  # Tu = dummy row
    tok = tok.to(dev, non_blocking=True)
    b_seq = b_seq.to(dev, non_blocking=True)
    nb = tok.shape[0]

    Cb = torch.cat([C.to(torch.float32), C.new_zeros(1, G, N, dtype=torch.float32)])[tok]  # (nb, blk, G, N)
    ab = torch.cat([decay_tok, decay_tok.new_zeros(1, H)])[tok]  # (nb, blk, H)
    hb = h0.reshape(I, G, R * P, N)[b_seq]  # (nb, G, R*P, N)
    corr = torch.matmul(Cb.permute(0, 2, 1, 3), hb.transpose(-1, -2))  # (nb, G, blk, R*P)
    corr = corr.view(nb, G, blk, R, P).permute(0, 2, 1, 3, 4).reshape(nb, blk, H, P) * ab[..., None]

    out = torch.cat([y, y.new_zeros(1, H, P)])
    out.index_add_(0, tok.reshape(-1), corr.reshape(nb * blk, H, P))  # each real token appears once
    return out[:Tu]


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    cu_seqlens: torch.Tensor,
    initial_states: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
    D: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan over a packed varlen batch (contract: reference.ssd_chunk_scan).

    x: (T, H, P)  dt: (T, H) processed  A: (H,)  B, C: (T, G, N)  cu_seqlens: (S+1,) (CPU or device)
    initial_states: (S, H, P, N) or None  has_initial_state: (S,) bool or None (CPU or device)  D: (H,)|(H, P)
    returns y: (T, H, P) in x.dtype, final_states: (S, H, P, N) float32.
    """
    k = _kernels()
    T, H, P = x.shape
    G, N = B.shape[-2], B.shape[-1]
    reference._groups(H, G)
    dev = x.device
    cu, init_flags = _host_bounds(cu_seqlens, has_initial_state, initial_states is not None)
    S = len(cu) - 1
    if any(b < a for a, b in zip(cu[:-1], cu[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu}")
    if S > 0 and cu[-1] > T:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but x has only {T} tokens")
    # (S, H, P, N) float32: zeros where not flagged, garbage-safe (torch.where, not a multiply).
    h0 = _select_initial(initial_states, has_initial_state, (S, H, P, N), torch.float32, dev)
    if initial_states is not None and h0.data_ptr() == initial_states.data_ptr():
        h0 = h0.clone()  # has_initial_state None + float32 input: never hand the caller's tensor back
    y = x.new_zeros(T, H, P)
    if S == 0 or cu[-1] == cu[0]:
        return y, h0

    # Only non-empty sequences go to the kernel: chunk_state_varlen would compute (end-1)//chunk for an
    # empty sequence at position 0 (ssd_chunk_state.py:661-675), and an empty one needs no work anyway.
    lo, hi = cu[0], cu[-1]
    ne = [s for s in range(S) if cu[s + 1] > cu[s]]
    cu_k = [cu[ne[0]] - lo] + [cu[s + 1] - lo for s in ne]
    Tu, Sk = hi - lo, len(ne)
    cu_k_dev = torch.tensor(cu_k, dtype=torch.int32).to(dev, non_blocking=True)
    seq_idx = torch.repeat_interleave(
        torch.arange(Sk, dtype=torch.int32, device=dev), cu_k_dev.diff(), output_size=Tu
    )  # (Tu,) int32, 0..S'-1: the kernels only compare ids for equality (ssd_bmm.py:84-88)

    out, varlen_states = k.mamba_chunk_scan_combined(
        x[lo:hi].unsqueeze(0),  # (1, Tu, H, P)
        dt[lo:hi].unsqueeze(0),  # (1, Tu, H): already softplus'ed and clamped -> dt_softplus=False
        A,
        B[lo:hi].unsqueeze(0),
        C[lo:hi].unsqueeze(0),
        int(chunk_size),
        D=D,
        seq_idx=seq_idx.unsqueeze(0),
        cu_seqlens=cu_k_dev,
        dt_softplus=False,
        return_final_states=False,
        return_varlen_states=True,
    )  # out: (1, Tu, H, P) x.dtype; varlen_states: (S', H, P, N) in C.dtype (the chunk states' dtype)
    fin_k = varlen_states.to(torch.float32)

    init_pos = [i for i, s in enumerate(ne) if init_flags[s]]
    if init_pos:
        rows = torch.tensor([ne[i] for i in init_pos], dtype=torch.long).to(dev, non_blocking=True)
        y_k = _add_initial_state(
            out[0].to(torch.float32), fin_k, dt[lo:hi], A, C[lo:hi], seq_idx, cu_k, cu_k_dev, init_pos,
            h0[rows], block=int(chunk_size),
        )
        y[lo:hi] = y_k.to(x.dtype)
    else:
        y[lo:hi] = out[0]

    fin = h0  # empty sequences keep their (selected) initial state
    if Sk == S:
        fin = fin_k
    else:
        fin[torch.tensor(ne, dtype=torch.long).to(dev, non_blocking=True)] = fin_k
    return y, fin


# --------------------------------------------------------------------------------------------------------
# causal conv1d (prefill)
# --------------------------------------------------------------------------------------------------------


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    cu_seqlens: torch.Tensor,
    initial_states: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over a packed varlen batch (contract: reference.causal_conv1d).

    x: (T, D)  weight: (D, W)  bias: (D,) or None  cu_seqlens: (S+1,) starting at 0
    initial_states: (S, W-1, D) or None ("SD" layout)  has_initial_state: (S,) bool or None
    returns out: (T, D) in x.dtype, final_states: (S, W-1, D) in x.dtype.

    Layout sent to the kernel, E = T + S*K rows, every row exactly once:
        row(init_s[j]) = cu[s] + s*K + j          row(token t of seq s) = t + (s+1)*K
        tokens t >= cu[S] (padding)  -> t + S*K, with seq_idx -1 (the kernel writes 0 for seq_idx < 0).
    No host sync: all indices are computed on the device from cu_seqlens. (Unlike the reference, a
    cu_seqlens not starting at 0 is not detected here.)
    """
    T, Dm = x.shape
    W = weight.shape[-1]
    K = W - 1
    reason = _conv_unsupported(Dm, W, x.dtype, weight.dtype)
    if reason is None and Dm % 8 != 0:
        # seq_idx needs the channel-last kernel (causal_conv1d.cpp:193), which needs dim % 8 == 0 (:179).
        reason = f"causal-conv1d's channel-last (varlen) kernel needs conv_dim % 8 == 0, got {Dm}"
    if reason is not None:
        _fallback(reason)
        return reference.causal_conv1d(x, weight, bias, cu_seqlens, initial_states, has_initial_state,
                                       activation)
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    k = _kernels()
    S = cu_seqlens.numel() - 1
    dev = x.device
    if S <= 0:
        return x.new_zeros(T, Dm), x.new_zeros(0, K, Dm)
    cu = cu_seqlens.to(device=dev, dtype=torch.long)
    # (S, K, D) in x.dtype, zeros where not flagged (garbage-safe); only read below.
    init = _select_initial(initial_states, has_initial_state, (S, K, Dm), x.dtype, dev)

    t = torch.arange(T, device=dev)
    seq_of_tok = torch.searchsorted(cu[1:], t, right=True)  # (T,) in [0, S]; S = past the last sequence
    tok_row = t + torch.clamp(seq_of_tok + 1, max=S) * K
    s_ar = torch.arange(S, device=dev)
    state_row = (cu[:-1] + s_ar * K)[:, None] + torch.arange(K, device=dev)[None, :]  # (S, K)

    E = T + S * K
    ext = torch.empty(E, Dm, dtype=x.dtype, device=dev)  # fresh, contiguous: 16-byte aligned rows
    ext[tok_row] = x
    ext[state_row.reshape(-1)] = init.reshape(S * K, Dm)
    sidx = torch.empty(E, dtype=torch.int32, device=dev)  # int32, contiguous: causal_conv1d.cpp:195-198
    sidx[tok_row] = torch.where(seq_of_tok < S, seq_of_tok, torch.full_like(seq_of_tok, -1)).to(torch.int32)
    sidx[state_row.reshape(-1)] = s_ar.repeat_interleave(K).to(torch.int32)

    # Channel-last view (1, D, E), strides (D, 1, D): x.stride(1) == 1 selects the channel-last kernel, and
    # strides (0) and (2) are D, multiples of 8 (causal_conv1d.cpp:175-181). The output is empty_like(x), so
    # it keeps these strides.
    if bias is not None and bias.dtype != weight.dtype:
        bias = bias.to(weight.dtype)  # causal_conv1d.cpp:186: bias dtype must equal weight dtype
    out = k.causal_conv1d_fn(
        ext.t().unsqueeze(0), weight, bias, seq_idx=sidx.unsqueeze(0), activation=activation
    )
    y = out[0].t()[tok_row]  # (T, D); padding tokens are 0

    end_row = cu[1:] + (s_ar + 1) * K  # one past the last row of [init_s, seq_s]
    final = ext[(end_row[:, None] - K + torch.arange(K, device=dev)[None, :]).reshape(-1)].view(S, K, Dm)
    return y, final


# --------------------------------------------------------------------------------------------------------
# decode: one-step updates of the state pools
# --------------------------------------------------------------------------------------------------------


def conv_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    state_indices: torch.Tensor,
    activation: Optional[str] = "silu",
) -> torch.Tensor:
    """One decode step, updating the pool in place (contract: reference.conv_update).

    x: (B, D)  conv_states: (num_slots, W-1, D) pool (any slot stride, inner dims contiguous)
    weight: (D, W)  bias: (D,) or None  state_indices: (B,) int  returns (B, D) in x.dtype.
    """
    Bsz, Dm = x.shape
    W = weight.shape[-1]
    reason = _conv_unsupported(Dm, W, x.dtype, weight.dtype)
    if reason is None and conv_states.dtype not in _CONV_DTYPES:
        reason = f"causal-conv1d does not support conv state dtype {conv_states.dtype}"
    # The kernel offsets the pool by slot * stride(0) in 32-bit unsigned arithmetic (ConvParamsBase strides
    # are uint32_t, causal_conv1d.h:10-27; causal_conv1d_update.cu:55-57): a pool spanning >= 2^32 elements
    # would wrap around.
    if reason is None and conv_states.shape[0] * conv_states.stride(0) >= 2**32:
        reason = "the conv state pool spans >= 2^32 elements (causal-conv1d uses 32-bit offsets)"
    if reason is not None:
        _fallback(reason)
        return reference.conv_update(x, conv_states, weight, bias, state_indices, activation)
    if Bsz == 0:
        return x.new_empty(0, Dm)
    k = _kernels()
    # int32, stride 1 (causal_conv1d.cpp:519-522); negative entries would be skipped (update.cu:47-54).
    idx = state_indices.to(device=conv_states.device, dtype=torch.int32).contiguous()
    if bias is not None and bias.dtype != weight.dtype:
        bias = bias.to(weight.dtype)  # causal_conv1d.cpp:500
    # conv_state dtype must equal x dtype (causal_conv1d.cpp:479): store x in the pool's dtype.
    xs = x if x.dtype == conv_states.dtype else x.to(conv_states.dtype)
    out = k.causal_conv1d_update(
        xs, conv_states.transpose(-1, -2), weight, bias, activation, conv_state_indices=idx
    )  # pool view (slots, D, W-1); the kernel shifts it left by one and appends x, in place
    return out if out.dtype == x.dtype else out.to(x.dtype)


def ssm_state_update(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state_indices: torch.Tensor,
    D: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One decode step of the SSM recurrence, updating the pool in place (contract: reference.ssm_state_update).

    ssm_states: (num_slots, H, P, N) pool (any slot stride)  x: (B, H, P)  dt: (B, H) processed  A: (H,)
    B, C: (B, G, N)  state_indices: (B,) int  D: (H,) | (H, P) | None  returns y: (B, H, P) in x.dtype.
    """
    Bsz, H, P = x.shape
    N = ssm_states.shape[-1]
    reference._groups(H, B.shape[-2])
    if Bsz == 0:
        return x.new_empty(0, H, P)
    k = _kernels()
    dev = x.device
    # int64 indices: the Triton kernel offsets the pool by index * slot stride (selective_state_update.py:60-65)
    # and an int64 index keeps that product 64-bit for large pools. The kernel reads index pid_b at
    # ptr + pid_b, so the tensor must be contiguous.
    idx = state_indices.to(device=dev, dtype=torch.int64).contiguous()
    # Multi-head form: dt (B, H, P), A (H, P, N), dt_bias (H, P), D (H, P), broadcast with stride 0 (as vLLM
    # does). With A, dt and dt_bias all stride-0 in the head dim the kernel takes its TIE_HDIM path
    # (selective_state_update.py:199): one scalar dt and exp(dt*A) per head.
    # dt_bias and D must NOT be None here: the call site unpacks `*(t.stride(0), t.stride(1)) if t is not None
    # else 0`, i.e. `*0` -> TypeError for None (selective_state_update.py:207, 211), and line 199 evaluates
    # dt_bias.stride(-1) whenever A and dt are tied. So pass zeros (adding 0.0 to dt is exact).
    dt3 = dt.to(torch.float32)[:, :, None].expand(Bsz, H, P)
    A3 = A.to(torch.float32)[:, None, None].expand(H, P, N)
    dt_bias = torch.zeros(H, 1, dtype=torch.float32, device=dev).expand(H, P)
    if D is None:
        D2 = torch.zeros(H, 1, dtype=torch.float32, device=dev).expand(H, P)
    else:
        D2 = D[:, None].expand(H, P) if D.dim() == 1 else D
    # The kernel reads the state in its dtype, computes in float32 and stores back in the pool dtype; y comes
    # from the float32 state (as the reference). dt_softplus=False: dt is already processed (and the kernel
    # has no dt_limit clamp).
    return k.selective_state_update(
        ssm_states, x, dt3, A3, B, C, D=D2, z=None, dt_bias=dt_bias, dt_softplus=False,
        state_batch_indices=idx,
    )


# --------------------------------------------------------------------------------------------------------
# gated RMSNorm
# --------------------------------------------------------------------------------------------------------


def gated_rms_norm(
    x: torch.Tensor,
    z: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float,
    group_size: int,
) -> torch.Tensor:
    """y = rmsnorm_per_group(x * silu(z)) * weight (contract: reference.gated_rms_norm).

    x, z: (..., d_inner)  weight: (d_inner,)  group_size divides d_inner. Returns x.dtype.
    mamba-ssm's kernel normalises each group of group_size channels (layernorm_gated.py:108-146) and gates
    before the norm when norm_before_gate=False (:81-83), computing in float32.
    """
    d = x.shape[-1]
    if group_size <= 0 or d % group_size != 0:
        raise ValueError(f"d_inner ({d}) must be a multiple of group_size ({group_size})")
    if x.numel() == 0:
        return x.new_empty(x.shape)
    k = _kernels()
    return k.rmsnorm_fn(x, weight, None, z=z, eps=eps, group_size=group_size, norm_before_gate=False)
