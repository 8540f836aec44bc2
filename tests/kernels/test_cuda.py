"""vllm_mamba2_plugin.kernels.cuda (mamba-ssm / causal-conv1d wrappers) against kernels.reference.

Every test runs on two backends:
  * "cuda" (marked ``gpu``): the real upstream kernels on a CUDA GPU; skipped cleanly without CUDA or without
    mamba_ssm / causal_conv1d (nothing here imports them at collection time).
  * "fake": runs anywhere (CPU CI). The upstream kernels are replaced by plain-torch stand-ins that reproduce
    the argument checks (asserts / TORCH_CHECKs) and the semantics we rely on -- e.g. that a packed SSD call
    gives an initial state only to the first sequence, that causal_conv1d_fn's varlen path needs the
    channel-last layout and int32 seq_idx, that selective_state_update crashes on dt_bias=None. This checks
    the wrappers' index plumbing, layouts and the initial-state correction without a GPU; only "cuda" checks
    the kernels themselves.

Tolerances, as max |actual - expected| <= tol * max |expected| (see TOL):
  * SSD float32: 5e-3. mamba-ssm's Triton SSD kernels use tl.dot with default precision, i.e. TF32 for
    float32 inputs (10-bit mantissa, ~5e-4 relative per rounding), so float32-exact agreement is impossible.
  * everything else in float32 (CUDA conv FMAs, elementwise Triton state update, row-wise norm): 1e-4.
  * bfloat16: outputs are rounded to bf16 (2^-8..2^-7 relative) by both sides, possibly in different
    directions: 1e-2; SSD in bf16 also casts CB and inter-chunk states to bf16 inside the kernel: 3e-2.
  * "fake" float32: 1e-4 everywhere (same arithmetic as the reference up to summation order).
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from vllm_mamba2_plugin.kernels import cuda as ck
from vllm_mamba2_plugin.kernels import reference as ref

BF16, F32 = torch.bfloat16, torch.float32

# ------------------------------------------------------------------------------------------------------
# plain-torch stand-ins for the upstream kernels (the "fake" backend)
# ------------------------------------------------------------------------------------------------------


def _fake_ssd_fwd(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                  cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    """mamba_ssm.ops.triton.ssd_combined._mamba_chunk_scan_combined_fwd (ssd_combined.py:343-393): its checks,
    its processing of dt (_chunk_cumsum_fwd_kernel: + dt_bias, softplus below 20, clamp; returned in the
    (batch, nheads, nchunks, chunk_size) layout, zeros past the end) and its returned tuple."""
    batch, seqlen, nheads, headdim = x.shape
    _, _, ngroups, dstate = B.shape
    assert nheads % ngroups == 0 and B.shape == (batch, seqlen, ngroups, dstate) and C.shape == B.shape
    assert dt.shape == (batch, seqlen, nheads) and A.shape == (nheads,)
    assert D is None or D.shape in ((nheads, headdim), (nheads,))
    assert dt_bias is None or dt_bias.shape == (nheads,)  # ssd_chunk_state.py:721
    assert z is None  # the wrapper never uses it
    if seq_idx is not None:
        assert seq_idx.shape == (batch, seqlen)
    if initial_states is not None:
        assert initial_states.shape == (batch, nheads, headdim, dstate)
    dtp = dt.float() + (0.0 if dt_bias is None else dt_bias.float())
    if dt_softplus:
        dtp = torch.where(dtp <= 20.0, F.softplus(dtp), dtp)
    dtp = dtp.clamp(min=dt_limit[0], max=dt_limit[1])
    outs, finals, segs = [], [], None
    nchunks = -(-seqlen // chunk_size)
    # states: the state entering each chunk after state passing (ssd_state_passing.py:69-84): the state of the
    # sequence of the previous chunk's last token, through that token; chunk 0's is the initial state (or 0).
    states = torch.zeros(batch, nchunks, nheads, headdim, dstate)
    for b in range(batch):
        ids = seq_idx[b].long() if seq_idx is not None else torch.zeros(seqlen, dtype=torch.long)
        cuts = (torch.nonzero(ids[1:] != ids[:-1]).view(-1) + 1).tolist()
        segs = [0] + cuts + [seqlen]
        init = has = None
        if initial_states is not None:  # only tokens with seq_idx 0 see it (ssd_chunk_scan.py:98, state passing)
            init = torch.zeros(len(segs) - 1, nheads, headdim, dstate)
            init[0] = initial_states[b].float()
            has = torch.tensor([int(ids[0]) == 0] + [False] * (len(segs) - 2))
        y, fin = ref.ssd_chunk_scan(x[b], dtp[b], A, B[b], C[b], chunk_size, torch.tensor(segs), init, has, D)
        outs.append(y)
        finals.append(fin)
        if initial_states is not None:
            states[b, 0] = initial_states[b].float()
        for c in range(1, nchunks):
            p = c * chunk_size
            j = max(k for k in range(len(segs) - 1) if segs[k] < p)  # the sequence of token p-1
            a = segs[j]
            h = init[:1] if j == 0 and init is not None and bool(has[0]) else None
            _, f = ref.ssd_chunk_scan(x[b, a:p], dtp[b, a:p], A, B[b, a:p], C[b, a:p], chunk_size,
                                      torch.tensor([0, p - a]), h, None if h is None else torch.tensor([True]), D)
            states[b, c] = f[0]
    out = torch.stack(outs).to(x.dtype)
    dt_out = torch.zeros(batch, nheads, nchunks * chunk_size)
    dt_out[:, :, :seqlen] = dtp.transpose(1, 2)
    dt_out = dt_out.view(batch, nheads, nchunks, chunk_size)
    dA_cumsum = (dt_out * A.float().view(1, nheads, 1, 1)).cumsum(-1)  # within each chunk (ssd_chunk_state.py)
    final_states = torch.stack([f[-1] for f in finals])  # float32 (ssd_state_passing.py:208)
    res = (out, None, dt_out, dA_cumsum, states.to(C.dtype), final_states)  # states in C's dtype (ssd_combined.py:381)
    if cu_seqlens is None:
        return res
    assert batch == 1  # ssd_combined.py:390
    assert cu_seqlens.tolist() == segs, (cu_seqlens.tolist(), segs)  # the wrapper passes matching bounds
    varlen = finals[0].clone()
    if initial_states is not None and segs[1] <= chunk_size:
        # chunk_state_varlen adds the state entering a sequence's last chunk only if the sequence started before
        # that chunk (ssd_chunk_state.py:700-706): the first sequence, ending in chunk 0, loses its h0 term.
        a, b = segs[0], segs[1]
        _, fin0 = ref.ssd_chunk_scan(x[0, a:b], dtp[0, a:b], A, B[0, a:b], C[0, a:b], chunk_size,
                                     torch.tensor([0, b - a]), None, None, D)
        varlen[0] = fin0[0]
    return res + (varlen.to(C.dtype),)  # chunk states are stored in C's dtype (ssd_combined.py:381)


def _fake_conv_fwd(x, weight, bias, seq_idx, initial_states, out, final_states_out, silu_activation):
    """causal_conv1d_cuda.causal_conv1d_fwd (the extension, in place into out), with causal_conv1d.cpp:150-240's
    checks and the channel-last kernel's assumption that out has unit channel stride (causal_conv1d_fwd.cu:233)."""
    assert x.dtype == out.dtype and x.shape == out.shape
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    assert weight.shape == (dim, width) and 2 <= width <= 4
    assert x.stride(2) == 1 or x.stride(1) == 1
    channel_last = x.stride(1) == 1 and x.stride(2) > 1
    if channel_last:
        assert dim % 8 == 0 and x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0
        assert out.stride(1) == 1, "the channel-last kernel writes channels at unit stride"
    if bias is not None:
        assert bias.dtype == weight.dtype and bias.stride(-1) == 1 and bias.shape == (dim,)
    if seq_idx is not None:
        assert channel_last and seq_idx.dtype == torch.int32 and seq_idx.is_contiguous()
        assert seq_idx.shape == (batch, seqlen)
    assert final_states_out is None  # the wrapper never asks for them
    if initial_states is not None:  # causal_conv1d.cpp:211-223
        assert channel_last and initial_states.dtype == x.dtype
        assert initial_states.shape == (batch, dim, width - 1) and initial_states.stride(1) == 1
    xf = x.float()
    if seq_idx is None:
        # the width-1 inputs before position 0: the initial states (oldest first), else zeros
        pre = initial_states.float() if initial_states is not None else xf.new_zeros(batch, dim, width - 1)
        o = F.conv1d(torch.cat([pre, xf], -1), weight.float().unsqueeze(1),
                     None if bias is None else bias.float(), groups=dim)
    else:  # causal_conv1d_ref's seq_idx branch (causal_conv1d_interface.py:155-174)
        # The width-1 positions before the row: the initial states, tagged with seq_idx[0] (the channel-last
        # kernel, causal_conv1d_fwd.cu:304-312: they reach the row's first sequence only), else zeros, tagged -1.
        if initial_states is None:
            xp = F.pad(xf, (width - 1, 0))
            sp = torch.cat([seq_idx.new_full((batch, width - 1), -1), seq_idx], dim=-1)
        else:
            xp = torch.cat([initial_states.float(), xf], -1)
            sp = torch.cat([seq_idx[:, :1].expand(batch, width - 1), seq_idx], dim=-1)
        same = sp.unfold(-1, width, 1) == seq_idx.unsqueeze(-1)
        o = (xp.unfold(-1, width, 1) * same.unsqueeze(1) * weight.float().view(1, dim, 1, width)).sum(-1)
        if bias is not None:
            o = o + bias.float().view(1, dim, 1)
        o = o.masked_fill((seq_idx < 0).unsqueeze(1), 0.0)
    if silu_activation:
        o = F.silu(o)
        if seq_idx is not None:
            o = o.masked_fill((seq_idx < 0).unsqueeze(1), 0.0)
    out.copy_(o.to(x.dtype))


def _fake_conv_update(x, conv_state, weight, bias, out, silu_activation, cache_seqlens, conv_state_indices):
    """causal_conv1d_cuda.causal_conv1d_update (the extension, non-circular, in place into out), with
    causal_conv1d.cpp:466-537's checks: x and out (batch, dim, seqlen), out written through its own strides."""
    assert cache_seqlens is None
    assert x.dim() == 3 and out.shape == x.shape and out.dtype == x.dtype
    x3 = x
    batch, dim, seqlen = x3.shape
    width = weight.shape[-1]
    L = conv_state.size(2)
    assert conv_state.dtype == x.dtype and L >= width - 1 and 2 <= width <= 4 and weight.shape == (dim, width)
    if bias is not None:
        assert bias.dtype == weight.dtype and bias.stride(-1) == 1
    idx = conv_state_indices
    assert idx is not None and idx.dtype == torch.int32 and idx.stride(0) == 1 and idx.shape == (batch,)
    assert conv_state.shape[1:] == (dim, L)
    for b, c in enumerate(idx.tolist()):
        if c < 0:
            out[b] = 0
            continue
        win = torch.cat([conv_state[c], x3[b]], dim=-1)  # (dim, L + seqlen)
        ys = []
        for i in range(seqlen):
            w = win[:, L + i - width + 1: L + i + 1].float()
            v = (w * weight.float()).sum(-1) + (0 if bias is None else bias.float())
            ys.append(F.silu(v) if silu_activation else v)
        out[b] = torch.stack(ys, -1).to(x.dtype)
        conv_state[c] = win[:, -L:]  # through the caller's (possibly strided) view: in place


def _fake_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                       state_batch_indices=None):
    """mamba_ssm.ops.triton.selective_state_update.selective_state_update (multi-head form)."""
    assert state.dim() == 4 and x.dim() == 3
    _, nheads, dim, dstate = state.shape
    batch = x.shape[0]
    assert x.shape == (batch, nheads, dim) and dt.shape == x.shape and A.shape == (nheads, dim, dstate)
    ngroups = B.shape[1]
    assert nheads % ngroups == 0 and B.shape == (batch, ngroups, dstate) and C.shape == B.shape
    assert D is None or D.shape == (nheads, dim)
    assert dt_bias is None or dt_bias.shape == (nheads, dim)
    tie = A.stride(-1) == 0 and A.stride(-2) == 0 and dt.stride(-1) == 0 and dt_bias.stride(-1) == 0  # :199
    if dt_bias is None or D is None:  # :207, :211 unpack `*0`
        raise TypeError("argument after * must be an iterable, not int")
    assert state_batch_indices is not None and state_batch_indices.shape == (batch,)
    assert state_batch_indices.is_contiguous()
    R = nheads // ngroups
    out = torch.empty_like(x)
    for b, i in enumerate(state_batch_indices.tolist()):
        if i < 0:
            out[b] = 0
            continue
        d = dt[b].float() + dt_bias.float()
        if tie:
            d = d[:, :1].expand(nheads, dim)
        if dt_softplus:
            d = torch.where(d <= 20.0, F.softplus(d), d)
        Bh = B[b].float().repeat_interleave(R, 0)  # (nheads, dstate)
        Ch = C[b].float().repeat_interleave(R, 0)
        dBx = (Bh[:, None, :] * d[..., None]) * x[b].float()[..., None]
        s = state[i].float() * torch.exp(A.float() * d[..., None]) + dBx
        state[i] = s.to(state.dtype)
        y = (s * Ch[:, None, :]).sum(-1) + x[b].float() * D.float()
        if z is not None:
            y = y * F.silu(z[b].float())
        out[b] = y.to(out.dtype)
    return out


def _fake_layer_norm_fwd(x, weight, bias, eps, z=None, out=None, group_size=None, norm_before_gate=True,
                         is_rms_norm=False):
    """mamba_ssm.ops.triton.layernorm_gated._layer_norm_fwd (== its rms_norm_ref), with its input checks."""
    assert is_rms_norm and bias is None and weight.shape == (x.shape[-1],)
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.stride(-1) == 1  # layernorm_gated.py:114-119
    if z is not None:
        assert z.shape == x.shape and z.stride(-1) == 1
    xf = x.float()
    if z is not None and not norm_before_gate:
        xf = xf * F.silu(z.float())
    gs = group_size or x.shape[-1]
    g = xf.view(*xf.shape[:-1], -1, gs)
    o = (g * torch.rsqrt(g.square().mean(-1, keepdim=True) + eps)).view(xf.shape) * weight.float()
    if z is not None and norm_before_gate:
        o = o * F.silu(z.float())
    if out is None:
        out = torch.empty_like(x)
    assert out.shape == x.shape and out.stride(-1) == 1
    out.copy_(o.to(x.dtype))
    return out, None, torch.empty(0)


FAKE_KERNELS = SimpleNamespace(
    ssd_fwd=_fake_ssd_fwd,
    selective_state_update=_fake_state_update,
    layer_norm_fwd=_fake_layer_norm_fwd,
    conv_fwd=_fake_conv_fwd,
    conv_update=_fake_conv_update,
)

# ------------------------------------------------------------------------------------------------------
# backends, tolerances, inputs
# ------------------------------------------------------------------------------------------------------


@pytest.fixture(params=[pytest.param("fake", id="fake"),
                        pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
def kern(request, monkeypatch):
    if request.param == "fake":
        monkeypatch.setattr(ck, "_KERNELS", FAKE_KERNELS)
        return SimpleNamespace(name="fake", dev=torch.device("cpu"))
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("mamba_ssm")
    pytest.importorskip("causal_conv1d")
    ck._kernels()  # fail (not skip) if they are installed but do not import
    # The reference must be float32-exact on the GPU: no TF32 in its einsums.
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    return SimpleNamespace(name="cuda", dev=torch.device("cuda"))


@pytest.fixture(params=["rerun", "correction"])
def resume_path(request, kern, monkeypatch):
    """How sequences that resume a saved state are handled: "rerun" (each one alone through the kernels'
    native initial state; the wrappers' choice for up to ck.SEPARATE_RESUMED_MAX of them) or "correction"
    (the batched exact correction of the SSD output and the extended conv buffer; forced here). Returns the
    list of SSD forward calls' batch-row lengths, to check which path ran."""
    monkeypatch.setattr(ck, "SEPARATE_RESUMED_MAX", 3 if request.param == "rerun" else -1)
    ns = ck._kernels() if kern.name == "cuda" else FAKE_KERNELS
    calls, real = [], ns.ssd_fwd

    def counting(x, *a, **kw):
        calls.append(x.shape[1])
        return real(x, *a, **kw)

    monkeypatch.setattr(ns, "ssd_fwd", counting)
    return SimpleNamespace(name=request.param, calls=calls)


def record_conv_launches(monkeypatch):
    """The data pointers of the inputs of every causal-conv1d forward the wrapper launches (x's own pointer:
    read in place; anything else: a staging buffer or a slice)."""
    launched, real_fwd = [], ck._conv_fwd
    monkeypatch.setattr(ck, "_conv_fwd", lambda k, xv, *a: (launched.append(xv.data_ptr()), real_fwd(k, xv, *a))[1])
    return launched


TOL = {("ssd", F32): 5e-3, ("ssd", BF16): 3e-2, ("any", F32): 1e-4, ("any", BF16): 1e-2}


def tol(kern, kind, dtype):
    if kern.name == "fake" and dtype == F32:
        return 1e-4
    return TOL.get((kind, dtype), TOL[("any", dtype)])


def assert_close(actual, expected, t, what=""):
    a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    scale = max(e.abs().max().item(), 1e-6)
    err = (a - e).abs().max().item()
    assert err <= t * scale, f"{what}: max abs err {err:.3g} > {t} * scale {scale:.3g}"


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rnd(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


# SSD shapes: the three tiny test models (tests/conftest.py) and a realistic Mamba2 layer (chunk 256).
SSD_CASES = {
    "tiny-g1": dict(H=8, P=16, N=16, G=1, cs=8, real=False),
    "tiny-g2": dict(H=16, P=8, N=16, G=2, cs=16, real=False),
    "tiny-g8": dict(H=8, P=32, N=16, G=8, cs=4, real=False),
    "real-g1": dict(H=24, P=64, N=128, G=1, cs=256, real=True),
    "real-g8": dict(H=24, P=64, N=128, G=8, cs=256, real=True),
}


def case(kern, name):
    c = SimpleNamespace(**SSD_CASES[name])
    if c.real and kern.name == "fake":
        pytest.skip("realistic shapes only on the GPU (the fake backend runs the reference twice on CPU)")
    return c


def ssd_inputs(c, lens, dtype, dev, seed, pad=0):
    g = gen(seed)
    T = sum(lens) + pad
    dt_bias = torch.log(torch.expm1(torch.empty(c.H).uniform_(1e-3, 1e-1, generator=g)))  # Mamba2 init
    dt = ref.process_dt(rnd(g, T, c.H, scale=0.5), dt_bias)
    A = -torch.exp(torch.empty(c.H).uniform_(0.0, math.log(16.0), generator=g))
    x, B, C = rnd(g, T, c.H, c.P), rnd(g, T, c.G, c.N), rnd(g, T, c.G, c.N)
    D = rnd(g, c.H)
    to = lambda t, dty=dtype: t.to(dev, dty)  # noqa: E731
    return to(x), to(dt, F32), to(A, F32), to(B), to(C), to(D, F32)


def cu_of(lens, dev):
    return torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(dev)


def garbage_states(g, shape, flags, dev, dtype=F32):
    """Initial states; rows flagged False hold NaN / inf garbage (vLLM never zeroes a slot)."""
    s = rnd(g, *shape)
    for i, f in enumerate(flags):
        if not f:
            s[i] = float("nan")
            s[i].view(-1)[::3] = float("inf")
    return s.to(dev, dtype)


def flags_of(flags, dev):
    return torch.tensor(flags, dtype=torch.bool, device=dev)


# ------------------------------------------------------------------------------------------------------
# SSD chunk scan
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(SSD_CASES))
def test_ssd_varlen_initial_states(kern, name, dtype, resume_path):
    c = case(kern, name)
    cs = c.cs
    lens = [cs + 1, 1, 3 * cs + 5, max(1, cs - 1), cs]  # 1, chunk-1, chunk, chunk+1, 3*chunk+5, shuffled
    flags = [True, True, False, True, False]  # init on a 1-token row and on long rows, garbage elsewhere
    x, dt, A, B, C, D = ssd_inputs(c, lens, dtype, kern.dev, seed=1)
    h0 = garbage_states(gen(2), (len(lens), c.H, c.P, c.N), flags, kern.dev)
    cu, hi = cu_of(lens, kern.dev), flags_of(flags, kern.dev)
    y_r, fin_r = ref.ssd_chunk_scan(x, dt, A, B, C, cs, cu, h0, hi, D=D)
    # Without a plan (built inside from the device bounds) and with the builder's plan (host bounds).
    plan = ck.plan_prefill(cu.cpu(), hi.cpu(), x.shape[0], cs, 4, kern.dev)
    for p in (None, plan):
        y, fin = ck.ssd_chunk_scan(x, dt, A, B, C, cs, cu, h0, hi, D=D, plan=p)
        assert y.dtype == x.dtype and fin.dtype == F32 and fin.shape == fin_r.shape
        t = tol(kern, "ssd", dtype)
        assert_close(y, y_r, t, "y")
        assert_close(fin, fin_r, t, "final states")
        for s in range(len(lens)):  # per-sequence check: a large sequence must not hide a wrong short one
            a, b = int(cu[s]), int(cu[s + 1])
            assert_close(y[a:b], y_r[a:b], 2 * t, f"y of sequence {s} (len {lens[s]}, init {flags[s]})")
            assert_close(fin[s], fin_r[s], 2 * t, f"final state of sequence {s}")
    # one packed call per wrapper call, plus (rerun) one per resumed sequence, of exactly its length
    resumed = [n for n, f in zip(lens, flags) if f]
    per_call = [sum(lens)] + (resumed if resume_path.name == "rerun" else [])
    assert resume_path.calls == per_call * 2, resume_path.calls


def _lone_first_layout(variant, cs):
    """(lengths, flags) where exactly one sequence resumes and it is the first non-empty one."""
    return {
        "ends-in-chunk-0": ([cs // 2 + 3, cs + 7, 5], [True, False, False]),
        "exactly-one-chunk": ([cs, 9, cs + 1], [True, False, False]),
        "spans-chunks": ([2 * cs + 5, 3, cs - 1], [True, False, False]),
        "one-token": ([1, cs + 3], [True, False]),
        "alone": ([cs // 2], [True]),
        "after-empty": ([0, cs // 2, 7], [False, True, False]),
    }[variant]


LONE_FIRST = ["ends-in-chunk-0", "exactly-one-chunk", "spans-chunks", "one-token", "alone", "after-empty"]


@pytest.mark.parametrize("variant", LONE_FIRST)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["tiny-g2", "real-g8"])
def test_ssd_lone_first_resumed_sequence_takes_the_native_initial_state(kern, name, dtype, variant, resume_path):
    """The usual chunked-prefill step: one resumed chunk, first in the batch. ONE packed call with the kernels'
    initial_states (no rerun, no correction, whatever SEPARATE_RESUMED_MAX says), including the patched final
    state of a first sequence that ends in chunk 0 -- and the mixer's form of the call (raw dt, dt_bias, limit,
    state in the pool's dtype). Oracle: the reference; unflagged states hold garbage."""
    c = case(kern, name)
    lens, flags = _lone_first_layout(variant, c.cs)
    x, dt, A, B, C, D = ssd_inputs(c, lens, dtype, kern.dev, seed=11)
    h0 = garbage_states(gen(12), (len(lens), c.H, c.P, c.N), flags, kern.dev)
    cu, hi = cu_of(lens, kern.dev), flags_of(flags, kern.dev)
    t = tol(kern, "ssd", dtype)
    y_r, fin_r = ref.ssd_chunk_scan(x, dt, A, B, C, c.cs, cu, h0, hi, D=D)
    plan = ck.plan_prefill(cu.cpu(), hi.cpu(), x.shape[0], c.cs, 4, kern.dev)
    for p in (None, plan):
        y, fin = ck.ssd_chunk_scan(x, dt, A, B, C, c.cs, cu, h0, hi, D=D, plan=p)
        assert_close(y, y_r, t, "y")
        for s in range(len(lens)):
            assert_close(fin[s], fin_r[s], 2 * t, f"final state of sequence {s} (len {lens[s]}, init {flags[s]})")
    # The mixer's call: raw dt + dt_bias + limit processed inside, final states in a bf16 pool's dtype.
    g = gen(13)
    raw = rnd(g, sum(lens), c.H, scale=2.0).to(kern.dev, dtype)
    dt_bias = torch.empty(c.H).uniform_(-3.0, 0.0, generator=g).to(kern.dev)
    limit = (0.01, 0.5)
    y_r2, fin_r2 = ref.ssd_chunk_scan(x, ref.process_dt(raw, dt_bias, limit), A, B, C, c.cs, cu, h0, hi, D=D)
    y2, fin2 = ck.ssd_chunk_scan(x, raw, A, B, C, c.cs, cu, h0, hi, D=D, plan=plan, dt_bias=dt_bias,
                                 dt_limit=limit, state_dtype=BF16)
    assert fin2.dtype == BF16
    assert_close(y2, y_r2, t, "y (raw dt)")
    for s in range(len(lens)):
        assert_close(fin2[s], fin_r2[s], 2 * tol(kern, "ssd", BF16), f"final state {s} (raw dt, bf16 pool)")
    assert resume_path.calls == [sum(lens)] * 3, resume_path.calls  # one packed call each, nothing rerun


def _aligned_layout(variant, cs):
    """(lengths, flags): every non-empty sequence but the last ends on a chunk boundary ("unaligned": a control)."""
    return {
        "one-fresh": ([cs + 3], [False]),
        "one-resumed": ([2 * cs + 5], [True]),
        "fresh": ([cs, 2 * cs, cs + 5], [False, False, False]),
        "first-resumed": ([2 * cs, cs, 7], [True, False, False]),
        "resumed-later": ([cs, 0, cs, 3 * cs - 1], [False, True, True, True]),
        "unaligned": ([cs, cs + 1, 5], [False, True, False]),
    }[variant]


ALIGNED = ["one-fresh", "one-resumed", "fresh", "first-resumed", "resumed-later", "unaligned"]


@pytest.mark.parametrize("state_dtype", [F32, BF16], ids=["state-f32", "state-bf16"])
@pytest.mark.parametrize("variant", ALIGNED)
@pytest.mark.parametrize("name", ["tiny-g2", "real-g8"])
def test_ssd_chunk_aligned_sequences_skip_the_varlen_states(kern, name, variant, state_dtype, resume_path,
                                                            monkeypatch):
    """When every sequence but the last ends where a chunk ends (one sequence always does), the final states are
    the chunk states that state passing computed: the packed call gets no cu_seqlens (no chunk_state_varlen
    launch). Outputs and final states against the reference, through every resume path (native first sequence,
    rerun, correction); the unaligned control still asks for the varlen states."""
    c = case(kern, name)
    lens, flags = _aligned_layout(variant, c.cs)
    x, dt, A, B, C, D = ssd_inputs(c, lens, BF16, kern.dev, seed=21)
    h0 = garbage_states(gen(22), (len(lens), c.H, c.P, c.N), flags, kern.dev)
    cu, hi = cu_of(lens, kern.dev), flags_of(flags, kern.dev)
    ns = ck._kernels() if kern.name == "cuda" else FAKE_KERNELS
    varlen, inner = [], ns.ssd_fwd
    monkeypatch.setattr(ns, "ssd_fwd", lambda *a, **kw: (varlen.append("cu_seqlens" in kw), inner(*a, **kw))[1])
    plan = ck.plan_prefill(cu.cpu(), hi.cpu(), x.shape[0], c.cs, 4, kern.dev)
    assert (plan.final_chunks is None) == (variant == "unaligned")
    y_r, fin_r = ref.ssd_chunk_scan(x, dt, A, B, C, c.cs, cu, h0, hi, D=D)
    y, fin = ck.ssd_chunk_scan(x, dt, A, B, C, c.cs, cu, h0, hi, D=D, plan=plan, state_dtype=state_dtype)
    assert fin.dtype == state_dtype and fin.shape == fin_r.shape
    t = tol(kern, "ssd", BF16)
    assert_close(y, y_r, t, "y")
    for s in range(len(lens)):
        a, b = int(cu[s]), int(cu[s + 1])
        if b > a:
            assert_close(y[a:b], y_r[a:b], 2 * t, f"y of sequence {s} (len {lens[s]}, init {flags[s]})")
        assert_close(fin[s], fin_r[s], 2 * t, f"final state of sequence {s} (len {lens[s]}, init {flags[s]})")
    assert varlen[0] == (variant == "unaligned"), varlen  # the packed call; reruns never ask for varlen states


@pytest.mark.parametrize("variant", ["all-fresh", "all-init-none-flags", "empty-and-padding", "cpu-bounds"])
def test_ssd_edge_cases(kern, variant, resume_path):
    c = case(kern, "tiny-g2")
    lens = {"empty-and-padding": [0, 5, 0, 17, 1]}.get(variant, [3, 16, 40, 1])
    pad = 7 if variant == "empty-and-padding" else 0
    x, dt, A, B, C, D = ssd_inputs(c, lens, F32, kern.dev, seed=3, pad=pad)
    S = len(lens)
    flags = [s % 2 == 0 for s in range(S)]
    h0 = garbage_states(gen(4), (S, c.H, c.P, c.N), flags, kern.dev)
    cu, hi = cu_of(lens, kern.dev), flags_of(flags, kern.dev)
    kw = dict(initial_states=h0, has_initial_state=hi, D=D)
    if variant == "all-fresh":
        kw = dict(D=None)
    elif variant == "all-init-none-flags":
        kw = dict(initial_states=torch.where(torch.isfinite(h0), h0, 0.0), has_initial_state=None, D=D)
    y_r, fin_r = ref.ssd_chunk_scan(x, dt, A, B, C, c.cs, cu, **kw)
    if variant == "cpu-bounds":  # the metadata's CPU copies: no device->host sync in the wrapper
        cu, kw["has_initial_state"] = cu.cpu(), hi.cpu()
    init_before = None if kw.get("initial_states") is None else kw["initial_states"].clone()
    y, fin = ck.ssd_chunk_scan(x, dt, A, B, C, c.cs, cu, **kw)
    t = tol(kern, "ssd", F32)
    assert_close(y, y_r, t, "y")
    assert_close(fin, fin_r, t, "final states")
    if pad:
        assert torch.equal(y[-pad:].cpu(), torch.zeros(pad, c.H, c.P)), "padding tokens must give y = 0"
    if init_before is not None:  # the caller's initial_states are never written (no aliasing)
        assert torch.equal(torch.nan_to_num(kw["initial_states"]).cpu(), torch.nan_to_num(init_before).cpu())


@pytest.mark.parametrize("state_dtype", [F32, BF16], ids=["state-f32", "state-bf16"])
@pytest.mark.parametrize("name", ["tiny-g2", "real-g8"])
def test_ssd_raw_dt_fused_softplus_limit_and_state_dtype(kern, name, state_dtype, resume_path):
    """The mixer's call: raw dt with dt_bias and a time-step limit, processed inside the scan (the kernel's fused
    softplus + clamp, also feeding the initial-state correction), final states returned in the pool's dtype.
    Oracle: the reference fed with process_dt's step sizes."""
    c = case(kern, name)
    lens = [c.cs + 1, 1, 2 * c.cs + 5, 3]
    flags = [True, False, True, False]
    x, _, A, B, C, D = ssd_inputs(c, lens, BF16, kern.dev, seed=5)
    g = gen(6)
    T = sum(lens)
    raw = rnd(g, T, c.H, scale=2.0)
    raw[::7, 0] = 30.0  # above softplus's threshold of 20 (linear there), then clamped by the limit
    dt_bias = torch.empty(c.H).uniform_(-3.0, 0.0, generator=g)
    limit = (0.01, 0.5)
    raw, dt_bias = raw.to(kern.dev, BF16), dt_bias.to(kern.dev)
    h0 = garbage_states(gen(7), (len(lens), c.H, c.P, c.N), flags, kern.dev)
    cu, hi = cu_of(lens, kern.dev), flags_of(flags, kern.dev)
    y_r, fin_r = ref.ssd_chunk_scan(x, ref.process_dt(raw, dt_bias, limit), A, B, C, c.cs, cu, h0, hi, D=D)
    plan = ck.plan_prefill(cu.cpu(), hi.cpu(), T, c.cs, 4, kern.dev)
    y, fin = ck.ssd_chunk_scan(x, raw, A, B, C, c.cs, cu, h0, hi, D=D, plan=plan, dt_bias=dt_bias, dt_limit=limit,
                               state_dtype=state_dtype)
    assert y.dtype == BF16 and fin.dtype == state_dtype
    t = tol(kern, "ssd", BF16)
    assert_close(y, y_r, t, "y")
    assert_close(fin, fin_r, t, "final states")
    for s in range(len(lens)):
        a, b = int(cu[s]), int(cu[s + 1])
        assert_close(y[a:b], y_r[a:b], 2 * t, f"y of sequence {s} (len {lens[s]}, init {flags[s]})")


# ------------------------------------------------------------------------------------------------------
# causal conv1d (prefill)
# ------------------------------------------------------------------------------------------------------

CONV_DIMS = {"tiny": 160, "real": 1792}  # conv_dim = d_inner + 2*G*N: tiny-g1 (128 + 32), real (1536 + 256)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("dims", list(CONV_DIMS))
def test_causal_conv1d_varlen(kern, dims, width, dtype):
    if dims == "real" and kern.name == "fake":
        pytest.skip("realistic shapes only on the GPU")
    Dm, K = CONV_DIMS[dims], width - 1
    lens = [1, 2, 3, 5, 17] if dims == "tiny" else [1, 2, 255, 256, 700]  # some shorter than W-1
    flags = [True, False, True, True, False]
    g = gen(10 + width)
    T = sum(lens) + 3  # + padding tokens
    # x as a column slice of a wider "projection" with an odd row stride, as the mixer passes it.
    proj = rnd(g, T, Dm + 13).to(kern.dev, dtype)
    x = proj[:, 5:5 + Dm]
    w, b = rnd(g, Dm, width, scale=0.5).to(kern.dev, dtype), rnd(g, Dm, scale=0.1).to(kern.dev, dtype)
    init = garbage_states(g, (len(lens), K, Dm), flags, kern.dev, dtype)
    cu, hi = cu_of(lens, kern.dev), flags_of(flags, kern.dev)
    plan = ck.plan_prefill(cu.cpu(), hi.cpu(), T, 8, width, kern.dev)
    for bias, act, p in ((b, "silu", None), (None, None, None), (b, "silu", plan)):
        out, fin = ck.causal_conv1d(x, w, bias, cu, init, hi, activation=act, plan=p)
        out_r, fin_r = ref.causal_conv1d(x, w, bias, cu, init, hi, activation=act)
        assert out.dtype == dtype and fin.dtype == dtype
        assert_close(out, out_r, tol(kern, "conv", dtype), f"out (act={act})")
        assert torch.equal(fin.cpu(), fin_r.cpu()), "final conv states are copies of inputs: must be exact"
        assert torch.equal(out[sum(lens):].cpu(), torch.zeros(3, Dm, dtype=dtype)), "padding tokens -> 0"


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("row_pad", [0, 13], ids=["aligned-rows", "odd-row-stride"])
@pytest.mark.parametrize("dims", list(CONV_DIMS))
def test_causal_conv1d_fresh_prompts_read_in_place(kern, dims, row_pad, dtype, monkeypatch):
    """Fresh prompts (no state read, every sequence >= W-1 tokens, no padding): the conv reads x where it lies
    (the mixer's projection slice) when its rows allow the channel-last kernel's vector loads (16-byte aligned,
    row stride a multiple of 8), and goes through the extended buffer otherwise. Same results either way,
    checked against the reference; initial states flagged False are never read (garbage in them)."""
    if dims == "real" and kern.name == "fake":
        pytest.skip("realistic shapes only on the GPU")
    Dm, W = CONV_DIMS[dims], 4
    lens = [3, 8, 17, 5] if dims == "tiny" else [3, 255, 256, 700]
    T, S = sum(lens), len(lens)
    g = gen(30)
    proj = rnd(g, T, 8 + Dm + 8 + row_pad).to(kern.dev, dtype)
    x = proj[:, 8:8 + Dm]
    w, b = rnd(g, Dm, W, scale=0.5).to(kern.dev, dtype), rnd(g, Dm, scale=0.1).to(kern.dev, dtype)
    flags = [False] * S
    init = garbage_states(g, (S, W - 1, Dm), flags, kern.dev, dtype)
    cu, hi = cu_of(lens, kern.dev), flags_of(flags, kern.dev)
    launched = record_conv_launches(monkeypatch)
    plan = ck.plan_prefill(cu.cpu(), hi.cpu(), T, 8, W, kern.dev)
    assert plan.conv[W - 1].tok_row is None, "prompts that can be read in place: no extended rows built up front"
    out_r, fin_r = ref.causal_conv1d(x, w, b, cu, None, None, activation="silu")
    for kw in (dict(plan=None), dict(plan=plan), dict(initial_states=init, has_initial_state=hi, plan=plan)):
        launched.clear()
        out, fin = ck.causal_conv1d(x, w, b, cu, activation="silu", **kw)
        assert launched and (launched[0] == x.data_ptr()) == (row_pad == 0), "in-place layout taken or not"
        assert out.dtype == dtype and fin.dtype == dtype and out.is_contiguous()
        assert_close(out, out_r, tol(kern, "conv", dtype), f"out ({list(kw)})")
        assert torch.equal(fin.cpu(), fin_r.cpu()), "final conv states are copies of inputs: must be exact"
    # Rows the kernel cannot read in place: the extended rows were built on demand, once, into the shared plan.
    assert (plan.conv[W - 1].tok_row is None) == (row_pad == 0)


def _conv_resumed_runs(kern, dims, dtype, lens, flags, seed, monkeypatch):
    """causal_conv1d on sequences of which some resume a saved state (unflagged states hold garbage), without a
    plan and with the builder's: checked against the reference (final states exactly); yields, per call, the
    input pointers of the conv launches it made and x's own pointer."""
    if dims == "real" and kern.name == "fake":
        pytest.skip("realistic shapes only on the GPU")
    Dm, W = CONV_DIMS[dims], 4
    T, S = sum(lens), len(lens)
    g = gen(seed)
    x = rnd(g, T, 8 + Dm + 8).to(kern.dev, dtype)[:, 8:8 + Dm]
    w, b = rnd(g, Dm, W, scale=0.5).to(kern.dev, dtype), rnd(g, Dm, scale=0.1).to(kern.dev, dtype)
    init = garbage_states(g, (S, W - 1, Dm), flags, kern.dev, dtype)
    cu, hi = cu_of(lens, kern.dev), flags_of(flags, kern.dev)
    launched = record_conv_launches(monkeypatch)
    out_r, fin_r = ref.causal_conv1d(x, w, b, cu, init, hi, activation="silu")
    for p in (None, ck.plan_prefill(cu.cpu(), hi.cpu(), T, 8, W, kern.dev)):
        launched.clear()
        out, fin = ck.causal_conv1d(x, w, b, cu, init, hi, activation="silu", plan=p)
        assert_close(out, out_r, tol(kern, "conv", dtype), "out")
        assert torch.equal(fin.cpu(), fin_r.cpu()), "final conv states are copies of inputs: must be exact"
        yield list(launched), x.data_ptr()


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dims", list(CONV_DIMS))
def test_causal_conv1d_resumed_sequences(kern, dims, dtype, resume_path, monkeypatch):
    """Some sequences resume a saved state, every sequence has >= W-1 tokens. "rerun": x is convolved in place
    as if all were fresh, then each resumed sequence's first W-1 outputs are recomputed from its state (one
    small launch each); "correction": the extended buffer. Both against the reference; unflagged states hold
    garbage."""
    lens = [3, 9, 4, 17] if dims == "tiny" else [3, 255, 256, 700]
    flags = [True, False, True, True]
    for launched, x_ptr in _conv_resumed_runs(kern, dims, dtype, lens, flags, 31, monkeypatch):
        if resume_path.name == "rerun":
            assert launched[0] == x_ptr and len(launched) == 1 + sum(flags), launched
        else:
            assert len(launched) == 1 and launched[0] != x_ptr


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dims", list(CONV_DIMS))
def test_causal_conv1d_lone_first_resumed_sequence_is_read_in_place(kern, dims, dtype, monkeypatch):
    """One resumed sequence, first in the batch, all >= W-1 tokens: ONE launch reading x in place, the state
    through the kernel's own initial_states (no rerun). Against the reference; other states hold garbage."""
    lens = [5, 9, 17] if dims == "tiny" else [300, 255, 700]
    for launched, x_ptr in _conv_resumed_runs(kern, dims, dtype, lens, [True, False, False], 32, monkeypatch):
        assert launched == [x_ptr], launched


def test_causal_conv1d_fallback_dim_not_multiple_of_8(kern):
    g = gen(20)
    lens, Dm = [3, 9], 20
    x, w = rnd(g, 12, Dm).to(kern.dev), rnd(g, Dm, 4).to(kern.dev)
    cu = cu_of(lens, kern.dev)
    out, fin = ck.causal_conv1d(x, w, None, cu)
    out_r, fin_r = ref.causal_conv1d(x, w, None, cu)
    assert torch.equal(out.cpu(), out_r.cpu()) and torch.equal(fin.cpu(), fin_r.cpu())


# ------------------------------------------------------------------------------------------------------
# decode: state pools that are strided views into one raw buffer, as vLLM allocates them
# ------------------------------------------------------------------------------------------------------


def pool_views(raw, K, Dm, H, P, N, conv_dtype, ssm_dtype):
    """vLLM-style per-slot pages of bytes: [conv (K, D) | pad | ssm (H, P, N) | pad]; strided views."""
    num_slots = raw.shape[0]
    es_c, es_s = (torch.empty(0, dtype=d).element_size() for d in (conv_dtype, ssm_dtype))
    conv_bytes, ssm_bytes = K * Dm * es_c, H * P * N * es_s
    ssm_off = -(-conv_bytes // 64) * 64 + 64
    assert raw.shape[1] >= ssm_off + ssm_bytes
    conv = raw[:, :conv_bytes].view(conv_dtype).view(num_slots, K, Dm)
    ssm = raw[:, ssm_off:ssm_off + ssm_bytes].view(ssm_dtype).view(num_slots, H, P, N)
    return conv, ssm, conv_bytes, ssm_off


def make_pools(num_slots, K, Dm, H, P, N, conv_dtype, ssm_dtype, dev, seed):
    """A raw uint8 buffer (random bytes: slots are never zeroed) and its (conv, ssm) pool views, whose
    state entries are filled with random normals."""
    es_c, es_s = (torch.empty(0, dtype=d).element_size() for d in (conv_dtype, ssm_dtype))
    page = -(-(K * Dm * es_c) // 64) * 64 + 64 + H * P * N * es_s + 64
    raw = torch.randint(0, 256, (num_slots, page), dtype=torch.uint8, generator=gen(seed)).to(dev)
    conv, ssm, _, _ = pool_views(raw, K, Dm, H, P, N, conv_dtype, ssm_dtype)
    conv.copy_(rnd(gen(seed + 1), num_slots, K, Dm).to(conv_dtype))
    ssm.copy_(rnd(gen(seed + 2), num_slots, H, P, N).to(ssm_dtype))
    assert not conv.is_contiguous() and not ssm.is_contiguous()
    return raw, conv, ssm


SLOTS = [7, 2, 11, 5, 14, 1]  # scattered, unsorted


@pytest.mark.parametrize("dtypes", [(F32, F32), (BF16, BF16), (BF16, F32)],
                         ids=["f32", "bf16", "bf16-x-f32-pool"])
@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("dims", list(CONV_DIMS))
def test_conv_update_pool(kern, dims, width, dtypes):
    if dims == "real" and kern.name == "fake":
        pytest.skip("realistic shapes only on the GPU")
    x_dtype, pool_dtype = dtypes
    Dm, K = CONV_DIMS[dims], width - 1
    shape = (K, Dm, 2, 4, 8, pool_dtype, F32)
    raw, conv, _ = make_pools(16, *shape, kern.dev, seed=30 + width)
    raw_r = raw.clone()
    conv_r, _, conv_bytes, _ = pool_views(raw_r, *shape)
    g = gen(40)
    proj = rnd(g, len(SLOTS), Dm + 11).to(kern.dev, x_dtype)
    x = proj[:, 3:3 + Dm]
    w, b = rnd(g, Dm, width, scale=0.5).to(kern.dev, x_dtype), rnd(g, Dm, scale=0.1).to(kern.dev, x_dtype)
    idx = torch.tensor(SLOTS, dtype=torch.int64, device=kern.dev)
    for step in range(2):  # two steps: the second reads what the first wrote
        y = ck.conv_update(x, conv, w, b, idx, activation="silu")
        y_r = ref.conv_update(x, conv_r, w, b, idx, activation="silu")
        assert y.dtype == x_dtype
        assert_close(y, y_r, tol(kern, "conv", x_dtype), f"out step {step}")
        if x_dtype == pool_dtype:
            assert torch.equal(conv[idx].cpu(), conv_r[idx].cpu()), "shifted conv states must be exact"
        else:
            assert_close(conv[idx], conv_r[idx], 1e-6, "conv states")
        x = x.flip(0)
    untouched = [s for s in range(16) if s not in SLOTS]
    assert torch.equal(raw[untouched].cpu(), raw_r[untouched].cpu()), "untouched slots must be bit-identical"
    assert torch.equal(raw[SLOTS, conv_bytes:].cpu(), raw_r[SLOTS, conv_bytes:].cpu()), "wrote past conv state"


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
@pytest.mark.parametrize("H, G", [(24, 1), (80, 1), (128, 8)], ids=["130m", "2.7b", "7b"])
@pytest.mark.parametrize("launch", [None, (16, 2), (32, 4), (4, 4), (4, 1)], ids=["table", "16x2", "32x4", "4x4", "4x1"])
def test_ssm_state_update_launch_configs(kern, H, G, launch, pool_dtype):
    """The plugin's own launches of mamba-ssm's state-update kernel (ssu_launch_config's table, and explicit
    tiles) on the benchmark shapes, bf16 and fp32 pools with bf16 inputs: same results as the plain-torch
    reference, other slots intact."""
    if kern.name == "fake":
        pytest.skip("launches the Triton kernel itself: GPU only")
    P, N, Bsz, slots = 64, 128, 64, 150
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
    if launch is None:  # the table's H200 choice applies here (batch*heads 1536-8192)
        assert ck.ssu_launch_config(Bsz, H, P, N, pool_dtype) == ((16, 2) if pool_dtype == BF16 else (4, 1))
    y = ck.ssm_state_update(pool, x, dt, A, B, C, idx, D=D, dt_bias=dt_bias, dt_softplus=True, launch=launch)
    y_r = ref.ssm_state_update(pool_r, x, ref.process_dt(dt, dt_bias), A, B, C, idx, D=D)
    assert_close(y, y_r, tol(kern, "ssm", BF16), "y")
    assert_close(pool[idx], pool_r[idx], tol(kern, "ssm", pool_dtype), "states")
    rest = torch.ones(slots, dtype=torch.bool, device=kern.dev)
    rest[idx] = False
    assert torch.equal(pool[rest], pool_r[rest]), "slots outside the batch must be untouched"


def test_ssu_launch_table_keeps_upstream_for_unmeasured_shapes():
    assert ck.ssu_launch_config(1, 24, 64, 128, BF16) is None  # batch*heads 24: upstream's launch
    assert ck.ssu_launch_config(2, 24, 64, 128, F32) is None  # fp32 state, batch*heads 48: upstream's launch
    assert ck.ssu_launch_config(64, 24, 64, 128, F32) == (4, 1)  # fp32 state: vLLM's tuned H200 tiles
    assert ck.ssu_launch_config(256, 80, 64, 128, F32) == (8, 1)
    assert ck.ssu_launch_config(64, 24, 64, 128, torch.float64) is None  # 8-byte state: no entry
    assert ck.ssu_launch_config(64, 24, 32, 128, BF16) is None  # head_dim 32: not measured
    assert ck.ssu_launch_config(4, 24, 64, 128, torch.float16) == (16, 2)


@pytest.mark.parametrize("launch", [None, (16, 2)], ids=["upstream", "16x2"])
@pytest.mark.parametrize("H, G", [(8, 2), (80, 1)], ids=["tiny", "2.7b"])
def test_decode_padding_rows_are_skipped(kern, H, G, launch):
    """FULL decode graphs pad a batch to a captured size with slot id -1 (backend.PAD_SLOT): both decode
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


# ------------------------------------------------------------------------------------------------------
# gated RMSNorm
# ------------------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------------------
# end to end: prefill in two chunks + decode through the pools == one reference pass over everything
# ------------------------------------------------------------------------------------------------------


def _mix(k, xBC, cu, conv_pool, ssm_pool, slots, has_init, w, b, dt, A, D, c, Dx):
    """The conv -> SSD part of the mixer for a prefill batch, on kernel module k (cuda or reference)."""
    out, conv_fin = k.causal_conv1d(xBC, w, b, cu, conv_pool[slots], has_init, activation="silu")
    conv_pool[slots] = conv_fin.to(conv_pool.dtype)
    x, B, C = torch.split(out, [Dx, c.G * c.N, c.G * c.N], dim=-1)
    y, fin = k.ssd_chunk_scan(x.reshape(-1, c.H, c.P), dt, A, B.reshape(-1, c.G, c.N), C.reshape(-1, c.G, c.N),
                              c.cs, cu, ssm_pool[slots], has_init, D=D)
    ssm_pool[slots] = fin.to(ssm_pool.dtype)
    return y


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
    y_ref = _mix(ref, xBC, cu_all, conv0.clone(), ssm0.clone(), slots, None, w, b, dt, A, D, c, Dx)
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
        hi = torch.full((3,), bool(has), device=kern.dev)
        y[tok] = _mix(ck, xBC[tok], cu_of(plens, kern.dev), conv_pool, ssm_pool, slots, hi, w, b, dt[tok],
                      A, D, c, Dx)
    for step in (2, 1):  # decode: the last two tokens of each sequence
        tok = torch.tensor([st + L - step for st, L in zip(starts, lens)], device=kern.dev)
        xc = ck.conv_update(xBC[tok], conv_pool, w, b, slots, activation="silu")
        xs, Bs, Cs = torch.split(xc, [Dx, c.G * c.N, c.G * c.N], dim=-1)
        y[tok] = ck.ssm_state_update(ssm_pool, xs.reshape(-1, c.H, c.P), dt[tok], A, Bs.reshape(-1, c.G, c.N),
                                     Cs.reshape(-1, c.G, c.N), slots, D=D)
    assert_close(y, y_ref, 2 * tol(kern, "ssd", dtype), "outputs over all tokens")


# ------------------------------------------------------------------------------------------------------
# the mixer's start-up warm-up of the prefill kernels
# ------------------------------------------------------------------------------------------------------


def _mixer_layer(prefix, H, P, G, N, W=4, cs=32):
    """One Mamba2Mixer of the given shape (hidden size 32, conv bias, no linear biases), parameters uninitialised."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_mamba2_plugin import mixer as mixer_mod

    cfg = SimpleNamespace(hidden_size=32, num_heads=H, head_dim=P, n_groups=G, state_size=N, conv_kernel=W,
                          chunk_size=cs, layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True)
    with set_current_vllm_config(VllmConfig()):  # the layer registers itself in the config's forward context
        return mixer_mod.Mamba2Mixer(cfg, model_config=None, cache_config=None, prefix=prefix)


def _expected_ssd_calls(layouts, max_rerun):
    """(packed length, given an initial state) of each SSD forward call the prefill wrappers make for these
    layouts (cuda.ssd_chunk_scan's dispatch): a lone resumed first sequence rides the packed call's own initial
    state; up to max_rerun resumed sequences are rerun alone after a packed call without initial states; more
    take the batched correction (one packed call)."""
    calls = []
    for lengths, resumed in layouts:
        idx = [i for i, r in enumerate(resumed) if r]
        calls.append((sum(lengths), idx == [0]))
        if idx and idx != [0] and len(idx) <= max_rerun:
            calls += [(lengths[i], True) for i in idx]
    return calls


def _triton_classes(n: int) -> str:
    """Triton's specialisation of an integer argument: == 1, multiple of 16, other."""
    return "1" if n == 1 else "16" if n % 16 == 0 else "other"


@pytest.mark.parametrize("profile_tokens", [3, 165, 1100],
                         ids=["small-profile-run", "profile-run-over-2-chunks", "profile-run-over-15-chunks"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_prefill_warmup_runs_every_prefill_path_once(kern, dtype, profile_tokens, monkeypatch):
    """Mamba2Mixer._warm_prefill_kernels (profile run) drives the real prefill path through each of its branches:
    fresh prompts (one: final states from state passing; several with a boundary inside a chunk: the varlen
    final-state kernel), a sequence shorter than W-1 (extended conv buffer), a lone resumed sequence that opens
    the batch (the packed call's own initial state) ending inside chunk 0 or on a chunk boundary, up to
    SEPARATE_RESUMED_MAX resumed sequences (each rerun alone with its initial state), more (batched correction);
    each of the first four at every class of Triton's integer specialisation a step can produce (chunk count
    1 / 16k / other -- 16k only when the budget allows more than 15 chunks -- and packed length mod 16 in
    0 / 8 / 4 / 2 / 1); once per layer signature. When the profile run's batch is longer than two chunks, the
    FIRST call (the one the SSD kernels' autotuners decide on) packs that many tokens. On "cuda" this compiles
    and autotunes the real kernels."""
    from vllm_mamba2_plugin import mixer as mixer_mod

    H, P, G, N, W, cs = 4, 8, 2, 16, 4, 32
    layer = _mixer_layer("warm.mixer", H, P, G, N, W, cs)
    g = gen(90)
    with torch.no_grad():
        for _, p in layer.named_parameters():
            p.copy_(rnd(g, *p.shape, scale=0.1))
        layer.A.copy_(-torch.rand(H, generator=g) - 0.5)
    layer = layer.to(kern.dev)
    for m in (layer.in_proj, layer.conv1d, layer.out_proj, layer.norm):
        m.to(dtype)
    monkeypatch.setattr(layer, "get_state_dtype", lambda: (dtype, F32))
    monkeypatch.setattr(mixer_mod, "get_kernels", lambda dev: ck)
    monkeypatch.setattr(mixer_mod.Mamba2Mixer, "_warm_prefill_signatures", set())
    ns = ck._kernels() if kern.name == "cuda" else FAKE_KERNELS
    calls, real = [], ns.ssd_fwd
    monkeypatch.setattr(ns, "ssd_fwd", lambda x, *a, **kw: (calls.append((x.shape[1], kw.get("initial_states")
                                                                          is not None)), real(x, *a, **kw))[1])
    launched = record_conv_launches(monkeypatch)
    projected = torch.zeros(profile_tokens, layer.in_proj.out_features, device=kern.dev, dtype=dtype)

    layer._warm_prefill_kernels(projected)
    layouts = layer._warm_prefill_layouts(ck.SEPARATE_RESUMED_MAX, profile_tokens)
    assert all(sum(lengths) <= max(profile_tokens, 4 * cs) for lengths, _ in layouts)  # small ones, or within budget
    assert calls == _expected_ssd_calls(layouts, ck.SEPARATE_RESUMED_MAX)
    # The first call of each SSD call signature (packed without / with an initial state; a rerun: no seq_idx)
    # packs the whole budget: the autotuners decide on it. (Packed calls carry seq_idx, reruns do not.)
    T = profile_tokens
    first = [(T, False), (T, True), (T, False), (T - 1, True)] if T > 2 * cs else []
    assert calls[:len(first)] == first
    if first:
        assert layouts[2][1] == [False, True]  # the rerun's call: a resumed sequence that is not the first
    # every (chunk-count class, length mod 16, path) of the first four paths, as a step can produce them
    chunk_classes = {"1", "other"} | ({"16"} if profile_tokens >= 15 * cs + 32 else set())
    seen = {(_triton_classes(-(-sum(lengths) // cs)), sum(lengths) % 16, tuple(resumed), len(lengths) == 1)
            for lengths, resumed in layouts[3 if first else 0:]}
    for c in chunk_classes:
        for r in (0, 8, 4, 2, 1):
            assert (c, r, (False,), True) in seen  # one fresh prompt
            assert (c, r, (False, False), False) in seen  # two, split inside a chunk
            assert (c, r, (True, False), False) in seen  # resumed first sequence
    assert any(lengths[0] % cs == 0 and resumed == [True, False] for lengths, resumed in layouts)  # on a boundary
    assert ([1], [False]) in layouts and ([1], [True]) in layouts
    assert any(min(lengths) < W - 1 and not any(resumed) for lengths, resumed in layouts)  # extended conv buffer
    rerun = [r for r in calls if r[1]]
    assert {37, 48, 1} <= {t for t, _ in rerun} and (80, False) in calls  # reruns and the batched correction
    n = len(calls)
    assert len(launched) >= 5
    layer._warm_prefill_kernels(projected)  # same signature: nothing runs again
    assert len(calls) == n
    monkeypatch.setattr(layer, "get_state_dtype", lambda: (dtype, BF16))  # another SSM state dtype: warms again
    layer._warm_prefill_kernels(projected)
    assert len(calls) == 2 * n


def _chunked_prefill_steps(rng, budget: int, n: int):
    """n steps as vLLM's scheduler makes them with chunked prefill: nd decode rows, then a prefill block of at most
    budget - nd tokens: maybe the rest of a prompt cut by the previous step (resumed), then fresh prompts, the
    last one cut where the budget ends; and some small steps (a few short prompts)."""
    steps = []
    for i in range(n):
        nd = rng.randint(0, 64)
        if i % 4 == 3:  # a small step
            lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 4))]
            steps.append((nd, lengths, [False] * len(lengths)))
            continue
        room, lengths, resumed = budget - nd, [], []
        if rng.random() < 0.5:
            lengths.append(min(rng.randint(1, 4096), room))
            resumed.append(True)
        while sum(lengths) < room:
            lengths.append(min(rng.choice([rng.randint(1, 600), rng.randint(1, 4096)]), room - sum(lengths)))
            resumed.append(False)
        steps.append((nd, lengths, resumed))
    return steps


@pytest.mark.gpu
@pytest.mark.parametrize("H", [24, 80], ids=["130m", "2.7b"])
def test_warmups_leave_nothing_to_compile_for_chunked_prefill_steps(H, monkeypatch):
    """After the profile run's warm-ups (prefill and decode), the steps of serving compile no Triton kernel: a
    compile inside a step is a latency spike at a first request (vLLM's JIT monitor saw _state_passing_fwd_kernel
    compile at the first requests of 2.7b runs on the H200). Steps as vLLM's scheduler makes them
    at an 8 192-token budget (decode rows, a resumed chunk, fresh prompts, the last one cut), through the mixer's
    own decode / prefill / norm steps. Triton's compile hook records every compile, warm-ups included, so a failure
    names the specialisation the warm-up missed next to the ones it compiled."""
    import random

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("mamba_ssm")
    pytest.importorskip("causal_conv1d")
    from triton import knobs

    from vllm_mamba2_plugin import mixer as mixer_mod

    P, G, N, W, cs, budget, dev = 64, 1, 128, 4, 256, 8192, torch.device("cuda")
    layer = _mixer_layer(f"warmjit{H}.mixer", H, P, G, N, W, cs)
    with torch.no_grad():
        for _, p in layer.named_parameters():
            p.copy_(rnd(gen(91), *p.shape, scale=0.1))
        layer.A.copy_(-torch.rand(H, generator=gen(92)) - 0.5)
    layer = layer.to(dev)
    for m in (layer.in_proj, layer.conv1d, layer.out_proj, layer.norm):
        m.to(BF16)
    monkeypatch.setattr(layer, "get_state_dtype", lambda: (BF16, BF16))
    monkeypatch.setattr(mixer_mod.Mamba2Mixer, "_warm_prefill_signatures", set())
    monkeypatch.setattr(mixer_mod.Mamba2Mixer, "_warm_decode_signatures", set())
    compiles = []

    def hook(**kw):
        compiles.append((getattr(kw.get("fn"), "name", "?"), kw.get("repr", "?")))
        return None

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", hook)
    projected = torch.zeros(budget, layer.in_proj.out_features, device=dev, dtype=BF16)
    layer._warm_prefill_kernels(projected)
    layer._warm_decode_kernels(projected)
    warm, compiles[:] = list(compiles), []

    conv_pool, ssm_pool = layer._scratch_pools(256, dev)
    steps = [(0, [64, 64, 64, 64], [False] * 4), (0, [512], [False]), (0, [512] * 16, [False] * 16),
             (16, [512] * 15 + [496], [False] * 16), (33, [16] + [512] * 15 + [15], [True] + [False] * 16)]
    steps += _chunked_prefill_steps(random.Random(0), budget, 40)
    missed = []
    for nd, lengths, resumed in steps:
        rows = torch.randn(nd + sum(lengths), projected.shape[-1], device=dev, dtype=BF16)
        if nd:
            z, xBC, dt = layer._split_projection(rows[:nd])
            slots_d = torch.arange(1, nd + 1, device=dev)
            y = layer._decode_step(ck, xBC, dt, conv_pool, ssm_pool, slots_d, slots_d.to(torch.int32))
            layer._gated_norm(ck, y, z, out=projected.new_empty(nd, layer.d_inner))
        layer._run_prefill_layout(ck, rows[nd:], lengths, resumed, conv_pool, ssm_pool, first_slot=nd + 1)
        torch.cuda.synchronize()
        if compiles:
            missed.append((nd, lengths, resumed, list(compiles)))
            compiles[:] = []
    if missed:
        names = {name for *_, cs_ in missed for name, _ in cs_}
        lines = [f"decode rows {nd}, lengths {lengths}, resumed {resumed}:\n  " + "\n  ".join(r for _, r in cs_)
                 for nd, lengths, resumed, cs_ in missed]
        lines += ["compiled by the warm-ups:"] + [f"  {r}" for name, r in warm if name in names]
        pytest.fail("steps compiled Triton kernels after the warm-ups:\n" + "\n".join(lines))


def _ssu_specialisations(batches, H, P, N, state_dtype):
    """(launch, Triton's class of the integer batch argument) of each batch size's state update."""
    return {(ck.ssu_launch_config(b, H, P, N, state_dtype), _triton_classes(b)) for b in batches}


@pytest.mark.parametrize("state_dtype", [BF16, F32, torch.float64], ids=["bf16", "f32", "f64"])
@pytest.mark.parametrize("H", [24, 80, 128], ids=["130m", "2.7b", "7b"])
def test_ssu_warm_batches_reach_every_launch_the_table_can_pick(H, state_dtype):
    """The decode warm-up's batch sizes compile each (launch, batch specialisation) pair that a step of ANY
    batch size could need: checked against every batch size up to 4096 (brute force, not the formula)."""
    want = _ssu_specialisations(range(1, 4097), H, 64, 128, state_dtype)
    got = _ssu_specialisations(ck.ssu_warm_batches(H, 64, 128, state_dtype), H, 64, 128, state_dtype)
    assert got == want
    if state_dtype == F32:  # the fp32 table's second tile (from batch*heads 12288) is among them
        assert (ck.SSU_LAUNCH_TABLE[(64, 128, 4)][-1][1], "other") in got


def test_decode_warmup_runs_the_warm_batches(kern, monkeypatch):
    """Mamba2Mixer._warm_decode_kernels (profile run) runs the decode step at every batch size of
    ck.ssu_warm_batches for its shape and pool dtype, once per layer signature; rows beyond the 16 scratch slots
    reuse them. "fake": a two-tile table patched in for a tiny shape; "cuda": the 2.7b shape on fp32 pools, the
    real table and kernels (both tiles of the fp32 entry, batches up to 160 on 16 slots)."""
    from vllm_mamba2_plugin import mixer as mixer_mod

    fake = kern.name == "fake"
    H, P, G, N = (4, 8, 2, 16) if fake else (80, 64, 1, 128)
    layer = _mixer_layer("warmdec.mixer", H, P, G, N).to(kern.dev)
    monkeypatch.setattr(layer, "get_state_dtype", lambda: (F32, F32))
    monkeypatch.setattr(mixer_mod, "get_kernels", lambda dev: ck)
    monkeypatch.setattr(mixer_mod.Mamba2Mixer, "_warm_decode_signatures", set())
    if fake:
        monkeypatch.setitem(ck.SSU_LAUNCH_TABLE, (P, N, 4), [(8, (4, 1)), (40, (8, 1))])
    seen, real = [], ck.ssm_state_update

    def recording(ssm_states, x, dt, A, B, C, state_indices, **kw):
        seen.append((x.shape[0], ck.ssu_launch_config(x.shape[0], H, P, N, ssm_states.dtype),
                     state_indices.min().item(), state_indices.max().item()))
        if not fake:
            return real(ssm_states, x, dt, A, B, C, state_indices, **kw)
        return ref.ssm_state_update(ssm_states, x, ref.process_dt(dt, kw.get("dt_bias")), A, B, C, state_indices,
                                    D=kw.get("D"))

    monkeypatch.setattr(ck, "ssm_state_update", recording)
    projected = torch.zeros(3, layer.in_proj.out_features, device=kern.dev)
    layer._warm_decode_kernels(projected)
    batches = ck.ssu_warm_batches(H, P, N, F32)
    # launch ranges start at batch 1, 2 (8 / H) and 10 (40 / H) with the patched table; 1 and 154 (12288 / 80)
    # with the real fp32 entry
    assert batches == ([1, 2, 3, 10, 11, 16] if fake else [1, 2, 16, 154, 155, 160])
    assert [b for b, *_ in seen] == batches
    # every launch any batch size could take ran (the patched table leaves batch 1 on upstream's: None)
    assert {c for _, c, *_ in seen} == {ck.ssu_launch_config(b, H, P, N, F32) for b in range(1, 4097)}
    assert all(1 <= lo and hi <= 16 for *_, lo, hi in seen)  # scratch slots 1..16, slot 0 never written
    layer._warm_decode_kernels(projected)  # same signature: nothing runs again
    assert len(seen) == len(batches)


def test_reference_kernels_on_cuda_skip_the_kernel_warmups(monkeypatch):
    """With VLLM_MAMBA2_PLUGIN_KERNELS=reference on a CUDA device there is nothing to compile: the profile run
    must not enter the warm-ups (they drive the CUDA wrappers' paths); with the default it does."""
    from vllm_mamba2_plugin import compat

    layer = _mixer_layer("warmref.mixer", H=4, P=8, G=1, N=16)
    monkeypatch.setattr(compat, "layer_metadata", lambda prefix: None)  # the profile run's forward context
    warmed = []
    monkeypatch.setattr(layer, "_warm_prefill_kernels", lambda p: warmed.append("prefill"))
    monkeypatch.setattr(layer, "_warm_decode_kernels", lambda p: warmed.append("decode"))
    projected = SimpleNamespace(is_cuda=True, device=torch.device("cuda"))  # stands in for a CUDA tensor
    out = torch.ones(2, 3)
    monkeypatch.setenv("VLLM_MAMBA2_PLUGIN_KERNELS", "reference")
    layer.conv_ssm_forward(projected, out)
    assert warmed == [] and torch.equal(out, torch.zeros(2, 3))
    monkeypatch.setenv("VLLM_MAMBA2_PLUGIN_KERNELS", "auto")
    layer.conv_ssm_forward(projected, out)
    assert warmed == ["prefill", "decode"]


# ------------------------------------------------------------------------------------------------------
# import behaviour (CPU)
# ------------------------------------------------------------------------------------------------------


def test_importing_cuda_module_does_not_import_kernels():
    code = ("import sys, vllm_mamba2_plugin.kernels.cuda; "
            "assert 'mamba_ssm' not in sys.modules and 'causal_conv1d' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))


@pytest.mark.skipif(importlib.util.find_spec("mamba_ssm") is not None, reason="mamba_ssm is installed")
def test_missing_packages_give_one_clear_error(monkeypatch):
    monkeypatch.setattr(ck, "_KERNELS", None)
    with pytest.raises(ImportError, match="pip install mamba-ssm causal-conv1d"):
        ck.gated_rms_norm(torch.ones(2, 8), None, torch.ones(8), 1e-5, 8)


def test_launch_path_install_failure_falls_back_with_a_warning(monkeypatch, caplog):
    """If installing the fast launch path fails (a Triton or mamba-ssm whose internals differ), the kernels are
    still usable through Triton's own launch path, and the log says so once, naming the switches."""
    import types

    from vllm_mamba2_plugin.kernels import triton_launch

    fake = {name: types.ModuleType(name) for name in (
        "causal_conv1d_cuda", "mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton",
        "mamba_ssm.ops.triton.layernorm_gated", "mamba_ssm.ops.triton.selective_state_update",
        "mamba_ssm.ops.triton.ssd_combined")}
    fake["causal_conv1d_cuda"].causal_conv1d_fwd = fake["causal_conv1d_cuda"].causal_conv1d_update = object()
    fake["mamba_ssm.ops.triton.layernorm_gated"]._layer_norm_fwd = object()
    ssu = fake["mamba_ssm.ops.triton.selective_state_update"]
    ssu._selective_scan_update_kernel, ssu.selective_state_update = object(), object()
    fake["mamba_ssm.ops.triton.ssd_combined"]._mamba_chunk_scan_combined_fwd = object()
    for name, mod in fake.items():
        monkeypatch.setitem(sys.modules, name, mod)

    def broken(**kw):
        raise AttributeError("'Autotuner' object has no attribute 'cache'")

    monkeypatch.setattr(triton_launch, "install", broken)
    monkeypatch.setattr(ck, "_KERNELS", None)
    with caplog.at_level("WARNING"):
        k = ck._kernels()
    assert k.ssu_kernel is ssu._selective_scan_update_kernel  # Triton's own object at the plugin's call site
    assert [r for r in caplog.records if "could not install the fast Triton launch path" in r.getMessage()
            and "VLLM_MAMBA2_PLUGIN_FAST_LAUNCH=0" in r.getMessage() and "no attribute 'cache'" in r.getMessage()]
