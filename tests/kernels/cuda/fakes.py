"""Plain-torch stand-ins for the upstream kernels: the "fake" backend of the CUDA wrappers' tests.

They reproduce the argument checks (asserts / TORCH_CHECKs) and the semantics the wrappers rely on -- e.g. that
a packed SSD call gives an initial state only to the first sequence, that causal_conv1d_fn's varlen path needs
the channel-last layout and int32 seq_idx, that selective_state_update crashes on dt_bias=None -- so that the
wrappers' index plumbing, layouts and row groups are checked without a GPU. ``conftest.kern``
installs ``FAKE_KERNELS`` in place of ``upstream.kernels()``.
"""

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from vllm_mamba2_plugin.kernels import reference as ref
from vllm_mamba2_plugin.kernels.interface import PrefillBatch


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
        y, fin, _ = ref.ssd_chunk_scan(x[b], dtp[b], A, B[b], C[b], PrefillBatch.of(segs, has, chunk_size), init, D)
        outs.append(y)
        finals.append(fin)
        if initial_states is not None:
            states[b, 0] = initial_states[b].float()
        for c in range(1, nchunks):
            p = c * chunk_size
            j = max(k for k in range(len(segs) - 1) if segs[k] < p)  # the sequence of token p-1
            a = segs[j]
            h = init[:1] if j == 0 and init is not None and bool(has[0]) else None
            f = ref.ssd_chunk_scan(x[b, a:p], dtp[b, a:p], A, B[b, a:p], C[b, a:p],
                                   PrefillBatch.of([0, p - a], h is not None, chunk_size), h, D).final_states
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
        fin0 = ref.ssd_chunk_scan(x[0, a:b], dtp[0, a:b], A, B[0, a:b], C[0, a:b],
                                  PrefillBatch.of([0, b - a], chunk_size=chunk_size), None, D).final_states
        varlen[0] = fin0[0]
    return res + (varlen.to(C.dtype),)  # chunk states are stored in C's dtype (ssd_combined.py:381)


def _fake_chunk_state_varlen(B, x, dt, dA_cumsum, cu_seqlens, chunk_states):
    """mamba_ssm.ops.triton.ssd_chunk_state.chunk_state_varlen (ssd_chunk_state.py:1018-1044), its checks, and its
    kernel's arithmetic per consecutive (start, end) of cu_seqlens (:656-715): the state at token ``end`` from the
    tokens of end's chunk c from max(start, c * cs), plus the state entering chunk c, decayed, if start < c * cs.
    An end below 1 would read before the chunk's dA_cumsum: refused here."""
    total, nheads, headdim = x.shape
    _, nchunks, cs = dt.shape
    _, ngroups, dstate = B.shape
    assert nheads % ngroups == 0 and B.shape == (total, ngroups, dstate)
    assert dt.shape == (nheads, nchunks, cs) and dA_cumsum.shape == dt.shape
    assert chunk_states.shape == (nchunks, nheads, headdim, dstate)
    assert cu_seqlens.dtype == torch.int32  # as the varlen final states' bounds: one kernel specialisation
    bounds = cu_seqlens.tolist()
    Bh = B.float().repeat_interleave(nheads // ngroups, dim=1)  # (T, H, N)
    out = torch.empty(len(bounds) - 1, nheads, headdim, dstate, dtype=chunk_states.dtype)
    for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        assert end >= 1, f"chunk_state_varlen would read dA_cumsum before chunk 0 (end {end})"
        c = (end - 1) // cs
        lo, hi = min(c * cs + max(start - c * cs, 0), end), end  # start > end: no tokens (the odd pairs)
        last = dA_cumsum[:, c, end - c * cs - 1].float()  # (H,)
        k = torch.arange(lo - c * cs, hi - c * cs)
        scale = torch.exp(torch.clamp(last[:, None] - dA_cumsum[:, c, k].float(), max=0.0)) * dt[:, c, k].float()
        Bs = (Bh[lo:hi] * scale.t()[:, :, None]).to(x.dtype).float()  # the kernel rounds B * scale to x's dtype
        acc = torch.einsum("khp,khn->hpn", x[lo:hi].float(), Bs)
        if start < c * cs:
            acc = acc + chunk_states[c].float() * torch.exp(last)[:, None, None]
        out[b] = acc.to(out.dtype)
    return out


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
    chunk_state_varlen=_fake_chunk_state_varlen,
    selective_state_update=_fake_state_update,
    layer_norm_fwd=_fake_layer_norm_fwd,
    conv_fwd=_fake_conv_fwd,
    conv_update=_fake_conv_update,
)
