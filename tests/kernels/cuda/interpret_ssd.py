"""pytest plugin for scripts/interpret-ssd-tests.sh: the "fake" backend's SSD forward and chunk_state_varlen are
mamba-ssm's real ``_mamba_chunk_scan_combined_fwd`` and ``chunk_state_varlen``, their Triton kernels run by
Triton's interpreter on the CPU (TRITON_INTERPRET=1, set before mamba-ssm is imported), called as
``upstream.kernels()`` hands them out. The other upstream kernels stay plain-torch stand-ins.

The interpreter multiplies in numpy's float32 whatever a dot's precision; here a TF32 dot rounds its float32
operands to TF32 first, as an NVIDIA GPU's tensor cores do (Triton's default precision for float32 dots), so the
precision the plugin compiles the kernels with shows in the results."""

import contextlib

import numpy as np
import torch
from triton._C.libtriton import ir as _ir
from triton.runtime import interpreter as _interpreter

import fakes
from vllm_mamba2_plugin.kernels.cuda import upstream

_interpreted_dot = _interpreter.InterpreterBuilder.create_dot


def _dot_as_on_gpu(self, a, b, d, input_precision, max_num_imprecise_acc):
    if input_precision == _ir.INPUT_PRECISION.TF32:
        a, b = (_interpreter.TensorHandle(_interpreter._round_f32_to_tf32(t.data), t.dtype)
                if t.data.dtype == np.float32 else t for t in (a, b))
    return _interpreted_dot(self, a, b, d, input_precision, max_num_imprecise_acc)


_interpreter.InterpreterBuilder.create_dot = _dot_as_on_gpu

# mamba-ssm enters each call's CUDA device (ssd_combined.py: `with torch.cuda.device(x.device.index)`); the
# interpreter needs none.
torch.cuda.device = lambda *a, **k: contextlib.nullcontext()

from mamba_ssm.ops.triton.ssd_chunk_state import chunk_state_varlen  # noqa: E402
from mamba_ssm.ops.triton.ssd_combined import _mamba_chunk_scan_combined_fwd  # noqa: E402


def _ssd_fwd(x, dt, A, B, C, chunk_size, **kw):
    """The real forward. The interpreter computes through numpy, which has no bfloat16: 16-bit inputs go in as
    float32 (the kernels load them and compute in float32 anyway), and the outputs come back in the dtypes the
    kernels give them (out in x's, passed states in C's; dt, dA_cumsum and final states stay float32)."""
    low = {t.dtype for t in (x, dt, B, C)} - {torch.float32}
    if not low:
        return _mamba_chunk_scan_combined_fwd(x, dt, A, B, C, chunk_size, **kw)
    kw = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kw.items()}
    res = list(_mamba_chunk_scan_combined_fwd(x.float(), dt.float(), A, B.float(), C.float(), chunk_size, **kw))
    res[0] = res[0].to(x.dtype)
    res[4] = res[4].to(C.dtype)
    if len(res) > 6:  # varlen states, in C's dtype
        res[6] = res[6].to(C.dtype)
    return tuple(res)


def _chunk_state_varlen(B, x, dt, dA_cumsum, cu_seqlens, chunk_states):
    """The real one, 16-bit inputs in float32 as above; the states come back in chunk_states' dtype."""
    return chunk_state_varlen(B.float(), x.float(), dt, dA_cumsum, cu_seqlens,
                              chunk_states.float()).to(chunk_states.dtype)


fakes.FAKE_KERNELS.ssd_fwd = upstream.fp32_products_in_ieee(_ssd_fwd)
fakes.FAKE_KERNELS.chunk_state_varlen = upstream.fp32_products_in_ieee(_chunk_state_varlen)
