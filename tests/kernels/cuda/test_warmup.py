"""kernels/cuda/warmup.py: the profile run's warm-ups drive every prefill path and decode launch, once per
layer signature, and leave nothing for serving steps to compile (GPU).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cuda_helpers import kern  # noqa: F401  (fixtures)
from cuda_helpers import BF16, F32, gen, record_chunk_state_varlen, record_conv_launches, rnd, _mixer_layer
from fakes import FAKE_KERNELS
from vllm_mamba2_plugin.kernels import cuda as ck
from vllm_mamba2_plugin.kernels import reference as ref
from vllm_mamba2_plugin.kernels.cuda import decode_step, upstream, varlen_plan, warmup


def _expected_ssd_calls(layouts, cs):
    """(batch-row length, given an initial state) of each SSD forward call the prefill wrappers make for these
    layouts (cuda.ssd_chunk_scan's dispatch): the packed call, in which a resumed first sequence rides the call's
    own initial state, then the row groups of the other resumed sequences (all of them, and no packed call, when
    every sequence resumes): longest first, a group takes the next one while its rows, padded to the longest
    rounded up to 16, stay within twice their tokens (each counted as at least 16) and 15 chunks; a group of one
    is called on its own tokens, more as padded rows."""
    def group_calls(ns):
        groups = []
        for n in sorted(ns, reverse=True):
            if groups:
                L, group = -(-groups[-1][0] // 16) * 16, groups[-1] + [n]
                if len(group) * L <= 2 * sum(max(m, 16) for m in group) and L <= 15 * cs:
                    groups[-1] = group
                    continue
            groups.append([n])
        return [(g[0] if len(g) == 1 else -(-g[0] // 16) * 16, True) for g in groups]

    calls = []
    for lengths, resumed in layouts:
        idx = [i for i, r in enumerate(resumed) if r]
        if len(idx) == len(lengths):
            calls += group_calls(lengths)
            continue
        lead = bool(idx) and idx[0] == 0
        calls.append((sum(lengths), lead))
        calls += group_calls([lengths[i] for i in (idx[1:] if lead else idx)])
    return calls


def _triton_classes(n: int) -> str:
    """Triton's specialisation of an integer argument: == 1, multiple of 16, other."""
    return "1" if n == 1 else "16" if n % 16 == 0 else "other"


@pytest.mark.parametrize("profile_tokens", [3, 165, 1100],
                         ids=["small-profile-run", "profile-run-over-2-chunks", "profile-run-over-15-chunks"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_prefill_warmup_runs_every_prefill_path_once(kern, dtype, profile_tokens, monkeypatch):
    """warmup.warm_prefill (profile run) drives the real prefill path through each of its branches:
    fresh prompts (one: final states from state passing; several with a boundary inside a chunk: the varlen
    final-state kernel), a sequence shorter than W-1 (extended conv buffer), a lone resumed sequence that opens
    the batch (the packed call's own initial state) ending inside chunk 0 or on a chunk boundary, up to
    resumed sequences after a fresh one (row groups: one on its own tokens, several as padded rows) and a step
    of resumed ones (row groups alone);
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
    monkeypatch.setattr(warmup, "_WARMED_PREFILL", set())
    ns = upstream.kernels() if kern.name == "cuda" else FAKE_KERNELS
    calls, real = [], ns.ssd_fwd
    monkeypatch.setattr(ns, "ssd_fwd", lambda x, *a, **kw: (calls.append((x.shape[1], kw.get("initial_states")
                                                                          is not None)), real(x, *a, **kw))[1])
    launched = record_conv_launches(monkeypatch)
    projected = torch.zeros(profile_tokens, layer.projection_width, device=kern.dev, dtype=dtype)

    warmup.warm_prefill(layer, projected)
    layouts = warmup.prefill_layouts(cs, profile_tokens)
    assert all(sum(lengths) <= max(profile_tokens, 4 * cs) for lengths, _ in layouts)  # small ones, or within budget
    assert calls == _expected_ssd_calls(layouts, cs)
    # The first call of each SSD call signature (packed without / with an initial state; a group of one: no
    # seq_idx) packs the whole budget: the autotuners decide on it. (Packed calls carry seq_idx, groups do not.)
    T = profile_tokens
    first = [(T, False), (T, True), (T, False), (T - 1, True)] if T > 2 * cs else []
    assert calls[:len(first)] == first
    if first:
        assert layouts[2][1] == [False, True]  # a group of one: a resumed sequence that is not the first
    # every (chunk-count class, length mod 16, path) of the first four paths, as a step can produce them
    multi_chunk = profile_tokens > cs  # a call can span chunks (a rows call: up to the budget rounded up to 16)
    chunk_classes = {"1"} | ({"other"} if multi_chunk else set()) | ({"16"} if profile_tokens >= 15 * cs + 32 else set())
    assert all(-(-sum(lengths) // cs) == 1 for lengths, _ in layouts) or multi_chunk  # no unreachable class
    seen = {(_triton_classes(-(-sum(lengths) // cs)), sum(lengths) % 16, tuple(resumed), len(lengths) == 1)
            for lengths, resumed in layouts[3 if first else 0:]}
    for c in chunk_classes:
        for r in (0, 8, 4, 2, 1):
            assert (c, r, (False,), True) in seen  # one fresh prompt
            assert (c, r, (False, False), False) in seen  # two, split inside a chunk
            assert (c, r, (True, False), False) in seen  # resumed first sequence
    assert any(lengths[0] % cs == 0 and resumed == [True, False]
               for lengths, resumed in layouts) == multi_chunk  # a resumed first sequence ending on a boundary
    assert ([1], [False]) in layouts and ([1], [True]) in layouts
    assert any(min(lengths) < W - 1 and not any(resumed) for lengths, resumed in layouts)  # extended conv buffer
    singles = [r for r in calls if r[1]]
    assert ({37, 48, 1} if multi_chunk else {5, 16, 1}) <= {t for t, _ in singles}  # groups of one
    assert any(not all(resumed) and sum(resumed) >= 2 for _, resumed in layouts)  # padded rows after a packed call
    rows = {(len(lengths), -(-max(lengths) // cs)) for lengths, resumed in layouts if sum(resumed) > 3}
    want = {(n, c) for n, c in ((4, 1), (16, 1), (4, 2), (16, 2)) if n // 2 * ((c - 1) * cs + 16) + n // 2 <= T}
    assert want <= rows  # rows calls of 4 and 16 rows (Triton classes), one and two chunks, where the budget allows
    n = len(calls)
    assert len(launched) >= 5
    warmup.warm_prefill(layer, projected)  # same signature: nothing runs again
    assert len(calls) == n
    monkeypatch.setattr(layer, "get_state_dtype", lambda: (dtype, BF16))  # another SSM state dtype: warms again
    warmup.warm_prefill(layer, projected)
    assert len(calls) == 2 * n


@pytest.mark.parametrize("profile_tokens", [165, 1100],
                         ids=["profile-run-over-2-chunks", "profile-run-over-16-chunks"])
def test_prefill_warmup_with_prefix_caching_runs_the_boundary_state_calls(kern, profile_tokens, monkeypatch):
    """With prefix caching the warm-up also runs the boundary-state calls (``warmup.boundary_layouts``): the packed
    call (length in Triton's classes, from zeros and with a first initial state) and chunk_state_varlen over its
    results; a resumed sequence's row group of one (without seq_idx, from its state) at chunk counts 1, 2 and
    (budget allowing) 16, and the padded rows of several resumed sequences (2 and 16 rows, budget allowing). Every boundary state goes to its own slot; without prefix caching
    none of it runs."""
    from vllm_mamba2_plugin import mixer as mixer_mod

    H, P, G, N, W, cs = 4, 8, 2, 16, 4, 32
    layer = _mixer_layer("warmpc.mixer", H, P, G, N, W, cs)
    with torch.no_grad():
        for _, p in layer.named_parameters():
            p.copy_(rnd(gen(93), *p.shape, scale=0.1))
        layer.A.copy_(-torch.rand(H, generator=gen(94)) - 0.5)
    layer = layer.to(kern.dev)
    monkeypatch.setattr(layer, "get_state_dtype", lambda: (F32, F32))
    monkeypatch.setattr(mixer_mod, "get_kernels", lambda dev: ck)
    monkeypatch.setattr(warmup, "_WARMED_PREFILL", set())
    ns = upstream.kernels() if kern.name == "cuda" else FAKE_KERNELS
    calls, real = [], ns.ssd_fwd

    def recorded(x, *a, **kw):  # (batch rows, length, without seq_idx, with initial states)
        calls.append((x.shape[0], x.shape[1], kw.get("seq_idx") is None, kw.get("initial_states") is not None))
        return real(x, *a, **kw)

    monkeypatch.setattr(ns, "ssd_fwd", recorded)
    varlen = record_chunk_state_varlen(kern, monkeypatch)
    projected = torch.zeros(profile_tokens, layer.projection_width, device=kern.dev, dtype=F32)
    warmup.warm_prefill(layer, projected)
    plain = list(calls)
    assert not varlen
    monkeypatch.setattr(layer, "prefix_caching", True)
    calls.clear()
    warmup.warm_prefill(layer, projected)  # another signature: warms again, with the boundary calls
    assert calls[:len(plain)] == plain
    extra = set(calls[len(plain):])
    packed = [c for c in (4, 16) if (c - 1) * cs + 17 <= profile_tokens]
    assert packed
    for c in packed:
        for residue in (0, 8, 4, 2, 1):
            T = (c - 1) * cs + 16 + residue
            if T <= profile_tokens:
                assert (1, T, False, False) in extra and (1, T, False, True) in extra  # the packed call
    assert varlen and set(varlen) == {4}  # two inner boundaries per packed layout: two (start, end) pairs
    for c in (1, 2, 16):
        if c * cs + 17 <= profile_tokens:
            assert (1, c * cs + 16, True, True) in extra  # a resumed sequence's group of one
    for n in (2, 16):
        for c in (1, 2):
            if n * (c * cs + 16) + 1 <= profile_tokens:
                assert (n, c * cs + 16, True, True) in extra  # padded rows from the sequences' states
    assert (16, cs + 16, True, True) in extra or profile_tokens < 16 * (cs + 16) + 1
    layouts = warmup.boundary_layouts(cs, profile_tokens)
    assert all(o % cs == 0 and o <= n for lengths, _, offsets in layouts for n, offs in zip(lengths, offsets)
               for o in offs)


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
@pytest.mark.parametrize("H, caching", [(24, False), (80, False), (80, True)],
                         ids=["130m", "2.7b", "2.7b-prefix-caching"])
def test_warmups_leave_nothing_to_compile_for_chunked_prefill_steps(H, caching, monkeypatch):
    """After the profile run's warm-ups (prefill and decode), the steps of serving compile no Triton kernel: a
    compile inside a step is a latency spike at a first request (vLLM's JIT monitor saw _state_passing_fwd_kernel
    compile at the first requests of 2.7b runs on the H200). Steps as vLLM's scheduler makes them
    at an 8 192-token budget (decode rows, a resumed chunk, fresh prompts, the last one cut), through the mixer's
    own decode / prefill / norm steps; with prefix caching, every sequence of a step starts on a block boundary and
    writes the state at each boundary it crosses. Triton's compile hook records every compile, warm-ups included,
    so a failure names the specialisation the warm-up missed next to the ones it compiled."""
    import random

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("mamba_ssm")
    pytest.importorskip("causal_conv1d")
    from triton import knobs

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
    monkeypatch.setattr(layer, "prefix_caching", caching)
    monkeypatch.setattr(warmup, "_WARMED_PREFILL", set())
    monkeypatch.setattr(warmup, "_WARMED_DECODE", set())
    compiles = []

    def hook(**kw):
        compiles.append((getattr(kw.get("fn"), "name", "?"), kw.get("repr", "?")))
        return None

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", hook)
    projected = torch.zeros(budget, layer.projection_width, device=dev, dtype=BF16)
    warmup.warm_prefill(layer, projected)
    warmup.warm_decode(layer, projected)
    warm, compiles[:] = list(compiles), []

    conv_pool, ssm_pool = layer.scratch_pools(320, dev)
    steps = [(0, [64, 64, 64, 64], [False] * 4), (0, [512], [False]), (0, [512] * 16, [False] * 16),
             (16, [512] * 15 + [496], [False] * 16), (33, [16] + [512] * 15 + [15], [True] + [False] * 16),
             (0, [64 + 7 * i for i in range(30)], [True] * 30),  # prefix-cache hits: many resumed suffixes
             (40, [100 + 5 * i for i in range(16)] + [512], [True] * 16 + [False]),
             (8, [200] * 5 + [1] * 40, [True] * 45)]  # long and 1-token resumed ones: two row groups
    steps += _chunked_prefill_steps(random.Random(0), budget, 40)
    if caching:  # a cache miss's fresh prompts, a hit whose suffix crosses a boundary, a long prompt's chunk
        steps += [(0, [1536, 2304, 2304, 2048], [True, False, False, False]), (0, [2049], [False]),
                  (12, [300, 80, 90], [True] * 3), (0, [4096, 4096], [True, False]), (0, [8192], [False])]
    missed = []
    for nd, lengths, resumed in steps:
        rows = torch.randn(nd + sum(lengths), projected.shape[-1], device=dev, dtype=BF16)
        if nd:
            layer.run_decode_rows(rows[:nd], torch.arange(1, nd + 1, device=dev), conv_pool, ssm_pool)
        offsets = [[cs * k for k in range(1, n // cs + 1)] for n in lengths] if caching else None
        layer.run_prefill_block(rows[nd:], lengths, resumed, conv_pool, ssm_pool, first_slot=nd + 1,
                                boundary_offsets=offsets)
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
    return {(decode_step.ssu_launch_config(b, H, P, N, state_dtype), _triton_classes(b)) for b in batches}


@pytest.mark.parametrize("state_dtype", [BF16, F32, torch.float64], ids=["bf16", "f32", "f64"])
@pytest.mark.parametrize("H, P, N", [(24, 64, 128), (80, 64, 128), (128, 64, 128), (48, 128, 128), (32, 128, 64),
                                     (48, 64, 64)], ids=["130m", "2.7b", "7b", "p128_n128", "p128_n64", "p64_n64"])
def test_ssu_warm_batches_reach_every_launch_the_table_can_pick(H, P, N, state_dtype):
    """The decode warm-up's batch sizes compile each (launch, batch specialisation) pair that a step of ANY
    batch size could need: checked against every batch size up to 4096 (brute force, not the formula)."""
    want = _ssu_specialisations(range(1, 4097), H, P, N, state_dtype)
    got = _ssu_specialisations(decode_step.ssu_warm_batches(H, P, N, state_dtype), H, P, N, state_dtype)
    assert got == want
    if state_dtype == F32 and (P, N) == (64, 128):  # the fp32 table's second tile (batch*heads >= 12288) is in
        assert (decode_step.SSU_LAUNCH_TABLE[(64, 128, 4)][-1][1], "other") in got


def test_decode_warmup_runs_the_warm_batches(kern, monkeypatch):
    """warmup.warm_decode (profile run) runs the decode step at every batch size of
    decode_step.ssu_warm_batches for its shape and pool dtype, once per layer signature; rows beyond the 16
    scratch slots reuse them. "fake": a two-tile table patched in for a tiny shape; "cuda": the 2.7b shape on
    fp32 pools, the real table and kernels (both tiles of the fp32 entry, batches up to 160 on 16 slots)."""
    from vllm_mamba2_plugin import mixer as mixer_mod

    fake = kern.name == "fake"
    H, P, G, N = (4, 8, 2, 16) if fake else (80, 64, 1, 128)
    layer = _mixer_layer("warmdec.mixer", H, P, G, N).to(kern.dev)
    monkeypatch.setattr(layer, "get_state_dtype", lambda: (F32, F32))
    monkeypatch.setattr(mixer_mod, "get_kernels", lambda dev: ck)
    monkeypatch.setattr(warmup, "_WARMED_DECODE", set())
    if fake:
        monkeypatch.setitem(decode_step.SSU_LAUNCH_TABLE, (P, N, 4), [(8, (4, 1)), (40, (8, 1))])
    seen, real = [], ck.ssm_state_update

    def recording(ssm_states, x, dt, A, B, C, state_indices, **kw):
        seen.append((x.shape[0], decode_step.ssu_launch_config(x.shape[0], H, P, N, ssm_states.dtype),
                     state_indices.min().item(), state_indices.max().item()))
        if not fake:
            return real(ssm_states, x, dt, A, B, C, state_indices, **kw)
        return ref.ssm_state_update(ssm_states, x, ref.process_dt(dt, kw.get("dt_bias")), A, B, C, state_indices,
                                    D=kw.get("D"))

    monkeypatch.setattr(ck, "ssm_state_update", recording)
    projected = torch.zeros(3, layer.projection_width, device=kern.dev)
    warmup.warm_decode(layer, projected)
    batches = decode_step.ssu_warm_batches(H, P, N, F32)
    # launch ranges start at batch 1, 2 (8 / H) and 10 (40 / H) with the patched table; 1 and 154 (12288 / 80)
    # with the real fp32 entry
    assert batches == ([1, 2, 3, 10, 11, 16] if fake else [1, 2, 16, 154, 155, 160])
    assert [b for b, *_ in seen] == batches
    # every launch any batch size could take ran (the patched table leaves batch 1 on upstream's: None)
    assert {c for _, c, *_ in seen} == {decode_step.ssu_launch_config(b, H, P, N, F32) for b in range(1, 4097)}
    assert all(1 <= lo and hi <= 16 for *_, lo, hi in seen)  # scratch slots 1..16, slot 0 never written
    warmup.warm_decode(layer, projected)  # same signature: nothing runs again
    assert len(seen) == len(batches)


def test_reference_kernels_on_cuda_skip_the_kernel_warmups(monkeypatch):
    """With VLLM_MAMBA2_PLUGIN_KERNELS=reference on a CUDA device there is nothing to compile: the profile run
    must not enter the warm-ups (they drive the CUDA wrappers' paths); with the default it does."""
    from vllm_mamba2_plugin import compat

    layer = _mixer_layer("warmref.mixer", H=4, P=8, G=1, N=16)
    monkeypatch.setattr(compat, "layer_metadata", lambda prefix: None)  # the profile run's forward context
    warmed = []
    monkeypatch.setattr(ck, "warm_up", lambda layer, p, decode_graphs: warmed.append(decode_graphs))
    projected = SimpleNamespace(is_cuda=True, device=torch.device("cuda"))  # stands in for a CUDA tensor
    out = torch.ones(2, 3)
    monkeypatch.setenv("VLLM_MAMBA2_PLUGIN_KERNELS", "reference")
    layer.conv_ssm_forward(projected, out)
    assert warmed == [] and torch.equal(out, torch.zeros(2, 3))
    monkeypatch.setenv("VLLM_MAMBA2_PLUGIN_KERNELS", "auto")
    layer.conv_ssm_forward(projected, out)
    assert warmed == [True]  # FULL decode graphs (the default): the decode kernels too
