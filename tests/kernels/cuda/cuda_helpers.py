"""Backends, inputs, tolerances and comparisons shared by the CUDA wrappers' tests (tests/kernels/cuda/).

Every test taking the ``kern`` fixture runs twice (test modules import it from here):
  * "cuda" (marked ``gpu``): the real upstream kernels on a CUDA GPU; skipped cleanly without CUDA or without
    mamba_ssm / causal_conv1d (nothing here imports them at collection time).
  * "fake": runs anywhere (CPU CI), the upstream entry points replaced by ``fakes.FAKE_KERNELS``. Only "cuda"
    checks the kernels themselves.

Tolerances, as max |actual - expected| <= tol * max |expected| (see TOL):
  * float32: 1e-4, SSD included: the wrappers run mamba-ssm's SSD kernels with IEEE float32 products
    (upstream.fp32_products_in_ieee; with TF32, Triton's default for float32 dots, they need ~5e-3), and the
    rest is CUDA conv FMAs, the elementwise Triton state update and a row-wise norm.
  * bfloat16: outputs are rounded to bf16 (2^-8..2^-7 relative) by both sides, possibly in different
    directions: 1e-2; SSD in bf16 also casts CB and inter-chunk states to bf16 inside the kernel: 3e-2.
  * "fake" float32: 1e-4 everywhere (same arithmetic as the reference up to summation order).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from fakes import FAKE_KERNELS
from vllm_mamba2_plugin.kernels import reference as ref
from vllm_mamba2_plugin.kernels.cuda import conv as conv_mod
from vllm_mamba2_plugin.kernels.cuda import upstream, varlen_plan

BF16, F32 = torch.bfloat16, torch.float32


@pytest.fixture(params=[pytest.param("fake", id="fake"),
                        pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
def kern(request, monkeypatch):
    if request.param == "fake":
        monkeypatch.setattr(upstream, "_KERNELS", FAKE_KERNELS)
        return SimpleNamespace(name="fake", dev=torch.device("cpu"))
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("mamba_ssm")
    pytest.importorskip("causal_conv1d")
    upstream.kernels()  # fail (not skip) if they are installed but do not import
    # The reference must be float32-exact on the GPU: no TF32 in its einsums.
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    return SimpleNamespace(name="cuda", dev=torch.device("cuda"))


@pytest.fixture(params=["singles", "rows", "groups"])
def resume_path(request, kern, monkeypatch):
    """How the resumed sequences that the packed call cannot start from their state are grouped
    (``varlen_plan.RowGroup``): "singles" (each one its own call on its own tokens; the conv recomputes their
    first outputs in place), "rows" (all as the padded rows of one call; the conv's extended buffer) or "groups"
    (the shipped limits). Returns the list of SSD forward calls' batch-row lengths, to check what ran."""
    if request.param != "groups":
        singles = request.param == "singles"
        monkeypatch.setattr(varlen_plan, "ROWS_MAX_PADDING", 0.0 if singles else float("inf"))
        monkeypatch.setattr(varlen_plan, "ROWS_MAX_CHUNKS", 1 << 30)
        monkeypatch.setattr(varlen_plan, "CONV_RECOMPUTE_MAX", 1 << 30 if singles else -1)
    ns = upstream.kernels() if kern.name == "cuda" else FAKE_KERNELS
    calls, real = [], ns.ssd_fwd

    def counting(x, *a, **kw):
        calls.append(x.shape[1])
        return real(x, *a, **kw)

    monkeypatch.setattr(ns, "ssd_fwd", counting)
    return SimpleNamespace(name=request.param, calls=calls)


def group_calls(plan, lengths) -> list:
    """The batch-row length of each row group's call of ``plan``: its padded length, or a lone sequence's own."""
    return [g.rows.L if g.rows is not None else lengths[g.seqs[0]] for g in plan.groups]


def record_chunk_state_varlen(kern, monkeypatch):
    """The cu_seqlens length (2 per boundary state asked: ``varlen_plan._packed_pairs``) of every
    chunk_state_varlen the wrappers launch themselves (not the one inside mamba-ssm's forward)."""
    ns = upstream.kernels() if kern.name == "cuda" else FAKE_KERNELS
    launched, real = [], ns.chunk_state_varlen
    monkeypatch.setattr(ns, "chunk_state_varlen", lambda *a: (launched.append(a[4].numel()), real(*a))[1])
    return launched


def record_conv_launches(monkeypatch):
    """The data pointers of the inputs of every causal-conv1d forward the wrapper launches (x's own pointer:
    read in place; anything else: a staging buffer or a slice)."""
    launched, real_fwd = [], conv_mod._conv_fwd
    monkeypatch.setattr(conv_mod, "_conv_fwd", lambda xv, *a: (launched.append(xv.data_ptr()), real_fwd(xv, *a))[1])
    return launched


TOL = {("ssd", BF16): 3e-2, ("any", F32): 1e-4, ("any", BF16): 1e-2}


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


def batch_of(lens, flags, dev, chunk_size=8, *, planned=True, num_tokens=None, conv_width=4, boundary_offsets=None):
    """The PrefillBatch of sequences of these lengths: planned by the CUDA kernels (the metadata builder's form),
    or not (the ops then plan the call themselves). num_tokens: x's tokens, default sum(lens)."""
    from vllm_mamba2_plugin.kernels import cuda as ck
    from vllm_mamba2_plugin.kernels.interface import PrefillBatch

    return PrefillBatch.of(cu_of(lens, dev), flags, chunk_size, device=dev, kernels=ck if planned else None,
                           conv_width=conv_width, num_tokens=num_tokens, boundary_offsets=boundary_offsets)


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


CONV_DIMS = {"tiny": 160, "real": 1792}  # conv_dim = d_inner + 2*G*N: tiny-g1 (128 + 32), real (1536 + 256)


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


def _mixer_layer(prefix, H, P, G, N, W=4, cs=32, conv_bias=True, dt_limit=(0.0, float("inf"))):
    """One Mamba2Mixer of the given shape (hidden size 32, no linear biases), parameters uninitialised."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_mamba2_plugin import compat
    from vllm_mamba2_plugin import mixer as mixer_mod

    cfg = SimpleNamespace(hidden_size=32, num_heads=H, head_dim=P, n_groups=G, state_size=N, conv_kernel=W,
                          chunk_size=cs, layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=conv_bias,
                          time_step_limit=dt_limit)
    with set_current_vllm_config(VllmConfig()):  # the layer registers itself in the config's forward context
        compat.init_single_rank_groups()  # the parallel linear layers read the TP group
        return mixer_mod.Mamba2Mixer(cfg, model_config=None, cache_config=None, prefix=prefix)


def grid_layer(name, dev):
    """The first mixer layer of the model grid's checkpoint ``name`` (tiny_model.GRID: its shape, dt limit and
    "wide" weights, so step sizes up to the limit or past 3), on ``dev``."""
    from vllm_mamba2_plugin import tiny_model

    spec = tiny_model.GRID[name]
    layer = _mixer_layer(f"grid-{name}.mixer", spec.num_heads, spec.head_dim, spec.n_groups, spec.state_size,
                         spec.conv_kernel, spec.chunk_size, conv_bias=spec.use_conv_bias,
                         dt_limit=spec.time_step_limit)
    w = {k.split("mixer.", 1)[1]: v for k, v in tiny_model.wide_weights(spec).items()
         if k.startswith("backbone.layers.0.mixer.")}
    w["A"] = -torch.exp(w.pop("A_log"))
    params = dict(layer.named_parameters())
    with torch.no_grad():
        for k in ("conv1d.weight", "conv1d.bias", "dt_bias", "A", "D", "norm.weight"):  # the op's parameters
            if k in w:
                params[k].copy_(w[k].view_as(params[k]))
    return layer.to(dev)
