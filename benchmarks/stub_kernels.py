"""Upstream kernel entry points that only allocate their outputs: the plugin's CUDA path on a CPU, minus the compute.

``installed()`` puts these in place of ``kernels/cuda/upstream.kernels()`` (mamba-ssm's SSD forward,
``chunk_state_varlen``, state update, gated norm; causal-conv1d's forward and update), each with the signature the
wrappers call and outputs of the upstream's shapes and dtypes, left uninitialised. What a layer then runs on the
CPU is the plugin's own host work -- its Python, its torch ops (views, gathers, plan lookups), the tensors it
allocates -- which on the GPU runs ahead of the kernels and bounds a host-bound step. The kernels' own Python
wrappers are not run. The values are garbage, and the CPU's time is not the GPU's host time (gathers and copies
move data here, where the GPU launches them): use it to count the torch ops (``prefill_layer.py --kernels stub``).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from unittest import mock

import torch


def _ssd_fwd(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
             cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    """_mamba_chunk_scan_combined_fwd's tuple: out, out_x, dt, dA_cumsum, states, final_states[, varlen_states]."""
    batch, seqlen, H, P = x.shape
    N = B.shape[-1]
    Q = -(-seqlen // chunk_size)
    f32 = dict(dtype=torch.float32, device=x.device)
    res = (torch.empty_like(x), None, torch.empty(batch, H, Q, chunk_size, **f32),
           torch.empty(batch, H, Q, chunk_size, **f32), x.new_empty(batch, Q, H, P, N, dtype=C.dtype),
           torch.empty(batch, H, P, N, **f32))
    if cu_seqlens is None:
        return res
    return res + (x.new_empty(cu_seqlens.numel() - 1, H, P, N, dtype=C.dtype),)


def _chunk_state_varlen(B, x, dt, dA_cumsum, cu_seqlens, chunk_states):
    _, H, P = x.shape
    return x.new_empty(cu_seqlens.numel() - 1, H, P, B.shape[-1], dtype=chunk_states.dtype)


def _state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, state_batch_indices=None):
    return torch.empty_like(x)


def _layer_norm_fwd(x, weight, bias, eps, z=None, out=None, group_size=None, norm_before_gate=True,
                    is_rms_norm=False):
    return (torch.empty_like(x) if out is None else out), None, None


def _in_place(*args):
    """causal-conv1d's forward and update extensions write into an ``out`` argument and return nothing."""
    return None


class _NoLaunch:
    """A Triton kernel's ``kernel[grid](...)``."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


STUBS = SimpleNamespace(ssd_fwd=_ssd_fwd, chunk_state_varlen=_chunk_state_varlen, selective_state_update=_state_update,
                        ssu_kernel=_NoLaunch(), layer_norm_fwd=_layer_norm_fwd, conv_fwd=_in_place,
                        conv_update=_in_place)


@contextlib.contextmanager
def installed():
    """The plugin's CUDA path on the CPU: the mixer and the metadata builder take the CUDA kernels module, whose
    upstream entry points are these stubs; a table launch's ``torch.cuda.device`` scope is a no-op."""
    from vllm_mamba2_plugin import backend, mixer
    from vllm_mamba2_plugin.kernels import cuda
    from vllm_mamba2_plugin.kernels.cuda import upstream

    with mock.patch.object(upstream, "_KERNELS", STUBS), mock.patch.object(mixer, "get_kernels", lambda dev: cuda), \
            mock.patch.object(backend, "get_kernels", lambda dev: cuda), \
            mock.patch.object(torch.cuda, "device", lambda index: contextlib.nullcontext()):
        yield
