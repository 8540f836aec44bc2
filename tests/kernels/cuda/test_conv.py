"""kernels/cuda/conv.py against kernels.reference: the prefill conv's layouts and the decode update on
vLLM-style strided pools.
"""

from __future__ import annotations

import pytest
import torch

from cuda_helpers import kern, resume_path  # noqa: F401  (fixtures)
from cuda_helpers import (BF16, CONV_DIMS, F32, SLOTS, assert_close, batch_of, gen, garbage_states, make_pools,
                          pool_views, record_conv_launches, rnd, tol)
from vllm_mamba2_plugin.kernels import cuda as ck
from vllm_mamba2_plugin.kernels import reference as ref


@pytest.mark.parametrize("width", [2, 4])
def test_conv_states_at_block_boundaries_from_the_plan_without_reading_the_bounds(kern, width):
    """Prefix caching's boundary conv states through the step's plan: the same copies as the reference, for
    offsets deep in a sequence, at its end, and closer than K to its start (reaching into a saved state, or
    zeros for a fresh sequence whose slot holds garbage); no offsets for some sequences. With a plan the device
    bounds are never read (None here): no host sync per layer."""
    Dm, K = CONV_DIMS["tiny"], width - 1
    lens, flags = [9, 2, 5, 4, 7], [True, True, False, True, False]
    offsets = [[1, 4, 9], [2], [1, 5], [], [7]]
    g = gen(40 + width)
    T = sum(lens) + 3
    x = rnd(g, T, Dm).to(kern.dev, BF16)
    init = garbage_states(g, (len(lens), K, Dm), flags, kern.dev, BF16)

    def batch(offs, planned=True):
        return batch_of(lens, flags, kern.dev, num_tokens=T, conv_width=width, boundary_offsets=offs,
                        planned=planned)

    def unread(b):  # the device bounds must not be read: poison them
        object.__setattr__(b, "cu_seqlens", None)
        return b

    want = ref.conv_states_at(x, width, batch(offsets, False), init)
    got = ck.conv_states_at(x, width, unread(batch(offsets)), init)
    assert torch.equal(got.cpu(), want.cpu())
    deep = [[o for o in offs if o >= K] for offs in offsets]  # the one-gather form
    got = ck.conv_states_at(x, width, unread(batch(deep)), init)
    assert torch.equal(got.cpu(), ref.conv_states_at(x, width, batch(deep, False), init).cpu())
    assert torch.equal(ck.conv_states_at(x, width, unread(batch(offsets))).cpu(),
                       ref.conv_states_at(x, width, batch(offsets, False)).cpu())  # no saved states: zeros
    with pytest.raises(ValueError, match="outside a sequence"):
        ck.conv_states_at(x, width, batch([[10]] + offsets[1:]), init)


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
    unplanned = batch_of(lens, flags, kern.dev, planned=False)
    planned = batch_of(lens, flags, kern.dev, num_tokens=T, conv_width=width)
    for bias, act, batch in ((b, "silu", unplanned), (None, None, unplanned), (b, "silu", planned)):
        out, fin = ck.causal_conv1d(x, w, bias, batch, init, activation=act)
        out_r, fin_r = ref.causal_conv1d(x, w, bias, unplanned, init, activation=act)
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
    launched = record_conv_launches(monkeypatch)
    unplanned, batch = batch_of(lens, flags, kern.dev, planned=False), batch_of(lens, flags, kern.dev)
    plan = batch.plan
    assert plan.conv[W - 1].tok_row is None, "prompts that can be read in place: no extended rows built up front"
    out_r, fin_r = ref.causal_conv1d(x, w, b, unplanned, None, activation="silu")
    for kw in (dict(batch=unplanned), dict(batch=batch), dict(batch=batch, initial_states=init)):
        launched.clear()
        out, fin = ck.causal_conv1d(x, w, b, activation="silu", **kw)
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
    launched = record_conv_launches(monkeypatch)
    unplanned = batch_of(lens, flags, kern.dev, planned=False)
    out_r, fin_r = ref.causal_conv1d(x, w, b, unplanned, init, activation="silu")
    for batch in (unplanned, batch_of(lens, flags, kern.dev)):
        launched.clear()
        out, fin = ck.causal_conv1d(x, w, b, batch, init, activation="silu")
        assert_close(out, out_r, tol(kern, "conv", dtype), "out")
        assert torch.equal(fin.cpu(), fin_r.cpu()), "final conv states are copies of inputs: must be exact"
        yield list(launched), x.data_ptr()


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dims", list(CONV_DIMS))
def test_causal_conv1d_resumed_sequences(kern, dims, dtype, resume_path, monkeypatch):
    """Some sequences resume a saved state, every sequence has >= W-1 tokens. "singles" (and the shipped limit
    for these few): x is convolved in place as if all were fresh, then each resumed sequence's first W-1 outputs
    are recomputed from its state (one small launch each); "rows": the extended buffer. Both against the
    reference; unflagged states hold garbage."""
    lens = [3, 9, 4, 17] if dims == "tiny" else [3, 255, 256, 700]
    flags = [True, False, True, True]
    for launched, x_ptr in _conv_resumed_runs(kern, dims, dtype, lens, flags, 31, monkeypatch):
        if resume_path.name != "rows":
            assert launched[0] == x_ptr and len(launched) == 1 + sum(flags), launched
        else:
            assert len(launched) == 1 and launched[0] != x_ptr


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dims", list(CONV_DIMS))
def test_causal_conv1d_lone_first_resumed_sequence_is_read_in_place(kern, dims, dtype, monkeypatch):
    """One resumed sequence, first in the batch, all >= W-1 tokens: ONE launch reading x in place, the state
    through the kernel's own initial_states (no recompute). Against the reference; other states hold garbage."""
    lens = [5, 9, 17] if dims == "tiny" else [300, 255, 700]
    for launched, x_ptr in _conv_resumed_runs(kern, dims, dtype, lens, [True, False, False], 32, monkeypatch):
        assert launched == [x_ptr], launched


def test_causal_conv1d_fallback_dim_not_multiple_of_8(kern):
    g = gen(20)
    lens, Dm = [3, 9], 20
    x, w = rnd(g, 12, Dm).to(kern.dev), rnd(g, Dm, 4).to(kern.dev)
    batch = batch_of(lens, None, kern.dev, planned=False)
    out, fin = ck.causal_conv1d(x, w, None, batch)
    out_r, fin_r = ref.causal_conv1d(x, w, None, batch)
    assert torch.equal(out.cpu(), out_r.cpu()) and torch.equal(fin.cpu(), fin_r.cpu())



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


@pytest.mark.parametrize("dtypes", [(F32, F32), (BF16, BF16), (BF16, F32)], ids=["f32", "bf16", "bf16-x-f32-pool"])
@pytest.mark.parametrize("width", [2, 4])
def test_conv_update_several_tokens_per_row_in_one_call(kern, width, dtypes):
    """A verification step's rows of L tokens (views of the step's projection rows, row r's tokens r*L ..): one call
    gives each token's output and leaves the state after the last, as L one-token updates of the reference."""
    x_dtype, pool_dtype = dtypes
    Dm, K, L = CONV_DIMS["tiny"], width - 1, 4
    shape = (K, Dm, 2, 4, 8, pool_dtype, F32)
    raw, conv, _ = make_pools(16, *shape, kern.dev, seed=60 + width)
    conv_r, _, _, _ = pool_views(raw.clone(), *shape)
    g = gen(61)
    proj = rnd(g, len(SLOTS) * L, Dm + 11).to(kern.dev, x_dtype)
    x = proj[:, 3:3 + Dm].unflatten(0, (len(SLOTS), L))
    w, b = rnd(g, Dm, width, scale=0.5).to(kern.dev, x_dtype), rnd(g, Dm, scale=0.1).to(kern.dev, x_dtype)
    idx = torch.tensor(SLOTS, dtype=torch.int64, device=kern.dev)
    y = ck.conv_update(x, conv, w, b, idx, activation="silu")
    y_r = torch.stack([ref.conv_update(x[:, i], conv_r, w, b, idx, activation="silu") for i in range(L)], dim=1)
    assert y.shape == x.shape and y.dtype == x_dtype
    assert_close(y, y_r, tol(kern, "conv", x_dtype), "outputs")
    assert torch.equal(conv[idx].cpu(), conv_r[idx].cpu()), "the state after the last token"
