"""The gated RMSNorm: mamba-ssm's ``_layer_norm_fwd`` Triton kernel (what ``rmsnorm_fn`` runs), called directly.

Contract: ``reference.gated_rms_norm``. Line numbers: mamba-ssm 2.3.2.post1.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import upstream


def gated_rms_norm(
    x: torch.Tensor,
    z: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """y = rmsnorm_per_group(x * silu(z)) * weight (contract: reference.gated_rms_norm).

    x, z: (M, d_inner)  weight: (d_inner,)  group_size divides d_inner  out: (M, d_inner) or None (written
    in place and returned). Returns x.dtype.
    mamba-ssm's kernel normalises each group of group_size channels (layernorm_gated.py:108-146) and gates
    before the norm when norm_before_gate=False (:81-83), computing in float32. ``_layer_norm_fwd`` is
    called directly (as ``rmsnorm_fn`` does inside its autograd Function) to write into ``out`` and skip the
    autograd wrapper: inference needs no backward.
    """
    d = x.shape[-1]
    if group_size <= 0 or d % group_size != 0:
        raise ValueError(f"d_inner ({d}) must be a multiple of group_size ({group_size})")
    if x.numel() == 0:
        return x.new_empty(x.shape) if out is None else out
    ops = upstream.kernels()
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    z2 = None if z is None else z.reshape(-1, d)
    if z2 is not None and z2.stride(-1) != 1:
        z2 = z2.contiguous()
    if out is not None and (out.stride(-1) != 1 or out.shape != x2.shape):
        raise ValueError(f"out must be ({x2.shape[0]}, {d}) with unit inner stride")
    y, _, _ = ops.layer_norm_fwd(x2, weight.contiguous(), None, eps, z=z2, out=out, group_size=group_size,
                               norm_before_gate=False, is_rms_norm=True)
    return y.view(x.shape)
