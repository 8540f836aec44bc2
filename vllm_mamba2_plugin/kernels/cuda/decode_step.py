"""The decode step's SSM recurrence: mamba-ssm's ``selective_state_update`` Triton kernel, with our launch tile.

Contract and notation: ``reference.ssm_state_update`` (B rows, H heads, P head dim, G groups, N state size).
Line numbers: mamba-ssm 2.3.2.post1. (The decode step's conv is ``conv.conv_update``.)

``ssm_state_update`` makes ONE launch per layer, in the multi-head form with dt / A / dt_bias / D broadcast by
stride-0 ``expand``, which takes the kernel's TIE_HDIM scalar path. Where ``SSU_LAUNCH_TABLE`` has a measured
tile for the shape, the kernel is launched directly with it (``_launch_ssu``, the wrapper's own launch with
another BLOCK_SIZE_M / num_warps); otherwise through mamba-ssm's wrapper. ``ssu_warm_batches`` tells the
warm-up which batch sizes compile every launch the table can pick.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import reference
from . import upstream


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
    launch: Optional[Tuple[int, int]] = None,
) -> torch.Tensor:
    """One decode step of the SSM recurrence, updating the pool in place (contract: reference.ssm_state_update).

    ssm_states: (num_slots, H, P, N) pool (any slot stride)  x: (B, H, P)  dt: (B, H) processed, or raw with
    dt_bias (H,) and dt_softplus=True (the kernel then computes softplus(dt + dt_bias))  A: (H,)
    B, C: (B, G, N)  state_indices: (B,) int  D: (H,) | (H, P) | None  returns y: (B, H, P) in x.dtype.
    out: (B, H, P), any strides: y is written there (by the kernel itself on a table launch, which takes out's
    strides), and returned. launch: (BLOCK_SIZE_M, num_warps) for the kernel; None: ``ssu_launch_config`` (the
    upstream launch when it has no entry).
    """
    Bsz, H, P = x.shape
    N = ssm_states.shape[-1]
    reference.heads_per_group(H, B.shape[-2])
    if Bsz == 0:
        return x.new_empty(0, H, P) if out is None else out
    ops = upstream.kernels()
    dev = x.device
    # int64 indices: the Triton kernel offsets the pool by index * slot stride (selective_state_update.py:60-65)
    # and an int64 index keeps that product 64-bit for large pools. The kernel reads index pid_b at
    # ptr + pid_b, so the tensor must be contiguous. (No copy when the caller already passes int64.)
    idx = upstream.unit_stride(state_indices.to(device=dev, dtype=torch.int64))
    # Multi-head form: dt (B, H, P), A (H, P, N), dt_bias (H, P), D (H, P), broadcast with stride 0 (as vLLM
    # does). With A, dt and dt_bias all stride-0 in the head dim the kernel takes its TIE_HDIM path
    # (selective_state_update.py:199): one scalar dt and exp(dt*A) per head. The kernel loads dt in any float
    # dtype and computes in float32, so dt is passed as it comes (no cast launch).
    # dt_bias and D must NOT be None here: the call site unpacks `*(t.stride(0), t.stride(1)) if t is not None
    # else 0`, i.e. `*0` -> TypeError for None (selective_state_update.py:207, 211), and line 199 evaluates
    # dt_bias.stride(-1) whenever A and dt are tied. So pass zeros (adding 0.0 to dt is exact).
    dt3 = dt[:, :, None].expand(Bsz, H, P)
    A3 = A.to(torch.float32)[:, None, None].expand(H, P, N)
    bias2 = _zeros_h1(H, dev) if dt_bias is None else dt_bias.to(torch.float32)[:, None]
    D2 = _zeros_h1(H, dev) if D is None else D
    D2 = D2[:, None].expand(H, P) if D2.dim() == 1 else (D2.expand(H, P) if D2.shape[-1] == 1 else D2)
    # The kernel reads the state in its dtype, computes in float32 and stores back in the pool dtype; y comes
    # from the float32 state (as the reference). dt_softplus uses threshold 20 (selective_state_update.py:102),
    # as torch's softplus; the kernel has no dt_limit clamp, so a clamped dt must come processed.
    cfg = launch if launch is not None else ssu_launch_config(Bsz, H, P, N, ssm_states.dtype)
    if cfg is None:
        y = ops.selective_state_update(
            ssm_states, x, dt3, A3, B, C, D=D2, z=None, dt_bias=bias2.expand(H, P),
            dt_softplus=bool(dt_softplus), state_batch_indices=idx,
        )
        return y if out is None else out.copy_(y)
    return _launch_ssu(ops, ssm_states, x, dt3, bias2.expand(H, P), A3, B, C, D2, idx, bool(dt_softplus), *cfg,
                       out=out)


# (BLOCK_SIZE_M, num_warps) for mamba-ssm's ``_selective_scan_update_kernel``, keyed by (head_dim, d_state, state
# bytes); shapes not in the table keep the upstream launch. Its wrapper launches one fixed tile per d_state
# (selective_state_update.py:193-197: (4, 4) for d_state 128, (8, 4) for 64) whatever the batch: head_dim/4 x
# batch x heads programs of one 4 x 128 tile each, far from the memory floor at large batch. vLLM's in-tree copy
# reads tuned H200 files for head_dim 64 / d_state 128 only and falls back to the same tiles elsewhere.
# The entries are measured (benchmarks/ssu_launch.py; the numbers: RESULTS.md, "State-update launch"):
# - 16-bit states: a 16-row tile beats upstream's from the batch*heads where each entry starts, on every measured
#   shape: two warps for d_state 128 (head_dim 64 and 128), one for d_state 64. Head_dim 128 / d_state 128 was
#   measured from batch 1, where upstream's tile is already slower; the other shapes' entries start at their
#   smallest measured batch*heads (2048).
# - fp32 states (--mamba-ssm-cache-dtype float32): (64, 128) takes vLLM 0.26's tuned H200 tiles (its
#   headdim=64,dstate=128,...,cache_dtype=float32.json), simplified to two; (128, 128) takes an 8-row tile of one
#   warp from batch 1 (near the best tile up to batch 64); the other shapes were measured at batch 256 only,
#   where the optimum is flat among 8- and 16-row tiles and upstream's tile is slower.
SSU_LAUNCH_TABLE: dict = {
    (64, 128, 2): [(64, (16, 2))],  # [(min batch*heads, (BLOCK_SIZE_M, num_warps)), ...] ascending
    (128, 128, 2): [(1, (16, 2))],
    (128, 64, 2): [(2048, (16, 1))],
    (64, 64, 2): [(2048, (16, 1))],
    (64, 128, 4): [(64, (4, 1)), (12288, (8, 1))],
    (128, 128, 4): [(1, (8, 1)), (8192, (8, 2))],
    (128, 64, 4): [(8192, (16, 1))],
    (64, 64, 4): [(8192, (16, 1))],
}


def ssu_launch_config(batch: int, nheads: int, head_dim: int, dstate: int,
                      state_dtype: torch.dtype) -> Optional[Tuple[int, int]]:
    """The launch to use, or None for mamba-ssm's own (its wrapper)."""
    rows = SSU_LAUNCH_TABLE.get((head_dim, dstate, state_dtype.itemsize))
    cfg = None
    for lo, c in rows or ():
        if batch * nheads >= lo:
            cfg = c
    return cfg


def ssu_warm_batches(nheads: int, head_dim: int, dstate: int, state_dtype: torch.dtype) -> list:
    """Batch sizes whose state updates compile every launch ``ssu_launch_config`` can pick for this layer, each
    under each of Triton's specialisations of the integer ``batch`` argument (== 1, multiple of 16, other).
    A launch the warm-up never ran is compiled the first time a step needs it, while serving (vLLM's JIT monitor
    showed one: benchmarks/RESULTS.md); a compile inside a CUDA-graph capture would fail."""
    rows = SSU_LAUNCH_TABLE.get((head_dim, dstate, state_dtype.itemsize), ())
    starts = sorted({1} | {max(1, -(-lo // nheads)) for lo, _ in rows})  # first batch of each launch's range
    out = set()
    for b, nxt in zip(starts, starts[1:] + [float("inf")]):
        out |= {c for c in (b, b + 1, (b // 16 + 1) * 16) if c < nxt}
    return sorted(out)


def _launch_ssu(ops, state, x, dt, dt_bias, A, B, C, D, idx, dt_softplus: bool, block_m: int, num_warps: int,
                out: Optional[torch.Tensor] = None):
    """mamba-ssm's ``_selective_scan_update_kernel`` launched exactly as its wrapper does
    (selective_state_update.py:186-219: same arguments, z = None), but with the given tile and warp count, into
    ``out`` when given (the kernel takes its strides)."""
    batch, nheads, dim = x.shape
    dstate = state.shape[-1]
    out = torch.empty_like(x) if out is None else out
    grid = ((dim + block_m - 1) // block_m, batch, nheads)
    tie_hdim = A.stride(-1) == 0 and A.stride(-2) == 0 and dt.stride(-1) == 0 and dt_bias.stride(-1) == 0
    with torch.cuda.device(x.device.index):
        ops.ssu_kernel[grid](
            state, x, dt, dt_bias, A, B, C, D, None, out, idx,
            batch, nheads, dim, dstate, nheads // B.shape[1],
            *state.stride(), *x.stride(), *dt.stride(), *dt_bias.stride(), *A.stride(), *B.stride(),
            *C.stride(), *D.stride(), 0, 0, 0, *out.stride(),
            dt_softplus, tie_hdim, block_m, num_warps=num_warps,
        )
    return out


_ZEROS: dict = {}


def _zeros_h1(H: int, dev: torch.device) -> torch.Tensor:
    """A cached (H, 1) float32 zero column per device (a fresh one per call would be one more launch per layer)."""
    key = (H, dev)
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros(H, 1, dtype=torch.float32, device=dev)
    return _ZEROS[key]
