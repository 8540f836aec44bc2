"""kernels/cuda/norm.py against kernels.reference."""

from __future__ import annotations

import pytest
import torch

from cuda_helpers import kern  # noqa: F401  (fixtures)
from cuda_helpers import BF16, F32, assert_close, gen, rnd, tol
from vllm_mamba2_plugin.kernels import cuda as ck
from vllm_mamba2_plugin.kernels import reference as ref


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n_groups", [1, 2, 8])
@pytest.mark.parametrize("d_inner", [128, 1536])
def test_gated_rms_norm(kern, d_inner, n_groups, dtype):
    g = gen(70)
    T = 37
    proj = rnd(g, T, 2 * d_inner + 9).to(kern.dev, dtype)
    z = proj[:, :d_inner]  # strided, as the mixer's z
    x = rnd(g, T, d_inner, scale=3.0).to(kern.dev, dtype)
    w = (1 + 0.1 * rnd(g, d_inner)).to(kern.dev, dtype)
    gs = d_inner // n_groups
    for zz in (z, None):
        out = ck.gated_rms_norm(x, zz, w, 1e-5, gs)
        out_r = ref.gated_rms_norm(x, zz, w, 1e-5, gs)
        assert out.dtype == dtype and out.shape == x.shape
        assert_close(out, out_r, tol(kern, "norm", dtype), f"gated={zz is not None}")
    # Into a caller's buffer (the mixer's op output), rows of a larger, padded tensor.
    buf = torch.full((T + 5, d_inner), 7.0, dtype=dtype, device=kern.dev)
    got = ck.gated_rms_norm(x, z, w, 1e-5, gs, out=buf[:T])
    assert got.data_ptr() == buf.data_ptr()
    assert_close(buf[:T], ref.gated_rms_norm(x, z, w, 1e-5, gs), tol(kern, "norm", dtype), "into out")
    assert bool((buf[T:] == 7.0).all()), "wrote past out"
