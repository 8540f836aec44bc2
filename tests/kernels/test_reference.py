"""Tests of vllm_mamba2_plugin.kernels.reference against an independent step-by-step recurrence.

The oracle below is deliberately naive and written from the Mamba-2 paper, not from the chunked algorithm:
a Python loop over tokens (and heads), float64, per-token conv state shift,
    h = exp(dt*A) h + dt * x ⊗ B ;  y = h · C + D x,
and a gated RMSNorm with an explicit loop over groups (docs/architecture.md §6: the per-group norm is the correct one).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vllm_mamba2_plugin.kernels.interface import PrefillBatch
from vllm_mamba2_plugin.kernels.reference import (
    causal_conv1d,
    conv_states_at,
    conv_update,
    gated_rms_norm,
    process_dt,
    ssd_chunk_scan,
    ssm_state_update,
)

F64 = torch.float64
H, P, N = 8, 4, 6  # heads, head dim, state size


# ------------------------------------------------------------------------------------------------------
# the independent oracle (float64, one token at a time)
# ------------------------------------------------------------------------------------------------------


def oracle_ssm(x, dt, A, B, C, lens, h0s=None, D=None):
    """x (T,H,P) dt (T,H) A (H,) B,C (T,G,N); h0s: list (per sequence) of (H,P,N) or None.
    Returns y (T,H,P) and finals (S,H,P,N), float64."""
    x, dt, A, B, C = (t.to(F64) for t in (x, dt, A, B, C))
    T, nh, hp = x.shape
    G, ns = B.shape[1], B.shape[2]
    y = torch.zeros(T, nh, hp, dtype=F64)
    finals = []
    t0 = 0
    for s, L in enumerate(lens):
        fin = torch.zeros(nh, hp, ns, dtype=F64)
        for hd in range(nh):
            g = hd // (nh // G)
            if h0s is not None and h0s[s] is not None:
                h = h0s[s][hd].to(F64).clone()
            else:
                h = torch.zeros(hp, ns, dtype=F64)
            for t in range(t0, t0 + L):
                h = math.exp(dt[t, hd].item() * A[hd].item()) * h + dt[t, hd] * torch.outer(x[t, hd], B[t, g])
                y[t, hd] = h @ C[t, g]
                if D is not None:
                    y[t, hd] += D[hd].to(F64) * x[t, hd]
            fin[hd] = h
        finals.append(fin)
        t0 += L
    return y, torch.stack(finals)


def oracle_conv(u, w, b, lens, inits=None, activation="silu"):
    """u (T,D) w (D,W) b (D,) or None; inits: list of (W-1,D) or None. Returns out (T,D), finals (S,W-1,D)."""
    u, w = u.to(F64), w.to(F64)
    T, Dm = u.shape
    W = w.shape[1]
    out = torch.zeros(T, Dm, dtype=F64)
    finals = []
    t0 = 0
    for s, L in enumerate(lens):
        if inits is not None and inits[s] is not None:
            state = inits[s].to(F64).clone()
        else:
            state = torch.zeros(W - 1, Dm, dtype=F64)
        for t in range(t0, t0 + L):
            window = torch.cat([state, u[t][None]], dim=0)  # (W, D) oldest first
            v = (window.T * w).sum(-1)
            if b is not None:
                v = v + b.to(F64)
            if activation == "silu":
                v = v * torch.sigmoid(v)
            out[t] = v
            state = window[1:]  # per-token shift
        finals.append(state)
        t0 += L
    return out, torch.stack(finals)


def oracle_norm(x, z, weight, eps, n_groups):
    v = x.to(F64) * F.silu(z.to(F64))
    d = v.shape[-1]
    gs = d // n_groups
    out = torch.empty_like(v)
    for g in range(n_groups):
        seg = v[:, g * gs : (g + 1) * gs]
        out[:, g * gs : (g + 1) * gs] = seg / torch.sqrt(seg.pow(2).mean(-1, keepdim=True) + eps)
    return out * weight.to(F64)


# ------------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------------


def assert_close(actual, expected, rtol=1e-4):
    """Relative to the tensor's scale: atol = rtol * max|expected|. Also requires finiteness."""
    expected = expected.to(F64)
    actual = actual.to(F64)
    assert actual.shape == expected.shape
    assert torch.isfinite(actual).all(), "non-finite values in result"
    scale = max(expected.abs().max().item(), 1e-6)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale)


def cu_of(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)


def batch_of(lens, resumes=None, chunk_size=4, boundary_offsets=None):
    return PrefillBatch.of(cu_of(lens), resumes, chunk_size, boundary_offsets=boundary_offsets)


def ssm_inputs(T, G, dtype=torch.float32):
    x = torch.randn(T, H, P).to(dtype)
    dt = torch.rand(T, H) * 0.6 + 0.02  # processed dt: positive
    A = -(torch.rand(H) * 1.0 + 0.02)  # some heads decay slowly, so initial states matter to the end
    B = torch.randn(T, G, N).to(dtype)
    C = torch.randn(T, G, N).to(dtype)
    return x, dt, A, B, C


def garbage_initial(shape, has):
    """Random initial states; rows flagged False are filled with NaN / inf garbage."""
    init = torch.randn(*shape)
    for s in range(shape[0]):
        if not has[s]:
            init[s] = float("nan")
            init[s].view(-1)[0] = float("inf")
    return init


# ------------------------------------------------------------------------------------------------------
# process_dt
# ------------------------------------------------------------------------------------------------------


def test_process_dt_softplus_and_limit():
    torch.manual_seed(0)
    raw = torch.randn(7, H) * 10  # crosses softplus' linear threshold (20) for some entries
    raw[0, 0] = 30.0
    bias = torch.randn(H)
    exp = torch.log1p(torch.exp(raw.to(F64) + bias.to(F64)))
    out = process_dt(raw, bias)
    assert out.dtype == torch.float32
    assert_close(out, exp, rtol=1e-6)
    out = process_dt(raw.bfloat16(), bias, dt_limit=(0.1, 0.5))
    assert out.dtype == torch.float32
    exp = torch.log1p(torch.exp(raw.bfloat16().to(F64) + bias.to(F64))).clamp(0.1, 0.5)
    assert_close(out, exp, rtol=1e-6)
    assert out.min().item() >= 0.1 and out.max().item() <= 0.5


# ------------------------------------------------------------------------------------------------------
# ssd_chunk_scan
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_groups", [1, 2, 8])
@pytest.mark.parametrize("chunk_size", [4, 8])
def test_ssd_chunk_scan_varlen_mixed_initial_states(chunk_size, n_groups):
    torch.manual_seed(1000 + 10 * chunk_size + n_groups)
    cs = chunk_size
    lens = [1, cs - 1, cs, cs + 1, 3 * cs + 5]
    T = sum(lens)
    x, dt, A, B, C = ssm_inputs(T, n_groups)
    D = torch.randn(H)
    has = torch.tensor([True, False, True, False, True])
    init = garbage_initial((len(lens), H, P, N), has)

    y, fin, _ = ssd_chunk_scan(x, dt, A, B, C, batch_of(lens, has, cs), init, D)

    y_ref, fin_ref = oracle_ssm(x, dt, A, B, C, lens, [init[s] if has[s] else None for s in range(5)], D)
    assert y.dtype == x.dtype and fin.dtype == torch.float32
    assert fin.shape == (len(lens), H, P, N)
    assert_close(y, y_ref)
    assert_close(fin, fin_ref)


def test_ssd_chunk_scan_raw_dt_with_bias_and_limit_and_state_dtype():
    """The mixer's call form: raw dt + dt_bias (+ a limit) is processed inside, and final states come back in
    the requested dtype. Oracle: the step-by-step recurrence on process_dt's step sizes."""
    torch.manual_seed(4)
    lens = [5, 1, 12]
    x, _, A, B, C = ssm_inputs(sum(lens), 2)
    raw, bias, limit = torch.randn(sum(lens), H) * 2, torch.randn(H), (0.05, 0.8)
    y, fin, _ = ssd_chunk_scan(x, raw, A, B, C, batch_of(lens), dt_bias=bias, dt_limit=limit,
                               state_dtype=torch.bfloat16)
    y_ref, fin_ref = oracle_ssm(x, process_dt(raw, bias, limit), A, B, C, lens)
    assert fin.dtype == torch.bfloat16
    assert_close(y, y_ref)
    assert (fin.double() - fin_ref).abs().max() <= 2**-8 * fin_ref.abs().max()  # bf16 rounding only


def test_ssd_chunk_scan_no_initial_states_no_D():
    torch.manual_seed(1)
    lens = [5, 1, 12, 4]
    x, dt, A, B, C = ssm_inputs(sum(lens), 2)
    res = ssd_chunk_scan(x, dt, A, B, C, batch_of(lens))
    assert res.boundary_states is None  # none asked for
    y, fin = res.y, res.final_states
    y_ref, fin_ref = oracle_ssm(x, dt, A, B, C, lens)
    assert_close(y, y_ref)
    assert_close(fin, fin_ref)


def test_ssd_chunk_scan_every_sequence_resuming():
    torch.manual_seed(2)
    lens = [3, 9, 6]
    x, dt, A, B, C = ssm_inputs(sum(lens), 1)
    init = torch.randn(3, H, P, N) * 3
    y, fin, _ = ssd_chunk_scan(x, dt, A, B, C, batch_of(lens, True), init)
    y_ref, fin_ref = oracle_ssm(x, dt, A, B, C, lens, list(init))
    assert_close(y, y_ref)
    assert_close(fin, fin_ref)
    # ... and it does matter: zero initial states give something else.
    y0 = ssd_chunk_scan(x, dt, A, B, C, batch_of(lens)).y
    assert (y0 - y).abs().max().item() > 1e-2
    assert torch.equal(ssd_chunk_scan(x, dt, A, B, C, batch_of(lens), init).y, y0)  # not resuming: not read


def test_ssd_chunk_scan_chunk_size_invariant_and_empty_sequence():
    torch.manual_seed(3)
    lens = [6, 0, 13]  # a zero-length row keeps its (selected) initial state
    x, dt, A, B, C = ssm_inputs(sum(lens), 2)
    has = torch.tensor([True, True, False])
    init = garbage_initial((3, H, P, N), has)
    outs = [ssd_chunk_scan(x, dt, A, B, C, batch_of(lens, has, cs), init) for cs in (1, 3, 4, 64)]
    y_ref, fin_ref = oracle_ssm(x, dt, A, B, C, lens, [init[0], init[1], None])
    for y, fin, _ in outs:
        assert_close(y, y_ref)
        assert_close(fin, fin_ref)
        assert torch.equal(fin[1], init[1])


# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_size", [4, 8])
def test_ssd_chunk_scan_boundary_states_match_the_recurrence(chunk_size):
    """boundary_offsets: the state after the first o tokens of each sequence (prefix caching keeps them at block
    boundaries), whatever the offsets' relation to the chunk: equal to the oracle's final state of that prefix.
    Outputs and final states are unchanged by asking."""
    torch.manual_seed(3000 + chunk_size)
    lens = [3 * chunk_size + 5, 7, chunk_size, 0, 2 * chunk_size]
    x, dt, A, B, C = ssm_inputs(sum(lens), 2)
    has = torch.tensor([True, False, True, False, False])
    init = garbage_initial((len(lens), H, P, N), has)
    offsets = [[chunk_size, 2 * chunk_size, 3 * chunk_size + 5], [1, 6], [chunk_size], [], [3, 2 * chunk_size]]
    y, fin, at = ssd_chunk_scan(x, dt, A, B, C, batch_of(lens, has, chunk_size, offsets), init)
    y0, fin0, _ = ssd_chunk_scan(x, dt, A, B, C, batch_of(lens, has, chunk_size), init)
    assert_close(y, y0)
    assert_close(fin, fin0)
    assert at.shape == (sum(map(len, offsets)), H, P, N) and at.dtype == torch.float32
    want, starts = [], cu_of(lens).tolist()
    for s, offs in enumerate(offsets):
        for o in offs:
            a = starts[s]
            _, f = oracle_ssm(x[a: a + o], dt[a: a + o], A, B[a: a + o], C[a: a + o], [o],
                              [init[s] if has[s] else None])
            want.append(f[0])
    assert_close(at, torch.stack(want))
    with pytest.raises(ValueError, match="outside a sequence"):
        ssd_chunk_scan(x, dt, A, B, C, batch_of(lens, has, chunk_size, [[0]] + offsets[1:]), init)


def test_conv_states_at_boundaries_match_the_recurrence():
    """The conv state after the first o tokens: the last W-1 inputs, reaching into the initial state (or zeros)
    for o < W-1; the oracle's final conv state of that prefix."""
    torch.manual_seed(3100)
    W, Dm, lens = 4, 6, [9, 2, 5]
    u = torch.randn(sum(lens), Dm)
    has = torch.tensor([True, True, False])
    init = garbage_initial((3, W - 1, Dm), has)
    offsets = [[1, 4, 9], [2], [1, 5]]
    got = conv_states_at(u, W, batch_of(lens, has, boundary_offsets=offsets), init)
    want, starts = [], cu_of(lens).tolist()
    for s, offs in enumerate(offsets):
        for o in offs:
            _, f = oracle_conv(u[starts[s]: starts[s] + o], torch.randn(Dm, W), None, [o],
                               [init[s] if has[s] else None])
            want.append(f[0])
    assert torch.equal(got.double(), torch.stack(want))  # copies of inputs: exact


# causal_conv1d / conv_update
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_bias,activation", [(True, "silu"), (False, None)])
@pytest.mark.parametrize("width", [2, 4])
def test_causal_conv1d_varlen(width, with_bias, activation):
    torch.manual_seed(2000 + width)
    Dm = 12
    lens = [1, 2, 3, 5, 9]  # with W=4, rows of length 1 and 2 are shorter than W-1
    T = sum(lens)
    u = torch.randn(T, Dm)
    w = torch.randn(Dm, width)
    b = torch.randn(Dm) if with_bias else None
    has = torch.tensor([True, False, True, True, False])
    init = garbage_initial((len(lens), width - 1, Dm), has)

    out, fin = causal_conv1d(u, w, b, batch_of(lens, has), init, activation=activation)

    out_ref, fin_ref = oracle_conv(u, w, b, lens, [init[s] if has[s] else None for s in range(5)], activation)
    assert out.dtype == u.dtype and fin.dtype == u.dtype
    assert fin.shape == (len(lens), width - 1, Dm)
    assert_close(out, out_ref)
    assert_close(fin, fin_ref)
    if width == 4:
        # a 1-token row with a state: final = [init[1], init[2], u_0]; a fresh 2-token row: [0, u_0, u_1].
        assert torch.equal(fin[0], torch.cat([init[0][1:], u[0:1]]))
        assert torch.equal(fin[1], torch.cat([torch.zeros(1, Dm), u[1:3]]))


def test_causal_conv1d_no_initial_states():
    torch.manual_seed(4)
    Dm, W = 8, 4
    lens = [2, 7, 1]
    u = torch.randn(sum(lens), Dm)
    w = torch.randn(Dm, W)
    b = torch.randn(Dm)
    out, fin = causal_conv1d(u, w, b, batch_of(lens))
    out_ref, fin_ref = oracle_conv(u, w, b, lens)
    assert_close(out, out_ref)
    assert_close(fin, fin_ref)


@pytest.mark.parametrize("width", [2, 4])
def test_conv_update_scattered_slots(width):
    torch.manual_seed(3000 + width)
    Dm, slots = 10, 12
    w = torch.randn(Dm, width)
    b = torch.randn(Dm)
    pool = torch.randn(slots, width - 1, Dm)
    idx = torch.tensor([7, 2, 10, 5], dtype=torch.int64)
    others = [s for s in range(slots) if s not in idx.tolist()]
    untouched = pool[others].clone()
    states = [pool[i].clone() for i in idx.tolist()]
    for step in range(3):
        perm = torch.randperm(4)  # requests change order between steps; slots follow them
        x = torch.randn(4, Dm)
        out = conv_update(x, pool, w, b, idx[perm])
        for r in range(4):
            req = perm[r].item()
            o_ref, f_ref = oracle_conv(x[r : r + 1], w, b, [1], [states[req]])
            assert_close(out[r : r + 1], o_ref)
            states[req] = f_ref[0]
            assert_close(pool[idx[req]], f_ref[0])
        assert torch.equal(pool[others], untouched)


# ------------------------------------------------------------------------------------------------------
# ssm_state_update
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_groups", [1, 2, 8])
def test_ssm_state_update_scattered_slots(n_groups):
    torch.manual_seed(4000 + n_groups)
    slots = 9
    pool = torch.randn(slots, H, P, N)
    idx = torch.tensor([8, 0, 3], dtype=torch.int64)
    others = [s for s in range(slots) if s not in idx.tolist()]
    untouched = pool[others].clone()
    A = -(torch.rand(H) + 0.05)
    D = torch.randn(H)
    states = [pool[i].clone() for i in idx.tolist()]
    for step in range(3):
        perm = torch.randperm(3)
        x, dt, _, B, C = ssm_inputs(3, n_groups)
        y = ssm_state_update(pool, x, dt, A, B, C, idx[perm], D)
        assert y.dtype == x.dtype
        for r in range(3):
            req = perm[r].item()
            sl = slice(r, r + 1)
            y_ref, f_ref = oracle_ssm(x[sl], dt[sl], A, B[sl], C[sl], [1], [states[req]], D)
            assert_close(y[sl], y_ref)
            states[req] = f_ref[0]
            assert_close(pool[idx[req]], f_ref[0])
        assert torch.equal(pool[others], untouched)


def test_decode_updates_pass_over_padding_rows():
    """Negative slot ids (padding rows of a FULL CUDA-graph batch) give 0 whatever their inputs, leave every
    slot but the real ones and slot 0 (vLLM's null block, where the reference parks them) untouched, and do
    not change the real rows' results."""
    torch.manual_seed(4100)
    Dm, W, slots, G = 6, 4, 8, 2
    conv_pool, ssm_pool = torch.randn(slots, W - 1, Dm), torch.randn(slots, H, P, N)
    conv_ref, ssm_ref = conv_pool.clone(), ssm_pool.clone()
    idx = torch.tensor([-1, 6, -1, 3])
    real, pad = [1, 3], [0, 2]
    x = torch.randn(4, Dm)
    xs, dt, _, B, C = ssm_inputs(4, G)
    for t in (x, xs, dt, B, C):
        t[pad] = float("nan")
    w, b, A, D = torch.randn(Dm, W), torch.randn(Dm), -(torch.rand(H) + 0.05), torch.randn(H)
    y = conv_update(x, conv_pool, w, b, idx)
    y_ref = conv_update(x[real], conv_ref, w, b, idx[real])
    h = ssm_state_update(ssm_pool, xs, dt, A, B, C, idx, D)
    h_ref = ssm_state_update(ssm_ref, xs[real], dt[real], A, B[real], C[real], idx[real], D)
    assert torch.equal(y[pad], torch.zeros(2, Dm)) and torch.equal(h[pad], torch.zeros(2, H, P))
    # Up to float32 rounding, not bitwise: on a CPU, element-wise ops (silu's exp) take a vectorised or a scalar
    # path by an element's position in the tensor, so a batch of 4 rows and one of 2 may differ in a last bit
    # (seen on a 2-core CI-like machine: 3e-8 in the conv output).
    torch.testing.assert_close(y[real], y_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h[real], h_ref, rtol=1e-6, atol=1e-6)
    others = [s for s in range(slots) if s not in (0, 6, 3)]
    assert torch.equal(conv_pool[[6, 3] + others], conv_ref[[6, 3] + others])
    assert torch.equal(ssm_pool[[6, 3] + others], ssm_ref[[6, 3] + others])


# ------------------------------------------------------------------------------------------------------
# gated_rms_norm
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_groups", [1, 2, 8])
def test_gated_rms_norm_per_group(n_groups):
    torch.manual_seed(5000 + n_groups)
    d = 32
    x = torch.randn(6, d) * torch.linspace(0.2, 5.0, d)  # groups of very different scale
    z = torch.randn(6, d)
    weight = torch.randn(d)
    y = gated_rms_norm(x, z, weight, 1e-5, d // n_groups)
    assert y.dtype == x.dtype
    assert_close(y, oracle_norm(x, z, weight, 1e-5, n_groups))


def test_gated_rms_norm_groups_differ_from_whole_width():
    """Guard against a well-meant 'fix' towards HF transformers' CPU path (whole-width norm, docs/architecture.md §6)."""
    torch.manual_seed(6)
    d = 16
    x = torch.randn(5, d)
    x[:, : d // 2] *= 6.0  # the two groups have very different RMS
    z = torch.randn(5, d)
    weight = torch.rand(d) + 0.5
    eps = 1e-6
    per_group = gated_rms_norm(x, z, weight, eps, group_size=d // 2)
    v = x.to(F64) * F.silu(z.to(F64))
    whole = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight.to(F64)
    assert (per_group.to(F64) - whole).abs().max().item() > 0.5
    assert_close(per_group, oracle_norm(x, z, weight, eps, 2))
    assert_close(gated_rms_norm(x, z, weight, eps, group_size=d), whole)  # one group == whole width


# ------------------------------------------------------------------------------------------------------
# end to end: conv -> SSD, split prefill and prefill + decode
# ------------------------------------------------------------------------------------------------------


class Core:
    """conv1d -> split (x, B, C) -> SSD, the part of the Mamba2 mixer these kernels implement."""

    def __init__(self, n_groups, width=4, chunk_size=4):
        self.G, self.W, self.cs = n_groups, width, chunk_size
        self.conv_dim = H * P + 2 * n_groups * N
        self.w = torch.randn(self.conv_dim, width) * 0.5
        self.b = torch.randn(self.conv_dim) * 0.1
        self.dt_bias = torch.randn(H) * 0.5 - 1.0
        self.A = -(torch.rand(H) + 0.05)
        self.D = torch.randn(H)

    def split(self, c):
        T = c.shape[0]
        xs, B, C = torch.split(c, [H * P, self.G * N, self.G * N], dim=-1)
        return xs.reshape(T, H, P), B.reshape(T, self.G, N), C.reshape(T, self.G, N)

    def prefill(self, u, dt_raw, lens, conv_init=None, ssm_init=None, has=None):
        resumes = has if has is not None else conv_init is not None
        c, conv_fin = causal_conv1d(u, self.w, self.b, batch_of(lens, resumes), conv_init)
        xs, B, C = self.split(c)
        dt = process_dt(dt_raw, self.dt_bias)
        y, ssm_fin, _ = ssd_chunk_scan(xs, dt, self.A, B, C, batch_of(lens, resumes, self.cs), ssm_init, self.D)
        return y, conv_fin, ssm_fin

    def decode(self, u, dt_raw, conv_pool, ssm_pool, idx):
        c = conv_update(u, conv_pool, self.w, self.b, idx)
        xs, B, C = self.split(c)
        dt = process_dt(dt_raw, self.dt_bias)
        return ssm_state_update(ssm_pool, xs, dt, self.A, B, C, idx, self.D)

    def oracle(self, u, dt_raw, lens):
        c, _ = oracle_conv(u, self.w, self.b, lens)
        xs, B, C = self.split(c)
        dt = F.softplus(dt_raw.to(F64) + self.dt_bias.to(F64))
        y, _ = oracle_ssm(xs, dt, self.A, B, C, lens, None, self.D)
        return y


@pytest.mark.parametrize("n_groups", [1, 2, 8])
def test_split_prefill_equals_whole(n_groups):
    torch.manual_seed(7000 + n_groups)
    core = Core(n_groups)
    L, cut = 23, 10
    u = torch.randn(L, core.conv_dim)
    dt_raw = torch.randn(L, H)

    y_whole, conv_whole, ssm_whole = core.prefill(u, dt_raw, [L])
    assert_close(y_whole, core.oracle(u, dt_raw, [L]))

    # First piece alone (fresh), then the rest with its states, batched behind a fresh 6-token prompt
    # whose state rows hold NaN garbage.
    y1, conv1, ssm1 = core.prefill(u[:cut], dt_raw[:cut], [cut])
    u_new = torch.randn(6, core.conv_dim)
    dt_new = torch.randn(6, H)
    has = torch.tensor([False, True])
    conv_init = torch.cat([torch.full_like(conv1, float("nan")), conv1])
    ssm_init = torch.cat([torch.full_like(ssm1, float("nan")), ssm1])
    y2, conv2, ssm2 = core.prefill(
        torch.cat([u_new, u[cut:]]), torch.cat([dt_new, dt_raw[cut:]]), [6, L - cut], conv_init, ssm_init, has
    )
    assert_close(y1, y_whole[:cut])
    assert_close(y2[6:], y_whole[cut:])
    assert_close(conv2[1:], conv_whole)
    assert_close(ssm2[1:], ssm_whole)
    # the fresh prompt is unaffected by its garbage state
    y_fresh, conv_fresh, ssm_fresh = core.prefill(u_new, dt_new, [6])
    assert_close(y2[:6], y_fresh)
    assert_close(ssm2[:1], ssm_fresh)


@pytest.mark.parametrize("n_groups", [1, 2])
def test_prefill_then_decode_equals_recurrence(n_groups):
    torch.manual_seed(8000 + n_groups)
    core = Core(n_groups, chunk_size=8)
    lens = [5, 9, 2]  # 2 < W-1: the conv state after prefill still holds zeros from the initial state
    n_steps = 4
    total = [L + n_steps for L in lens]
    us = [torch.randn(t, core.conv_dim) for t in total]
    dts = [torch.randn(t, H) for t in total]

    slots = 8
    conv_pool = torch.full((slots, core.W - 1, core.conv_dim), float("nan"))  # never-zeroed slots
    ssm_pool = torch.full((slots, H, P, N), float("nan"))
    idx = torch.tensor([6, 1, 3], dtype=torch.int64)

    # Prefill all three as fresh prompts (garbage initial states, has_initial_state False).
    has = torch.zeros(3, dtype=torch.bool)
    y_pre, conv_fin, ssm_fin = core.prefill(
        torch.cat([u[:L] for u, L in zip(us, lens)]),
        torch.cat([d[:L] for d, L in zip(dts, lens)]),
        lens,
        conv_pool[idx],
        ssm_pool[idx],
        has,
    )
    conv_pool[idx] = conv_fin
    ssm_pool[idx] = ssm_fin.to(ssm_pool.dtype)

    ys = [[] for _ in lens]
    off = 0
    for r, L in enumerate(lens):
        ys[r].append(y_pre[off : off + L])
        off += L
    for step in range(n_steps):
        order = torch.randperm(3)
        u = torch.stack([us[r][lens[r] + step] for r in order.tolist()])
        d = torch.stack([dts[r][lens[r] + step] for r in order.tolist()])
        y = core.decode(u, d, conv_pool, ssm_pool, idx[order])
        for row, r in enumerate(order.tolist()):
            ys[r].append(y[row : row + 1])

    # Slots nobody owns keep their garbage.
    free = [s for s in range(slots) if s not in idx.tolist()]
    assert torch.isnan(conv_pool[free]).all() and torch.isnan(ssm_pool[free]).all()
    for r in range(3):
        assert_close(torch.cat(ys[r]), core.oracle(us[r], dts[r], [total[r]]))


# ------------------------------------------------------------------------------------------------------
# bfloat16 smoke test
# ------------------------------------------------------------------------------------------------------


def test_bf16_smoke():
    torch.manual_seed(9)
    bf = torch.bfloat16
    tol = 3e-2
    lens = [1, 7, 13]
    T = sum(lens)
    G = 2
    x, dt, A, B, C = ssm_inputs(T, G, dtype=bf)
    D = torch.randn(H)
    has = torch.tensor([True, False, True])
    init = garbage_initial((3, H, P, N), has)
    y, fin, _ = ssd_chunk_scan(x, dt, A, B, C, batch_of(lens, has), init, D)
    assert y.dtype == bf and fin.dtype == torch.float32
    y_ref, fin_ref = oracle_ssm(x, dt, A, B, C, lens, [init[0], None, init[2]], D)
    assert_close(y, y_ref, rtol=tol)
    assert_close(fin, fin_ref, rtol=tol)

    Dm, W = 16, 4
    u = torch.randn(T, Dm).to(bf)
    w = torch.randn(Dm, W).to(bf)
    b = torch.randn(Dm).to(bf)
    cinit = garbage_initial((3, W - 1, Dm), has).to(bf)
    out, cfin = causal_conv1d(u, w, b, batch_of(lens, has), cinit)
    assert out.dtype == bf and cfin.dtype == bf
    out_ref, cfin_ref = oracle_conv(u, w, b, lens, [cinit[0], None, cinit[2]])
    assert_close(out, out_ref, rtol=tol)
    assert_close(cfin, cfin_ref, rtol=tol)

    # decode with bf16 pools
    cpool = torch.randn(4, W - 1, Dm).to(bf)
    spool = torch.randn(4, H, P, N).to(bf)
    idx = torch.tensor([3, 1])
    c0, s0 = cpool[idx].clone(), spool[idx].clone()
    xd, dtd, _, Bd, Cd = ssm_inputs(2, G, dtype=bf)
    ud = torch.randn(2, Dm).to(bf)
    o = conv_update(ud, cpool, w, b, idx)
    assert o.dtype == bf and cpool.dtype == bf
    o_ref, _ = oracle_conv(ud, w, b, [1, 1], [c0[0], c0[1]])
    assert_close(o, o_ref, rtol=tol)
    yd = ssm_state_update(spool, xd, dtd, A, Bd, Cd, idx, D)
    assert yd.dtype == bf and spool.dtype == bf
    yd_ref, sfin_ref = oracle_ssm(xd, dtd, A, Bd, Cd, [1, 1], [s0[0], s0[1]], D)
    assert_close(yd, yd_ref, rtol=tol)
    assert_close(spool[idx], sfin_ref, rtol=tol)
