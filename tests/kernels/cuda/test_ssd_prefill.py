"""kernels/cuda/ssd_prefill.py against kernels.reference: every path of the packed SSD scan."""

from __future__ import annotations

import pytest
import torch

from cuda_helpers import kern, resume_path  # noqa: F401  (fixtures)
from cuda_helpers import (BF16, F32, SSD_CASES, assert_close, batch_of, case, cu_of, gen, garbage_states,
                          group_calls, record_chunk_state_varlen, rnd, ssd_inputs, tol)
from fakes import FAKE_KERNELS
from vllm_mamba2_plugin.kernels import cuda as ck
from vllm_mamba2_plugin.kernels import reference as ref
from vllm_mamba2_plugin.kernels.cuda import upstream, varlen_plan


@pytest.mark.parametrize("first", ["leads", "fresh"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(SSD_CASES))
def test_ssd_varlen_initial_states(kern, name, dtype, first, resume_path):
    """Several resumed sequences among fresh ones, in every grouping. A resumed first sequence takes the packed
    call's own initial state ("leads"), the others go as row groups ("fresh": all of them do)."""
    c = case(kern, name)
    cs = c.cs
    lens = [cs + 1, 1, 3 * cs + 5, max(1, cs - 1), cs]  # 1, chunk-1, chunk, chunk+1, 3*chunk+5, shuffled
    # init on a 1-token row and on long rows, garbage elsewhere
    flags = [True, True, False, True, False] if first == "leads" else [False, True, True, True, False]
    x, dt, A, B, C, D = ssd_inputs(c, lens, dtype, kern.dev, seed=1)
    h0 = garbage_states(gen(2), (len(lens), c.H, c.P, c.N), flags, kern.dev)
    cu, unplanned = cu_of(lens, kern.dev), batch_of(lens, flags, kern.dev, cs, planned=False)
    y_r, fin_r, _ = ref.ssd_chunk_scan(x, dt, A, B, C, unplanned, h0, D=D)
    # Without a plan (built inside from the batch's host bounds) and with the builder's plan.
    batch = batch_of(lens, flags, kern.dev, cs)
    plan = batch.plan
    for b_ in (unplanned, batch):
        y, fin, _ = ck.ssd_chunk_scan(x, dt, A, B, C, b_, h0, D=D)
        assert y.dtype == x.dtype and fin.dtype == F32 and fin.shape == fin_r.shape
        t = tol(kern, "ssd", dtype)
        assert_close(y, y_r, t, "y")
        assert_close(fin, fin_r, t, "final states")
        for s in range(len(lens)):  # per-sequence check: a large sequence must not hide a wrong short one
            a, b = int(cu[s]), int(cu[s + 1])
            assert_close(y[a:b], y_r[a:b], 2 * t, f"y of sequence {s} (len {lens[s]}, init {flags[s]})")
            assert_close(fin[s], fin_r[s], 2 * t, f"final state of sequence {s}")
    # one packed call per wrapper call, plus (singles) one per resumed sequence but a leading one, of exactly its
    # length, or (rows) one of rows as long as the longest of them, rounded up to 16
    resumed = [n for n, f in zip(lens, flags) if f]
    if first == "leads":
        resumed = resumed[1:]
    per_call = [sum(lens)] + {"singles": sorted(resumed, reverse=True), "rows": [-(-max(resumed) // 16) * 16],
                              "groups": group_calls(plan, lens)}[resume_path.name]
    assert group_calls(plan, lens) == per_call[1:]
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
    initial_states (no row group, whatever the grouping limits say), including the patched final
    state of a first sequence that ends in chunk 0 -- and the mixer's form of the call (raw dt, dt_bias, limit,
    state in the pool's dtype). Oracle: the reference; unflagged states hold garbage."""
    c = case(kern, name)
    lens, flags = _lone_first_layout(variant, c.cs)
    x, dt, A, B, C, D = ssd_inputs(c, lens, dtype, kern.dev, seed=11)
    h0 = garbage_states(gen(12), (len(lens), c.H, c.P, c.N), flags, kern.dev)
    unplanned, batch = batch_of(lens, flags, kern.dev, c.cs, planned=False), batch_of(lens, flags, kern.dev, c.cs)
    t = tol(kern, "ssd", dtype)
    y_r, fin_r, _ = ref.ssd_chunk_scan(x, dt, A, B, C, unplanned, h0, D=D)
    for b_ in (unplanned, batch):
        y, fin, _ = ck.ssd_chunk_scan(x, dt, A, B, C, b_, h0, D=D)
        assert_close(y, y_r, t, "y")
        for s in range(len(lens)):
            assert_close(fin[s], fin_r[s], 2 * t, f"final state of sequence {s} (len {lens[s]}, init {flags[s]})")
    # The mixer's call: raw dt + dt_bias + limit processed inside, final states in a bf16 pool's dtype.
    g = gen(13)
    raw = rnd(g, sum(lens), c.H, scale=2.0).to(kern.dev, dtype)
    dt_bias = torch.empty(c.H).uniform_(-3.0, 0.0, generator=g).to(kern.dev)
    limit = (0.01, 0.5)
    y_r2, fin_r2, _ = ref.ssd_chunk_scan(x, ref.process_dt(raw, dt_bias, limit), A, B, C, unplanned, h0, D=D)
    y2, fin2, _ = ck.ssd_chunk_scan(x, raw, A, B, C, batch, h0, D=D, dt_bias=dt_bias, dt_limit=limit,
                                    state_dtype=BF16)
    assert fin2.dtype == BF16
    assert_close(y2, y_r2, t, "y (raw dt)")
    for s in range(len(lens)):
        assert_close(fin2[s], fin_r2[s], 2 * tol(kern, "ssd", BF16), f"final state {s} (raw dt, bf16 pool)")
    assert resume_path.calls == [sum(lens)] * 3, resume_path.calls  # one packed call each, no row group


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
    launch). Outputs and final states against the reference, in every grouping of the resumed sequences; the
    unaligned control still asks for the varlen states."""
    c = case(kern, name)
    lens, flags = _aligned_layout(variant, c.cs)
    x, dt, A, B, C, D = ssd_inputs(c, lens, BF16, kern.dev, seed=21)
    h0 = garbage_states(gen(22), (len(lens), c.H, c.P, c.N), flags, kern.dev)
    cu = cu_of(lens, kern.dev)
    ns = upstream.kernels() if kern.name == "cuda" else FAKE_KERNELS
    varlen, inner = [], ns.ssd_fwd
    monkeypatch.setattr(ns, "ssd_fwd", lambda *a, **kw: (varlen.append("cu_seqlens" in kw), inner(*a, **kw))[1])
    batch = batch_of(lens, flags, kern.dev, c.cs)
    assert (batch.plan.final_chunks is None) == (variant == "unaligned")
    y_r, fin_r, _ = ref.ssd_chunk_scan(x, dt, A, B, C, batch, h0, D=D)
    y, fin, _ = ck.ssd_chunk_scan(x, dt, A, B, C, batch, h0, D=D, state_dtype=state_dtype)
    assert fin.dtype == state_dtype and fin.shape == fin_r.shape
    t = tol(kern, "ssd", BF16)
    assert_close(y, y_r, t, "y")
    for s in range(len(lens)):
        a, b = int(cu[s]), int(cu[s + 1])
        if b > a:
            assert_close(y[a:b], y_r[a:b], 2 * t, f"y of sequence {s} (len {lens[s]}, init {flags[s]})")
        assert_close(fin[s], fin_r[s], 2 * t, f"final state of sequence {s} (len {lens[s]}, init {flags[s]})")
    assert varlen[0] == (variant == "unaligned"), varlen  # the packed call; row groups never ask for varlen states


@pytest.mark.parametrize("variant", ["all-fresh", "all-resume", "empty-and-padding", "some-resume"])
def test_ssd_edge_cases(kern, variant, resume_path):
    c = case(kern, "tiny-g2")
    lens = {"empty-and-padding": [0, 5, 0, 17, 1]}.get(variant, [3, 16, 40, 1])
    pad = 7 if variant == "empty-and-padding" else 0
    x, dt, A, B, C, D = ssd_inputs(c, lens, F32, kern.dev, seed=3, pad=pad)
    S = len(lens)
    flags = [s % 2 == 0 for s in range(S)]
    h0 = garbage_states(gen(4), (S, c.H, c.P, c.N), flags, kern.dev)
    kw = dict(initial_states=h0, D=D)
    if variant == "all-fresh":
        flags, kw = [False] * S, dict(D=None)
    elif variant == "all-resume":
        flags, kw = [True] * S, dict(initial_states=torch.where(torch.isfinite(h0), h0, 0.0), D=D)
    batch = batch_of(lens, flags, kern.dev, c.cs, planned=False)
    y_r, fin_r, _ = ref.ssd_chunk_scan(x, dt, A, B, C, batch, **kw)
    init_before = None if kw.get("initial_states") is None else kw["initial_states"].clone()
    object.__setattr__(batch, "cu_seqlens", None)  # the device bounds are never read: no host sync
    y, fin, _ = ck.ssd_chunk_scan(x, dt, A, B, C, batch, **kw)
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
    softplus + clamp; processed on the host side for padded rows, whose padding must stay inert under the limit's
    positive lower bound), final states returned in the pool's dtype.
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
    cu, batch = cu_of(lens, kern.dev), batch_of(lens, flags, kern.dev, c.cs)
    y_r, fin_r, _ = ref.ssd_chunk_scan(x, ref.process_dt(raw, dt_bias, limit), A, B, C, batch, h0, D=D)
    y, fin, _ = ck.ssd_chunk_scan(x, raw, A, B, C, batch, h0, D=D, dt_bias=dt_bias, dt_limit=limit,
                                  state_dtype=state_dtype)
    assert y.dtype == BF16 and fin.dtype == state_dtype
    t = tol(kern, "ssd", BF16)
    assert_close(y, y_r, t, "y")
    assert_close(fin, fin_r, t, "final states")
    for s in range(len(lens)):
        a, b = int(cu[s]), int(cu[s + 1])
        assert_close(y[a:b], y_r[a:b], 2 * t, f"y of sequence {s} (len {lens[s]}, init {flags[s]})")


def _check_boundary_states(kern, c, lens, flags, offsets, dtype, seed, pad=0):
    """The wrapper's outputs, final states and states at ``offsets`` against the reference's (itself checked
    against the float64 recurrence, tests/kernels/test_reference.py), raw dt (softplus + dt_bias in the kernel),
    garbage in unflagged slots, ``pad`` padding tokens after the last sequence."""
    x, _, A, B, C, D = ssd_inputs(c, lens, dtype, kern.dev, seed=seed, pad=pad)
    g = gen(seed + 1)
    raw = rnd(g, x.shape[0], c.H).to(kern.dev, dtype)
    dt_bias = torch.empty(c.H).uniform_(-3.0, 0.0, generator=g).to(kern.dev)
    h0 = garbage_states(gen(seed + 2), (len(lens), c.H, c.P, c.N), flags, kern.dev)
    batch = batch_of(lens, flags, kern.dev, c.cs, num_tokens=x.shape[0], boundary_offsets=offsets)
    y_r, fin_r, at_r = ref.ssd_chunk_scan(x, raw, A, B, C, batch, h0, D=D, dt_bias=dt_bias)
    y, fin, at = ck.ssd_chunk_scan(x, raw, A, B, C, batch, h0, D=D, dt_bias=dt_bias)
    t = tol(kern, "ssd", dtype)
    assert at.shape == at_r.shape == (sum(map(len, offsets)), c.H, c.P, c.N) and at.dtype == F32
    if at.numel():
        assert_close(at, at_r, t, f"boundary states of {lens}, resumed {flags}, offsets {offsets}")
    assert_close(y, y_r, t, "y")
    assert_close(fin, fin_r, t, "final states")


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["tiny-g2", "real-g8"])
def test_ssd_boundary_states_for_prefix_caching(kern, name, dtype, resume_path):
    """boundary_offsets (prefix caching's block boundaries, per sequence): the states after those tokens, from the
    step's own calls (a fresh sequence's from the packed call, a resumed one's from its row group's call, an
    offset at a sequence's end its final state) or, inside a chunk of a row group's sequence, a second pass.
    Against the reference's; the outputs and final states are unchanged by asking."""
    c = case(kern, name)
    cs = c.cs
    # bf16: chunk multiples only; f32 also offsets inside a chunk and a sequence's last token
    aligned, mixed = [[cs, 2 * cs, 3 * cs], [], [cs, 2 * cs], []], [[cs, cs + 3, 3 * cs + 5], [3], [cs, 2 * cs], []]
    _check_boundary_states(kern, c, [3 * cs + 5, 7, 2 * cs, 1], [True, False, True, False],
                           aligned if dtype == BF16 else mixed, dtype, seed=8)


@pytest.mark.parametrize("empty", [True, False], ids=["with-empty", "all-non-empty"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["tiny-g2", "tiny-g8", "real-g8"])
def test_ssd_a_step_of_cache_hits_is_one_call_of_rows(kern, name, dtype, empty, monkeypatch):
    """A step in which every sequence resumes a state (prefix-cache hits: a suffix per request), with the
    wrappers' own limits: ONE SSD call of padded rows, no packed call; raw dt (softplus + dt_bias in the kernel,
    as the mixer runs it), an empty flagged sequence (keeps its state) and padding tokens after the last one.
    Against the reference, sequence by sequence."""
    c = case(kern, name)
    calls, _ = _count_calls(kern, monkeypatch)
    lens = [21, 30, 0, 25, 32, 17] if empty else [21, 30, 25, 32, 17]
    pad = 5
    x, dt_raw, A, B, C, D = ssd_inputs(c, lens, dtype, kern.dev, seed=11, pad=pad)
    dt_bias = rnd(gen(12), c.H, scale=0.5).to(kern.dev)
    flags = [True] * len(lens)
    h0 = garbage_states(gen(13), (len(lens), c.H, c.P, c.N), flags, kern.dev)
    cu, batch = cu_of(lens, kern.dev), batch_of(lens, flags, kern.dev, c.cs, num_tokens=x.shape[0])
    y_r, fin_r, _ = ref.ssd_chunk_scan(x, ref.process_dt(dt_raw, dt_bias), A, B, C, batch, h0, D=D)
    y, fin, _ = ck.ssd_chunk_scan(x, dt_raw, A, B, C, batch, h0, D=D, dt_bias=dt_bias)
    assert calls == [(5, 32)], calls  # five non-empty rows of 32 (the longest, a multiple of 16)
    assert batch.plan.whole_step  # the rows call's outputs and final states are the scan's as they come
    t = tol(kern, "ssd", dtype)
    for s in range(len(lens)):
        a, b = int(cu[s]), int(cu[s + 1])
        if b > a:
            assert_close(y[a:b], y_r[a:b], t, f"y of sequence {s} (len {lens[s]})")
        assert_close(fin[s], fin_r[s], t, f"final state of sequence {s} (len {lens[s]})")
    assert torch.equal(y[-pad:].float().cpu(), torch.zeros(pad, c.H, c.P)), "padding tokens must give y = 0"


@pytest.mark.parametrize("states", ["none", "unflagged-garbage"])
@pytest.mark.parametrize("name", ["tiny-g2", "real-g8"])
def test_ssd_boundary_states_of_fresh_prompts_come_from_the_packed_call(kern, name, states, monkeypatch):
    """A prefix-caching step of fresh prompts (a cache miss: each prompt's first tokens cross block boundaries):
    their boundary states come from the packed call's passed states and tokens, by ONE chunk_state_varlen launch
    (the last prompt's boundaries fall 8 tokens into chunks); a prompt ending on a boundary takes its final
    state. ONE SSD call, no second pass; with no initial states at all, or with garbage in unflagged slots.
    Against the reference."""
    c = case(kern, name)
    cs = c.cs
    calls, varlen = _count_calls(kern, monkeypatch)
    lens = [2 * cs + 5, cs, 3, 3 * cs]
    offsets = [[cs, 2 * cs], [cs], [], [cs, 2 * cs, 3 * cs]]
    x, _, A, B, C, D = ssd_inputs(c, lens, F32, kern.dev, seed=14)
    g = gen(15)
    raw = rnd(g, sum(lens), c.H).to(kern.dev)
    dt_bias = torch.empty(c.H).uniform_(-3.0, 0.0, generator=g).to(kern.dev)
    flags = [False] * len(lens)
    h0 = None if states == "none" else garbage_states(gen(16), (len(lens), c.H, c.P, c.N), flags, kern.dev)
    batch = batch_of(lens, flags, kern.dev, cs, planned=False, boundary_offsets=offsets)
    y_r, fin_r, at_r = ref.ssd_chunk_scan(x, raw, A, B, C, batch, h0, D=D, dt_bias=dt_bias)
    y, fin, at = ck.ssd_chunk_scan(x, raw, A, B, C, batch, h0, D=D, dt_bias=dt_bias)
    assert (sum(lens[:3]) + cs) % cs == 8  # the last prompt's boundaries fall inside chunks
    assert calls == [(1, sum(lens))] and varlen == [2 * 4], (calls, varlen)  # 4 inner offsets, as pairs
    t = tol(kern, "ssd", F32)
    assert at.shape == at_r.shape == (6, c.H, c.P, c.N)
    assert_close(at, at_r, t, "boundary states")
    assert_close(y, y_r, t, "y")
    assert_close(fin, fin_r, t, "final states")


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["tiny-g2", "real-g8"])
def test_ssd_boundary_states_of_a_continued_prompt_come_from_the_packed_call(kern, name, dtype, monkeypatch):
    """A prompt continued from its slot's state (the first sequence: the kernel's own initial state) whose step
    began inside a block (boundaries at 5, chunk + 5, ...: the first in chunk 0, from the initial state itself),
    and a fresh prompt after it: the packed call serves every boundary, by ONE chunk_state_varlen launch. ONE SSD
    call. Against the reference."""
    c = case(kern, name)
    cs = c.cs
    calls, varlen = _count_calls(kern, monkeypatch)
    _check_boundary_states(kern, c, [2 * cs + 5, cs + 4], [True, False], [[5, cs + 5, 2 * cs + 5], [cs]], dtype,
                           seed=17)
    assert calls == [(1, 3 * cs + 9)] and varlen == [2 * 3], (calls, varlen)  # the last offset: a final state


def _count_calls(kern, monkeypatch):
    """Lists that record each SSD forward's (batch, length) and each chunk_state_varlen's bounds count."""
    ns = upstream.kernels() if kern.name == "cuda" else FAKE_KERNELS
    calls, ssd = [], ns.ssd_fwd
    monkeypatch.setattr(ns, "ssd_fwd", lambda x, *a, **kw: (calls.append(tuple(x.shape[:2])), ssd(x, *a, **kw))[1])
    return calls, record_chunk_state_varlen(kern, monkeypatch)


def _random_prefix_caching_step(rng, cs):
    """A prefill block as prefix caching makes it: S sequences, each fresh or resuming after num_computed tokens
    (mostly a block boundary, sometimes inside a block), the boundaries of blocks of bs tokens it crosses as offsets
    (0 < o <= its length), now and then an empty sequence. Returns (lengths, resumed flags, offsets)."""
    bs = cs * rng.choice([1, 2])
    lens, flags, offsets = [], [], []
    for _ in range(rng.randint(1, 6)):
        resumed = rng.random() < 0.5
        computed = (rng.randint(1, 3) * bs + (rng.randint(1, bs - 1) if rng.random() < 0.3 else 0)) if resumed else 0
        n = 0 if rng.random() < 0.1 else rng.randint(1, 4 * bs)
        lens.append(n)
        flags.append(resumed)
        offsets.append([(b + 1) * bs - computed for b in range(computed // bs, (computed + n) // bs)])
    return lens, flags, offsets


@pytest.mark.parametrize("seed", range(12))
def test_ssd_boundary_states_of_random_prefix_caching_steps(kern, seed, resume_path):
    """Random prefix-caching blocks (fresh and resumed sequences, boundaries at and inside chunks, empty ones),
    through every resumed-sequence path: outputs, final states and the states at every boundary against the
    reference's."""
    import random

    c = case(kern, "tiny-g2")
    lens, flags, offsets = _random_prefix_caching_step(random.Random(seed), c.cs)
    _check_boundary_states(kern, c, lens, flags, offsets, F32, seed=20 + 3 * seed, pad=3)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["tiny-g2", "real-g8"])
def test_ssd_a_continued_prompt_leads_cache_hits(kern, name, dtype, monkeypatch):
    """A step of a serving mix, with the wrappers' own limits: a long prompt continued from a block boundary
    opens the block, then four cache hits' suffixes and two fresh prompts, each crossing block boundaries. All
    continued prompt takes the packed call's own initial state (which also gives its boundary states) and the
    hits go as the rows of one more call: two SSD calls, one chunk_state_varlen, no second pass.
    Against the reference."""
    c = case(kern, name)
    cs = c.cs
    calls, varlen = _count_calls(kern, monkeypatch)
    hits = [cs + 3, cs // 2 + 5, cs + 9, 7]
    lens = [5 * cs + 6] + hits + [2 * cs + 1, cs + 2]
    flags = [True] * 5 + [False] * 2
    offsets = [[cs * k for k in range(1, 6)]] + [[cs] if n >= cs else [] for n in hits] + [[cs, 2 * cs], [cs]]
    cu = torch.tensor([0] + lens).cumsum(0)
    plan = ck.plan_prefill(cu, torch.tensor(flags), sum(lens), cs, 4, kern.dev)
    assert plan.first_native and plan.path is varlen_plan.ResumePath.ROWS
    assert [g.seqs for g in plan.groups] == [[1, 2, 3, 4]] and not plan.whole_step
    _check_boundary_states(kern, c, lens, flags, offsets, dtype, seed=41)
    assert calls == [(1, sum(lens)), (4, -(-max(hits) // 16) * 16)], calls
    assert len(varlen) == 1


def test_boundary_plans_are_built_with_the_step_plan(kern):
    """plan_prefill given the step's boundary offsets plans their states with the step (the metadata builder's
    call); every layer's conv and scan with that offsets list use those plans and build nothing more."""
    c = case(kern, "tiny-g2")
    cs, lens, flags = c.cs, [2 * c.cs + 5, c.cs + 4, 3], [True, False, False]
    offsets = [[5, cs + 5], [cs], []]
    x, dt, A, B, C, D = ssd_inputs(c, lens, F32, kern.dev, seed=3)
    h0 = garbage_states(gen(4), (len(lens), c.H, c.P, c.N), flags, kern.dev)
    batch = batch_of(lens, flags, kern.dev, cs, boundary_offsets=offsets)
    plan = batch.plan
    first, conv_rows = plan.boundary, plan.conv_boundary[3]
    assert first.pairs is not None  # the fresh prompt's boundary, from the packed call
    xbc = torch.randn(sum(lens), 8, device=kern.dev)
    for _ in range(2):  # two layers
        ck.conv_states_at(xbc, 4, batch, torch.zeros(len(lens), 3, 8, device=kern.dev))
        ck.ssd_chunk_scan(x, dt, A, B, C, batch, h0, D=D)
    assert plan.boundary is first and plan.conv_boundary[3] is conv_rows


def test_packed_pairs_ask_for_each_boundary_from_its_own_chunk_state():
    """chunk_state_varlen's (start, end) per boundary of fresh prompts (chunk 16): start -1 for the first
    prompt's chunk 0 (the call's initial state), one token past the previous chunk's start when the prompt began
    before the boundary's chunk (its passed state is the prompt's own), the prompt's start when it began at that
    chunk's start. The discarded pairs in between (end_k, start_k+1) end at positions >= 1 and span one token
    each, but before a prompt that starts on a chunk start."""
    cs, lens = 16, [37, 55, 20, 20, 10]
    cu = torch.tensor([0] + lens).cumsum(0)
    plan = varlen_plan.build_plan(cu, torch.tensor([False] * 5), False, sum(lens), cs)
    offsets = [[16, 32], [16, 32, 48], [16], [16], [10]]  # the last prompt's offset is its end: its final state
    packed, pairs = varlen_plan._packed_pairs(plan, offsets, cs, set())
    assert pairs == [-1, 16, 1, 32, 33, 53, 49, 69, 65, 85, 81, 108, 112, 128]
    assert packed == {(0, 16): 0, (0, 32): 1, (1, 16): 2, (1, 32): 3, (1, 48): 4, (2, 16): 5, (3, 16): 6}
    spans = [e - (e - 1) // cs * cs for e in pairs[2::2]]  # tokens the kernel loops over for each odd pair
    assert min(pairs[2::2]) >= 1 and spans == [1, 1, 1, 1, 1, 16]
