"""kernels/cpu.py: vLLM's CPU decode ops against the reference (float32 and bfloat16, every grid shape), the
rows and dtypes that go to the reference instead, and that auto selection picks them on the CPU."""

import pytest
import torch

from vllm_mamba2_plugin import tiny_model
from vllm_mamba2_plugin.kernels import cpu, get_kernels, reference
from vllm_mamba2_plugin.kernels.interface import PrefillBatch

pytestmark = pytest.mark.skipif(not cpu.available(), reason="this vLLM has no CPU Mamba decode ops")

SHAPES = {name: (s.num_heads, s.head_dim, s.n_groups, s.state_size, s.conv_kernel)
          for name, s in tiny_model.GRID.items()}


def _inputs(H, P, G, N, W, dtype, state_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = H * P + 2 * G * N

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    slots = torch.tensor([5, 2, 9, 7])
    return dict(conv_pool=rnd(12, W - 1, D, dt=state_dtype), xc=rnd(4, D), w=rnd(D, W, scale=0.5), b=rnd(D),
                ssm_pool=rnd(12, H, P, N, scale=0.1, dt=state_dtype), x=rnd(4, H, P), dt=rnd(4, H),
                A=-torch.rand(H, generator=g) - 0.5, B=rnd(4, G, N), C=rnd(4, G, N), D=torch.randn(H, generator=g),
                dt_bias=torch.randn(H, generator=g), slots=slots)


def _run(mod, t, raw_dt: bool):
    conv_pool, ssm_pool = t["conv_pool"].clone(), t["ssm_pool"].clone()
    yc = mod.conv_update(t["xc"], conv_pool, t["w"], t["b"], t["slots"], "silu")
    dt = t["dt"] if raw_dt else reference.process_dt(t["dt"], t["dt_bias"], (0.0, 1.5)).to(t["x"].dtype)
    kw = dict(D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True) if raw_dt else dict(D=t["D"])
    ys = mod.ssm_state_update(ssm_pool, t["x"], dt, t["A"], t["B"], t["C"], t["slots"], **kw)
    return yc, conv_pool, ys, ssm_pool


def _close(a, b, tol):
    a, b = a.float(), b.float()
    assert float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max())), float((a - b).abs().max())


@pytest.mark.parametrize("raw_dt", [True, False], ids=["raw-dt", "processed-dt"])
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_the_decode_ops_match_the_reference_in_float32(shape, raw_dt):
    t = _inputs(*SHAPES[shape], torch.float32, torch.float32)
    for got, want in zip(_run(cpu, t, raw_dt), _run(reference, t, raw_dt)):
        _close(got, want, 1e-5)


def test_the_decode_ops_match_the_reference_in_bfloat16():
    """bf16 activations and pools: outputs and states within a bf16 rounding of the reference's."""
    t = _inputs(*SHAPES["n32g4"], torch.bfloat16, torch.bfloat16)
    for got, want in zip(_run(cpu, t, True), _run(reference, t, True)):
        _close(got, want, 2 ** -7)


def test_padding_rows_and_a_pool_of_another_dtype_go_to_the_reference(monkeypatch):
    """A negative slot (FULL CUDA graphs' padding) must give 0 and leave every slot alone, which the ops do not
    do; a conv pool of another dtype than x would be rounded to x's. Both run the reference's code."""
    called = []
    for name in ("conv_update", "ssm_state_update"):
        real = getattr(reference, name)
        monkeypatch.setattr(reference, name, lambda *a, _r=real, _n=name, **k: (called.append(_n), _r(*a, **k))[1])
    t = _inputs(*SHAPES["n32g4"], torch.float32, torch.float32)
    t["slots"] = torch.tensor([5, -1, 9, 7])
    yc, _, ys, _ = _run(cpu, t, True)
    assert called == ["conv_update", "ssm_state_update"] and not yc[1].any() and not ys[1].any()
    called.clear()
    t = _inputs(*SHAPES["n32g4"], torch.bfloat16, torch.float32)
    _run(cpu, t, True)
    assert called == ["conv_update"]


def test_the_cached_parameter_broadcasts_see_parameters_loaded_in_place():
    """A layer's broadcasts of A, D and dt_bias are made once and reused by later calls; parameters loaded in
    place, and slots written in place (a padding row the second time), must still give the reference's result."""
    t = _inputs(*SHAPES["n32g4"], torch.float32, torch.float32)
    for _ in range(2):
        for got, want in zip(_run(cpu, t, True), _run(reference, t, True)):
            _close(got, want, 1e-5)
        t["slots"].copy_(torch.tensor([1, -1, 3, 11]))  # now a padding row: the reference's path
        t["A"].mul_(0.5)
        t["dt_bias"].add_(0.25)
        for got, want in zip(_run(cpu, t, True), _run(reference, t, True)):
            _close(got, want, 1e-5)
        t["slots"].copy_(torch.tensor([0, 4, 6, 8]))


def test_the_cached_broadcasts_go_with_their_parameter():
    """The broadcasts are kept on A itself: a layer's parameters, once dropped, are collected with them."""
    import gc
    import weakref

    t = _inputs(*SHAPES["n32g4"], torch.float32, torch.float32)
    _run(cpu, t, True)
    assert cpu._head_views(t["A"], t["D"], t["dt_bias"], t["x"].shape[-1], t["B"].shape[-1]) is \
        t["A"]._mamba2_cpu_views[-1]  # made once, reused
    gone = weakref.ref(t["A"])
    del t
    gc.collect()
    assert gone() is None


def test_auto_selection_picks_the_cpu_ops_and_the_switch_the_reference(monkeypatch):
    monkeypatch.delenv("VLLM_MAMBA2_PLUGIN_KERNELS", raising=False)
    assert get_kernels(torch.device("cpu")) is cpu
    monkeypatch.setenv("VLLM_MAMBA2_PLUGIN_KERNELS", "reference")
    assert get_kernels(torch.device("cpu")) is reference


def _scan_inputs(H, P, G, N, dtype, chunk_size=64, boundary_offsets=None, seed=1):
    """A packed prefill: sequences of 3, 100, 0, 70 and 1 tokens (the empty one keeps its state), 4 padding
    tokens after them; x, B, C views of one projection, as the mixer hands them over."""
    g = torch.Generator().manual_seed(seed)
    lens = [3, 100, 0, 70, 1]
    cu = torch.tensor([0] + lens).cumsum(0)
    T = int(cu[-1]) + 4
    proj = torch.randn(T, H * P + 2 * G * N, generator=g).to(dtype)
    x, Bm, Cm = proj.split([H * P, G * N, G * N], dim=1)
    return dict(x=x.view(T, H, P), dt=torch.randn(T, H, generator=g).to(dtype), A=-torch.rand(H, generator=g) - 0.5,
                B=Bm.view(T, G, N), C=Cm.view(T, G, N),
                batch=PrefillBatch.of(cu, [True, False, True, True, False], chunk_size,
                                      boundary_offsets=boundary_offsets),
                initial_states=torch.randn(len(lens), H, P, N, generator=g) * 0.1, D=torch.randn(H, generator=g),
                dt_bias=torch.randn(H, generator=g))


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_the_prefill_scan_matches_the_reference(shape):
    H, P, G, N, _ = SHAPES[shape]
    spec = tiny_model.GRID[shape]
    t = _scan_inputs(H, P, G, N, torch.float32, spec.chunk_size)
    before = t["initial_states"].clone()
    got = cpu.ssd_chunk_scan(**t, dt_limit=spec.time_step_limit)
    want = reference.ssd_chunk_scan(**t, dt_limit=spec.time_step_limit)
    for a, b in zip(got[:2], want[:2]):
        _close(a, b, 1e-5)
    assert got.boundary_states is None
    assert torch.equal(t["initial_states"], before) and not got.y[-4:].any()


def test_the_prefill_scan_in_bfloat16_and_prefix_caching_goes_to_the_reference(monkeypatch):
    t = _scan_inputs(*SHAPES["n32g4"][:4], torch.bfloat16)
    for a, b in zip(cpu.ssd_chunk_scan(**t, state_dtype=torch.bfloat16)[:2],
                    reference.ssd_chunk_scan(**t, state_dtype=torch.bfloat16)[:2]):
        _close(a, b, 2 ** -6)
    called = []
    real = reference.ssd_chunk_scan
    monkeypatch.setattr(reference, "ssd_chunk_scan", lambda *a, **k: (called.append(1), real(*a, **k))[1])
    t = _scan_inputs(*SHAPES["n32g4"][:4], torch.bfloat16, boundary_offsets=[[], [64], [], [], []])
    y, fin, states = cpu.ssd_chunk_scan(**t)
    assert called and states.shape[0] == 1


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_the_prefill_conv_matches_the_reference(shape, dtype, tol):
    """Sequences empty, shorter than the conv state, and longer; with and without a state; padding after them."""
    H, P, G, N, W = SHAPES[shape]
    D, g = H * P + 2 * G * N, torch.Generator().manual_seed(3)
    lens = [3, 0, 1, W - 2, 70]
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
    x = torch.randn(int(cu[-1]) + 4, D, generator=g).to(dtype)
    init = torch.randn(len(lens), W - 1, D, generator=g).to(dtype)
    has = torch.tensor([True, True, False, True, False])
    w, b = (torch.randn(D, W, generator=g) * 0.5).to(dtype), torch.randn(D, generator=g).to(dtype)
    batch = PrefillBatch.of(cu, has)
    for bias, act in ((b, "silu"), (None, None)):
        got = cpu.causal_conv1d(x, w, bias, batch, init, act)
        want = reference.causal_conv1d(x, w, bias, batch, init, act)
        for a, e in zip(got, want):
            assert a.dtype == e.dtype and a.shape == e.shape
            _close(a, e, tol)
        assert not got[0][int(cu[-1]):].any()  # padding tokens stay 0
    fresh = PrefillBatch.of(cu)  # no states: zeros
    _close(cpu.causal_conv1d(x, w, b, fresh).final_states, reference.causal_conv1d(x, w, b, fresh).final_states, 0)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_the_gated_norm_matches_the_reference(shape, dtype, tol):
    """One group and several, with and without the gate, into a new tensor and into ``out``."""
    H, P, G, _, _ = SHAPES[shape]
    d, g = H * P, torch.Generator().manual_seed(4)
    x, z = (torch.randn(2, 37, d, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    for group_size in {d, d // G}:
        for gate in (z, None):
            want = reference.gated_rms_norm(x, gate, w, 1e-5, group_size)
            got = cpu.gated_rms_norm(x, gate, w, 1e-5, group_size)
            assert got.dtype == want.dtype and got.shape == want.shape
            _close(got, want, tol)
            buf = torch.empty_like(x)
            assert cpu.gated_rms_norm(x, gate, w, 1e-5, group_size, out=buf) is buf
            _close(buf, want, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_conv_op_runs_several_tokens_per_row_as_one_token_steps(dtype):
    """x (B, L, D), a verification step's rows (strided views): outputs and the state after the last token equal
    L one-token updates of the reference."""
    t = _inputs(*SHAPES["n32g4"], dtype, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * 3, t["xc"].shape[1] + 5, generator=g).to(dtype)[:, 5:].unflatten(0, (4, 3))
    pool, pool_r = t["conv_pool"].clone(), t["conv_pool"].clone()
    y = cpu.conv_update(x, pool, t["w"], t["b"], t["slots"], "silu")
    y_r = torch.stack([reference.conv_update(x[:, i], pool_r, t["w"], t["b"], t["slots"], "silu") for i in range(3)], 1)
    _close(y, y_r, 1e-5 if dtype == torch.float32 else 2 ** -7)
    assert torch.equal(pool, pool_r)
