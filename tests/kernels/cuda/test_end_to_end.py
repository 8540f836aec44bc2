"""The CUDA wrappers together: prefill in two chunks, then decode through the pools == one reference pass."""

from __future__ import annotations

import pytest
import torch

from cuda_helpers import kern, resume_path  # noqa: F401  (fixtures)
from cuda_helpers import BF16, F32, assert_close, batch_of, case, cu_of, gen, make_pools, rnd, ssd_inputs, tol
from vllm_mamba2_plugin.kernels import cuda as ck
from vllm_mamba2_plugin.kernels import reference as ref


def _mix(k, xBC, lens, conv_pool, ssm_pool, slots, resumes, w, b, dt, A, D, c, Dx):
    """The conv -> SSD part of the mixer for a prefill batch, on kernel module k (cuda, with the builder's plan,
    or reference)."""
    batch = batch_of(lens, resumes, xBC.device, c.cs, planned=k is ck)
    conv = k.causal_conv1d(xBC, w, b, batch, conv_pool[slots], activation="silu")
    conv_pool[slots] = conv.final_states.to(conv_pool.dtype)
    x, B, C = torch.split(conv.out, [Dx, c.G * c.N, c.G * c.N], dim=-1)
    scan = k.ssd_chunk_scan(x.reshape(-1, c.H, c.P), dt, A, B.reshape(-1, c.G, c.N), C.reshape(-1, c.G, c.N),
                            batch, ssm_pool[slots], D=D)
    ssm_pool[slots] = scan.final_states.to(ssm_pool.dtype)
    return scan.y


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["tiny-g2", "real-g8"])
def test_chunked_prefill_then_decode_matches_one_pass(kern, name, dtype, resume_path):
    c = case(kern, name)
    W, Dx = 4, c.H * c.P
    Dm = Dx + 2 * c.G * c.N
    lens = [2 * c.cs + 3, 5, c.cs]
    cut = [c.cs + 1, 2, 3]  # first prefill chunk per sequence; then the rest minus 2; then 2 decode steps
    g = gen(80)
    total = sum(lens)
    xBC = rnd(g, total, Dm).to(kern.dev, dtype)
    _, dt, A, _, _, D = ssd_inputs(c, [total], dtype, kern.dev, seed=81)
    w, b = rnd(g, Dm, W, scale=0.5).to(kern.dev, dtype), rnd(g, Dm, scale=0.1).to(kern.dev, dtype)
    # the oracle: one reference pass over the whole sequences
    cu_all = cu_of(lens, kern.dev)
    conv0 = torch.zeros(16, W - 1, Dm, device=kern.dev, dtype=dtype)
    ssm0 = torch.zeros(16, c.H, c.P, c.N, device=kern.dev, dtype=F32)
    slots = torch.tensor([9, 3, 12], device=kern.dev)
    y_ref = _mix(ref, xBC, lens, conv0.clone(), ssm0.clone(), slots, True, w, b, dt, A, D, c, Dx)
    # pools with garbage in them (flags False on the first chunk must ignore it)
    _, conv_pool, ssm_pool = make_pools(16, W - 1, Dm, c.H, c.P, c.N, dtype, F32, kern.dev, seed=82)
    starts = cu_all[:-1].tolist()
    conv_pool.fill_(float("nan"))  # garbage: the first chunk (flags False) must not read it
    ssm_pool.fill_(float("nan"))
    pieces = [(0, cut), (1, [L - 2 - a for L, a in zip(lens, cut)])]
    y = torch.empty_like(y_ref)
    for has, plens in pieces:
        base = [st + (0 if not has else a) for st, a in zip(starts, cut)]
        tok = torch.cat([torch.arange(s0, s0 + n) for s0, n in zip(base, plens)]).to(kern.dev)
        y[tok] = _mix(ck, xBC[tok], plens, conv_pool, ssm_pool, slots, bool(has), w, b, dt[tok], A, D, c, Dx)
    for step in (2, 1):  # decode: the last two tokens of each sequence
        tok = torch.tensor([st + L - step for st, L in zip(starts, lens)], device=kern.dev)
        xc = ck.conv_update(xBC[tok], conv_pool, w, b, slots, activation="silu")
        xs, Bs, Cs = torch.split(xc, [Dx, c.G * c.N, c.G * c.N], dim=-1)
        y[tok] = ck.ssm_state_update(ssm_pool, xs.reshape(-1, c.H, c.P), dt[tok], A, Bs.reshape(-1, c.G, c.N),
                                     Cs.reshape(-1, c.G, c.N), slots, D=D)
    assert_close(y, y_ref, 2 * tol(kern, "ssd", dtype), "outputs over all tokens")
