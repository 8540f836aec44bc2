"""CUDA kernels: thin wrappers over mamba-ssm (Triton SSD, state update, gated RMSNorm) and causal-conv1d.

The same functions, signatures and semantics as ``kernels/reference.py`` (read it for the contract and the
notation). One module per op, each with its upstream limits and the reasons for its call plan:

    ssd_prefill.py    plan_prefill, ssd_chunk_scan   packed SSD scan; per-sequence initial states (the paths);
                                                     prefix caching's block-boundary states
    conv.py           causal_conv1d, conv_update     causal-conv1d forward (prefill) and update (decode);
                      conv_states_at                 prefix caching's block-boundary conv states (gathers)
    decode_step.py    ssm_state_update               selective_state_update with measured launch tiles
    norm.py           gated_rms_norm                 mamba-ssm's gated RMSNorm kernel
    warmup.py         warm_up                        compiles / autotunes every launch in the profile run
    varlen_plan.py    the step's prefill index plan (host-built, one upload, shared by every layer)
    upstream.py       the lazy import of the upstream entry points; fallbacks to the reference
    triton_launch.py  patch list: a cheaper launch of mamba-ssm's Triton kernels, vLLM's SSD config lists

Importing this package imports neither mamba_ssm nor causal_conv1d (``upstream.kernels()`` does, at the first
call): plugin import and ``register()`` must not touch CUDA.
"""

import torch

from ..reference import process_dt  # noqa: F401  (plain torch; the mixer's prefill path lets the SSD kernel do it)
from .conv import causal_conv1d, conv_states_at, conv_update
from .decode_step import ssm_state_update
from .norm import gated_rms_norm
from .ssd_prefill import plan_prefill, ssd_chunk_scan
from .warmup import warm_up

STATE_UPDATE_INDEX_DTYPE = torch.int64  # (interface.Mamba2Kernels) decode_step: 64-bit pool offsets

__all__ = [
    "plan_prefill",
    "ssd_chunk_scan",
    "causal_conv1d",
    "conv_update",
    "ssm_state_update",
    "process_dt",
    "gated_rms_norm",
    "warm_up",
    "conv_states_at",
]
