"""kernels/cuda/decode_step.py against kernels.reference: the SSM state update, its launch tiles and padding
rows, on vLLM-style strided pools.
"""

from __future__ import annotations

import pytest
import torch

from cuda_helpers import kern  # noqa: F401  (fixtures)
from cuda_helpers import BF16, F32, SLOTS, assert_close, case, gen, make_pools, pool_views, rnd, ssd_inputs, tol
from vllm_mamba2_plugin.kernels import cuda as ck
from vllm_mamba2_plugin.kernels import reference as ref
from vllm_mamba2_plugin.kernels.cuda import decode_step


@pytest.mark.parametrize("dtypes", [(F32, F32), (BF16, F32), (BF16, BF16)],
                         ids=["f32", "bf16-x-f32-pool", "bf16"])
@pytest.mark.parametrize("with_D", [True, False], ids=["D", "noD"])
@pytest.mark.parametrize("name", ["tiny-g1", "tiny-g2", "tiny-g8", "real-g1", "real-g8"])
def test_ssm_state_update_pool(kern, name, with_D, dtypes):
    c = case(kern, name)
    x_dtype, pool_dtype = dtypes
    shape = (3, 16, c.H, c.P, c.N, F32, pool_dtype)
    raw, _, ssm = make_pools(16, *shape, kern.dev, seed=50)
    raw_r = raw.clone()
    _, ssm_r, _, ssm_off = pool_views(raw_r, *shape)
    Bsz = len(SLOTS)
    x, dt, A, B, C, D = ssd_inputs(c, [Bsz], x_dtype, kern.dev, seed=60)
    D = D if with_D else None
    idx = torch.tensor(SLOTS, dtype=torch.int64, device=kern.dev)
    for step in range(2):
        y = ck.ssm_state_update(ssm, x, dt, A, B, C, idx, D=D)
        y_r = ref.ssm_state_update(ssm_r, x, dt, A, B, C, idx, D=D)
        assert y.dtype == x_dtype
        t = tol(kern, "ssm", x_dtype if pool_dtype == F32 else BF16)
        assert_close(y, y_r, t, f"y step {step}")
        assert_close(ssm[idx], ssm_r[idx], tol(kern, "ssm", pool_dtype), f"states step {step}")
        x = x.flip(0)
    untouched = [s for s in range(16) if s not in SLOTS]
    assert torch.equal(raw[untouched].cpu(), raw_r[untouched].cpu()), "untouched slots must be bit-identical"
    assert torch.equal(raw[SLOTS, :ssm_off].cpu(), raw_r[SLOTS, :ssm_off].cpu()), "wrote outside the ssm state"


@pytest.mark.parametrize("pool_dtype", [BF16, F32], ids=["bf16_state", "f32_state"])
@pytest.mark.parametrize("H, G, P, N", [(24, 1, 64, 128), (80, 1, 64, 128), (128, 8, 64, 128), (48, 4, 128, 128),
                                        (32, 8, 128, 64), (48, 4, 64, 64)],
                         ids=["130m", "2.7b", "7b", "p128_n128", "p128_n64", "p64_n64"])
@pytest.mark.parametrize("launch", [None, (16, 2), (32, 4), (4, 4), (16, 1), (8, 2)],
                         ids=["table", "16x2", "32x4", "4x4", "16x1", "8x2"])
def test_ssm_state_update_launch_configs(kern, H, G, P, N, launch, pool_dtype):
    """The plugin's own launches of mamba-ssm's state-update kernel (ssu_launch_config's table, and explicit
    tiles) on the decode grid's (head_dim, d_state) pairs, bf16 and fp32 pools with bf16 inputs: same results as
    the plain-torch reference, other slots intact."""
    if kern.name == "fake":
        pytest.skip("launches the Triton kernel itself: GPU only")
    Bsz, slots = 64, 150
    g = gen(63)
    pool = (0.5 * rnd(g, slots, H, P, N)).to(kern.dev, pool_dtype)
    pool_r = pool.clone()
    idx = torch.randperm(slots, generator=g)[:Bsz].to(kern.dev)
    x = rnd(g, Bsz, H, P).to(kern.dev, BF16)
    dt = rnd(g, Bsz, H).to(kern.dev, BF16)
    dt_bias = rnd(g, H, scale=0.5).to(kern.dev)
    A = -torch.exp(torch.rand(H, generator=g) * 2.7).to(kern.dev)
    B, C = rnd(g, Bsz, G, N).to(kern.dev, BF16), rnd(g, Bsz, G, N).to(kern.dev, BF16)
    D = rnd(g, H).to(kern.dev)
    if launch is None and (P, N) == (64, 128):  # the table's H200 choice applies here (batch*heads 1536-8192)
        assert decode_step.ssu_launch_config(Bsz, H, P, N, pool_dtype) == ((16, 2) if pool_dtype == BF16 else (4, 1))
    y = ck.ssm_state_update(pool, x, dt, A, B, C, idx, D=D, dt_bias=dt_bias, dt_softplus=True, launch=launch)
    y_r = ref.ssm_state_update(pool_r, x, ref.process_dt(dt, dt_bias), A, B, C, idx, D=D)
    assert_close(y, y_r, tol(kern, "ssm", BF16), "y")
    assert_close(pool[idx], pool_r[idx], tol(kern, "ssm", pool_dtype), "states")
    rest = torch.ones(slots, dtype=torch.bool, device=kern.dev)
    rest[idx] = False
    assert torch.equal(pool[rest], pool_r[rest]), "slots outside the batch must be untouched"


def test_ssu_launch_table_keeps_upstream_for_unmeasured_shapes():
    assert decode_step.ssu_launch_config(1, 24, 64, 128, BF16) is None  # batch*heads 24: upstream's launch
    assert decode_step.ssu_launch_config(2, 24, 64, 128, F32) is None  # fp32 state, batch*heads 48: upstream's launch
    assert decode_step.ssu_launch_config(64, 24, 64, 128, F32) == (4, 1)  # fp32 state: vLLM's tuned H200 tiles
    assert decode_step.ssu_launch_config(256, 80, 64, 128, F32) == (8, 1)
    assert decode_step.ssu_launch_config(64, 24, 64, 128, torch.float64) is None  # 8-byte state: no entry
    assert decode_step.ssu_launch_config(64, 24, 32, 128, BF16) is None  # head_dim 32: not measured
    assert decode_step.ssu_launch_config(4, 24, 64, 128, torch.float16) == (16, 2)
    # head_dim 128 / d_state 128: measured from batch 1; d_state 64: from batch*heads 2048 (16-bit)
    assert decode_step.ssu_launch_config(1, 48, 128, 128, BF16) == (16, 2)
    assert decode_step.ssu_launch_config(43, 48, 128, 128, BF16) == (16, 2)
    assert decode_step.ssu_launch_config(42, 48, 128, 64, BF16) is None
    assert decode_step.ssu_launch_config(256, 32, 128, 64, BF16) == (16, 1)
    assert decode_step.ssu_launch_config(256, 48, 64, 64, BF16) == (16, 1)
    assert decode_step.ssu_launch_config(1, 48, 128, 128, F32) == (8, 1)
    assert decode_step.ssu_launch_config(128, 48, 128, 128, F32) == (8, 1)
    assert decode_step.ssu_launch_config(256, 48, 128, 128, F32) == (8, 2)


@pytest.mark.parametrize("launch", [None, (16, 2)], ids=["upstream", "16x2"])
@pytest.mark.parametrize("H, G", [(8, 2), (80, 1)], ids=["tiny", "2.7b"])
def test_decode_padding_rows_are_skipped(kern, H, G, launch):
    """FULL decode graphs pad a batch to a captured size with slot id -1 (decode_graph.PAD_SLOT): both decode
    kernels must give those rows 0 and leave EVERY slot but the real rows' bit-identical (slot 0 included),
    even with non-finite inputs on the padding rows; the real rows match the reference run without padding."""
    if kern.name == "fake" and (launch is not None or H > 8):
        pytest.skip("the plugin's own state-update launch and real shapes run on the GPU only")
    P, N, K, Dm, slots = 16 if H == 8 else 64, 16 if H == 8 else 128, 3, 40, 12
    shape = (K, Dm, H, P, N, BF16, BF16)
    raw, conv, ssm = make_pools(slots, *shape, kern.dev, seed=70)
    raw_r = raw.clone()
    conv_r, ssm_r, _, _ = pool_views(raw_r, *shape)
    real_slots = [5, 9, 2]
    idx = torch.tensor([5, -1, 9, -1, 2, -1], device=kern.dev)  # padding rows between real ones
    real_rows = [0, 2, 4]
    pad_rows = [1, 3, 5]
    g = gen(71)
    x = rnd(g, 6, Dm).to(kern.dev, BF16)
    xs = rnd(g, 6, H, P).to(kern.dev, BF16)
    dt = rnd(g, 6, H).to(kern.dev, BF16)
    B, C = rnd(g, 6, G, N).to(kern.dev, BF16), rnd(g, 6, G, N).to(kern.dev, BF16)
    for t in (x, xs, dt, B, C):
        t[pad_rows] = float("nan")  # whatever the padded rows carry must not leak anywhere
    w, b = rnd(g, Dm, K + 1, scale=0.5).to(kern.dev, BF16), rnd(g, Dm, scale=0.1).to(kern.dev, BF16)
    A = -torch.exp(torch.rand(H, generator=g) * 2.7).to(kern.dev)
    dt_bias, D = rnd(g, H, scale=0.5).to(kern.dev), rnd(g, H).to(kern.dev)

    y_conv = ck.conv_update(x, conv, w, b, idx.to(torch.int32))
    y_ssm = ck.ssm_state_update(ssm, xs, dt, A, B, C, idx, D=D, dt_bias=dt_bias, dt_softplus=True, launch=launch)
    ridx = torch.tensor(real_slots, device=kern.dev)
    y_conv_r = ref.conv_update(x[real_rows], conv_r, w, b, ridx)
    y_ssm_r = ref.ssm_state_update(ssm_r, xs[real_rows], dt[real_rows], A, B[real_rows], C[real_rows], ridx, D=D,
                                   dt_bias=dt_bias, dt_softplus=True)
    assert torch.equal(y_conv[pad_rows].float().cpu(), torch.zeros(3, Dm)), "padded conv rows must be 0"
    assert torch.equal(y_ssm[pad_rows].float().cpu(), torch.zeros(3, H, P)), "padded SSM rows must be 0"
    assert_close(y_conv[real_rows], y_conv_r, tol(kern, "conv", BF16), "conv out")
    assert_close(y_ssm[real_rows], y_ssm_r, tol(kern, "ssm", BF16), "ssm out")
    assert_close(conv[real_slots], conv_r[real_slots], 1e-6, "conv states")
    assert_close(ssm[real_slots], ssm_r[real_slots], tol(kern, "ssm", BF16), "ssm states")
    others = [s for s in range(slots) if s not in real_slots]
    assert torch.equal(raw[others].cpu(), raw_r[others].cpu()), "a padded row touched a slot (slot 0 included)"


@pytest.mark.parametrize("name", ["tiny-g2", "real-g8"])
def test_ssm_state_update_softplus_in_kernel(kern, name):
    """Raw dt + dt_bias with dt_softplus=True (the mixer's decode path for the default time_step_limit) ==
    the reference fed with process_dt's step sizes; large raw values cross softplus's threshold of 20."""
    c = case(kern, name)
    g = gen(61)
    pool = rnd(g, 8, c.H, c.P, c.N).to(kern.dev)
    pool_r = pool.clone()
    x, _, A, B, C, D = ssd_inputs(c, [4], BF16, kern.dev, seed=62)
    dt_raw = (4 * rnd(g, 4, c.H)).to(kern.dev, BF16)
    dt_raw[0, 0] = 30.0  # above the threshold: linear
    dt_bias = rnd(g, c.H, scale=0.5).to(kern.dev)
    idx = torch.tensor([5, 0, 7, 2], dtype=torch.int64, device=kern.dev)
    y = ck.ssm_state_update(pool, x, dt_raw, A, B, C, idx, D=D, dt_bias=dt_bias, dt_softplus=True)
    y_r = ref.ssm_state_update(pool_r, x, ref.process_dt(dt_raw, dt_bias), A, B, C, idx, D=D)
    assert_close(y, y_r, tol(kern, "ssm", BF16), "y")
    assert_close(pool, pool_r, tol(kern, "ssm", F32), "states")


@pytest.mark.parametrize("H, G, launch", [(8, 2, None), (80, 1, (16, 2))], ids=["upstream", "16x2"])
def test_ssm_state_update_writes_y_into_a_strided_out(kern, H, G, launch):
    """out= (a verification step's column of its (rows, m, H, P) output): the same y and states as without, the
    other columns untouched; on an explicit launch the kernel writes through out's strides."""
    if launch is not None and kern.name == "fake":
        pytest.skip("launches the Triton kernel itself: GPU only")
    P, N, Bsz, slots, m = 64, 128, 4, 9, 3
    g = gen(71)
    pool = (0.5 * rnd(g, slots, H, P, N)).to(kern.dev, BF16)
    pool_r = pool.clone()
    idx = torch.tensor([7, 2, 5, 0], device=kern.dev)
    x, dt = rnd(g, Bsz, H, P).to(kern.dev, BF16), rnd(g, Bsz, H).to(kern.dev, BF16)
    A, dt_bias = -torch.exp(torch.rand(H, generator=g)).to(kern.dev), rnd(g, H, scale=0.5).to(kern.dev)
    B, C = rnd(g, Bsz, G, N).to(kern.dev, BF16), rnd(g, Bsz, G, N).to(kern.dev, BF16)
    buf = torch.full((Bsz, m, H, P), 7.0, dtype=BF16, device=kern.dev)
    got = ck.ssm_state_update(pool, x, dt, A, B, C, idx, dt_bias=dt_bias, dt_softplus=True, launch=launch,
                              out=buf[:, 1])
    want = ck.ssm_state_update(pool_r, x, dt, A, B, C, idx, dt_bias=dt_bias, dt_softplus=True, launch=launch)
    assert got.data_ptr() == buf[:, 1].data_ptr()
    assert torch.equal(buf[:, 1], want) and torch.equal(pool, pool_r)
    assert bool((buf[:, 0] == 7).all()) and bool((buf[:, 2] == 7).all())
