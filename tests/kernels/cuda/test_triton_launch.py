"""kernels/cuda/triton_launch.py: FastLaunch / FastHeuristics launch exactly what Triton's Autotuner.run /
Heuristics.run launch.

CPU tests drive a real ``triton.runtime.autotuner.Autotuner`` / ``Heuristics`` (the installed Triton) around a
recording stand-in for the JIT function, with the autotuner's benchmark replaced by fixed timings (no GPU needed):
the oracle is Triton's own ``run``. The GPU test runs mamba-ssm's SSD forward, state update and gated norm on the
H200 through both launch paths and compares the outputs bit for bit.
"""

import sys
import types
from unittest import mock

import pytest
import torch

from vllm_mamba2_plugin.kernels.cuda import triton_launch as tl

triton = pytest.importorskip("triton")
import triton.language as tlang  # noqa: E402
from triton.runtime.autotuner import Autotuner, Heuristics  # noqa: E402


def _kernel_fn(x_ptr, y_ptr, n, chunk_size, hdim, HAS_Y, BLOCK_SIZE_M):  # the "source" the autotuner wraps
    pass


class RecordingJIT:
    """What Autotuner.run calls (``fn.run``), recording each launch's arguments."""

    def __init__(self):
        self.fn = _kernel_fn
        self.arg_names = ["x_ptr", "y_ptr", "n", "chunk_size", "hdim", "HAS_Y", "BLOCK_SIZE_M"]
        self.launches = []

    def run(self, *args, **kwargs):
        self.launches.append((args, kwargs))
        return "launched"


def make_tuner(configs, timings=None):
    jit = RecordingJIT()
    tuner = Autotuner(jit, jit.arg_names, configs, key=["chunk_size", "hdim"], reset_to_zero=None,
                      restore_value=None)
    tuner.cache_results = False
    timings = timings or {}
    tuner._bench = lambda *a, config, **kw: [timings.get(config.kwargs["BLOCK_SIZE_M"], 1.0)]
    return tuner, jit


CONFIGS = lambda: [triton.Config({"BLOCK_SIZE_M": 32}, num_warps=2, num_stages=5),  # noqa: E731
                   triton.Config({"BLOCK_SIZE_M": 64}, num_warps=4, num_stages=3)]


CALLS = {  # (args, kwargs) forms mamba-ssm's wrappers use: positional tensors, None, keyword constexprs
    "positional": lambda x, y: ((x, y, 100, 64, 32), {"HAS_Y": True}),
    "none-tensor": lambda x, y: ((x, None, 100, 64, 32), {"HAS_Y": False}),
    "key-as-keyword": lambda x, y: ((x, y, 100), {"chunk_size": 64, "hdim": 32, "HAS_Y": True}),
    "tensor-as-keyword": lambda x, y: ((x,), {"y_ptr": y, "n": 7, "chunk_size": 64, "hdim": 32, "HAS_Y": True}),
}


@pytest.mark.parametrize("form", list(CALLS))
def test_fast_launch_launches_what_the_autotuner_launches(form):
    x, y = torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.float32)
    args, kwargs = CALLS[form](x, y)
    tuner, jit = make_tuner(CONFIGS(), timings={32: 2.0, 64: 1.0})
    tuner[(3,)](*args, **dict(kwargs))  # the oracle: Autotuner.run tunes (fake timings) and launches
    assert len(tuner.cache) == 1 and len(jit.launches) == 1
    fast = tl.FastLaunch(tuner)
    assert fast.key(args, dict(kwargs)) in tuner.cache  # the same key as Autotuner.run's
    assert fast[(3,)](*args, **dict(kwargs)) == "launched"
    assert (fast.fast, fast.slow) == (1, 0)
    (a0, k0), (a1, k1) = jit.launches
    assert a1 == a0 and k1 == k0 and k1["BLOCK_SIZE_M"] == 64 and k1["num_warps"] == 4 and k1["grid"] == (3,)
    assert tuner.best_config is tuner.cache[fast.key(args, dict(kwargs))]


def test_new_key_goes_through_the_autotuner_then_launches_fast():
    tuner, jit = make_tuner(CONFIGS(), timings={32: 1.0, 64: 2.0})
    fast = tl.FastLaunch(tuner)
    x, y = torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)
    for _ in range(3):
        fast[(1,)](x, y, 10, 64, 32, HAS_Y=True)
    assert (fast.fast, fast.slow, len(tuner.cache)) == (2, 1, 1)
    fast[(1,)](x.float(), y, 10, 64, 32, HAS_Y=True)  # another dtype: another key, tuned by the autotuner
    fast[(1,)](x, y, 10, 64, 64, HAS_Y=True)  # another hdim: likewise
    assert (fast.fast, fast.slow, len(tuner.cache)) == (2, 3, 3)
    assert all(k["BLOCK_SIZE_M"] == 32 for _, k in jit.launches)


def test_pre_hook_configs_and_single_configs():
    hooked = [triton.Config({"BLOCK_SIZE_M": 32}, pre_hook=lambda nargs: None),
              triton.Config({"BLOCK_SIZE_M": 64}, pre_hook=lambda nargs: None)]
    tuner, jit = make_tuner(hooked)
    fast = tl.FastLaunch(tuner)
    x = torch.zeros(2)
    for _ in range(2):
        fast[(1,)](x, x, 1, 64, 32, HAS_Y=True)
    assert (fast.fast, fast.slow) == (0, 2)  # a pre_hook is the autotuner's to run
    single, jit1 = make_tuner([triton.Config({"BLOCK_SIZE_M": 16}, num_warps=1)])
    fast1 = tl.FastLaunch(single)
    fast1[(1,)](x, x, 1, 64, 32, HAS_Y=True)
    single[(1,)](x, x, 1, 64, 32, HAS_Y=True)
    assert (fast1.fast, fast1.slow) == (1, 0) and jit1.launches[0] == jit1.launches[1]


def test_fast_launch_that_never_engages_warns_once(monkeypatch, caplog):
    """A FastLaunch whose key never finds the autotuner's choice (a Triton whose Autotuner.run keys calls
    differently) would only make prefill slower: after NEVER_ENGAGED_AFTER misses it says so, once."""
    monkeypatch.setattr(tl, "NEVER_ENGAGED_AFTER", 3)
    tuner, _ = make_tuner(CONFIGS())
    fast = tl.FastLaunch(tuner)
    monkeypatch.setattr(fast, "key", lambda args, kwargs: ("not", "Triton's key"))
    x = torch.zeros(2)
    with caplog.at_level("WARNING"):
        for _ in range(6):
            fast[(1,)](x, x, 1, 64, 32, HAS_Y=True)
    warned = [r.getMessage() for r in caplog.records if "has not engaged" in r.getMessage()]
    assert (fast.fast, fast.misses) == (0, 6) and len(warned) == 1
    assert "fast launch of _kernel_fn" in warned[0] and "VLLM_MAMBA2_PLUGIN_FAST_LAUNCH=0" in warned[0]
    caplog.clear()
    monkeypatch.setattr(tl, "NEVER_ENGAGED_AFTER", 4)
    healthy, _ = make_tuner(CONFIGS())  # the usual case: the first call of each key tunes, the next ones hit
    fast = tl.FastLaunch(healthy)
    with caplog.at_level("WARNING"):
        for n in range(6):
            fast[(1,)](x, x, 1, 64, 32 * (1 + n % 3), HAS_Y=True)
    assert (fast.fast, fast.misses) == (3, 3) and not caplog.records


def test_install_leaves_the_launch_patches_off_outside_the_verified_range(fake_mamba, monkeypatch, caplog):
    """Inside TESTED_TRITON the call sites get FastLaunch / FastHeuristics; outside it they keep (or get back)
    Triton's own objects, with one warning."""
    monkeypatch.setattr(tl, "_deterministic_pins_configs", lambda: False)
    for version, patched in (("3.6.0", True), ("3.10.0", False), ("3.9.1", True), ("3.5.0", False)):
        monkeypatch.setattr(triton, "__version__", version)
        caplog.clear()
        with caplog.at_level("WARNING"):
            out = tl.install()
        assert out and all(isinstance(o, (tl.FastLaunch, tl.FastHeuristics)) == patched for o in out.values()), version
        assert any("outside the range" in r.getMessage() for r in caplog.records) != patched, version


def make_heuristics_stack():
    """Three stacked heuristics, the inner ones reading what the outer ones set (as Triton passes them on)."""
    jit = RecordingJIT()
    names = jit.arg_names
    h = Heuristics(jit, names, {"BLOCK_SIZE_M": lambda a: triton.next_power_of_2(a["n"]) * (2 if a["HAS_Y"] else 1)})
    h = Heuristics(h, names, {"HAS_Y": lambda a: a["y_ptr"] is not None})
    h = Heuristics(h, names, {"hdim": lambda a: a["chunk_size"] // 2})
    return h, jit


@pytest.mark.parametrize("with_y", [True, False])
def test_fast_heuristics_launch_what_the_stack_launches(with_y):
    x = torch.zeros(3)
    stack, jit = make_heuristics_stack()
    fast = tl.FastHeuristics(stack)
    assert len(fast.layers) == 3 and fast.fn is jit
    for n in (5, 16, 33):
        args = (x, x if with_y else None, n, 64)
        stack[(2, 1)](*args, num_warps=2)
        fast[(2, 1)](*args, num_warps=2)
        (a0, k0), (a1, k1) = jit.launches[-2:]
        assert a1 == a0 and k1 == k0, (k0, k1)
        assert k1["hdim"] == 32 and k1["HAS_Y"] is with_y and k1["grid"] == (2, 1)
        assert k1["BLOCK_SIZE_M"] == triton.next_power_of_2(n) * (2 if with_y else 1)
    assert fast.fast == 3


@triton.jit
def _toy_kernel(x_ptr, y_ptr, n, stride, scale, HAS_Y: tlang.constexpr, BLOCK: tlang.constexpr, extra=3):
    pass


class FakeCompiled:
    """What JITFunction.run returns: a compiled kernel whose launcher records its arguments."""

    def __init__(self, launches):
        self.function, self.packed_metadata = "function", "packed"
        self.run = lambda *a: launches.append(a)


@pytest.fixture
def direct(monkeypatch):
    """A DirectLaunch of a real (local Triton) JITFunction whose own ``run`` is a recorder, on a fake driver."""
    fn = _toy_kernel
    jit_calls, launches = [], []

    def jit_run(*args, grid, warmup, **kwargs):  # stands in for JITFunction.run: compiles (here: records)
        jit_calls.append((args, kwargs))
        return FakeCompiled(launches)

    monkeypatch.setattr(fn, "run", jit_run, raising=False)
    d = tl.DirectLaunch(fn)
    d._driver = types.SimpleNamespace(active=types.SimpleNamespace(get_current_device=lambda: 0,
                                                                   get_current_stream=lambda dev: 777))
    return d, jit_calls, launches


def _bound_values(fn, args, kwargs):
    """The oracle for the launcher's arguments: Python's own binding of the kernel's signature, defaults applied
    (what JITFunction.run's binder returns as bound_args, minus compile options such as num_warps)."""
    import inspect

    params = {k: v for k, v in kwargs.items() if k in inspect.signature(fn.fn).parameters}
    b = inspect.signature(fn.fn).bind(*args, **params)
    b.apply_defaults()
    return tuple(b.arguments.values())


def test_direct_launch_passes_the_bound_arguments_after_one_jit_launch(direct):
    d, jit_calls, launches = direct
    x, y = torch.zeros(64), torch.zeros(64)
    kw = dict(HAS_Y=True, BLOCK=64, num_warps=4)
    assert isinstance(d.run((3,), (x, y, 100, 16, 0.5), dict(kw)), FakeCompiled)
    assert (len(jit_calls), len(launches), d.jit, d.direct) == (1, 0, 1, 0)
    x2, y2 = torch.ones(64), torch.ones(64)  # other tensors, same dtype and alignment; another float
    seen = {}
    grid = lambda meta: seen.update(meta) or (5, 2)  # noqa: E731
    d.run(grid, (x2, y2, 100, 16, 0.25), dict(kw))
    assert (len(jit_calls), d.direct) == (1, 1)
    (launch,) = launches
    assert launch[:9] == (5, 2, 1, 777, "function", "packed", None, None, None)
    want = _bound_values(d.fn, (x2, y2, 100, 16, 0.25), kw)
    assert len(launch[9:]) == len(want) == 8 and all(a is b for a, b in zip(launch[9:], want))
    assert list(seen) == [p.name for p in d.fn.params] and seen["extra"] == 3 and seen["BLOCK"] == 64
    d.run((1,), (x2,), dict(y_ptr=y2, n=7, stride=3, scale=1.0, extra=5, **kw))  # keywords: another call form
    d.run((1,), (x2,), dict(y_ptr=y2, n=7, stride=3, scale=1.0, extra=5, **kw))
    assert (len(jit_calls), d.direct) == (2, 2)
    assert launches[-1][9:] == _bound_values(d.fn, (x2,), dict(y_ptr=y2, n=7, stride=3, scale=1.0, extra=5, **kw))


def test_direct_launch_that_never_engages_warns_once(direct, monkeypatch, caplog):
    """A DirectLaunch whose every call goes through JITFunction.run (here: every call another specialisation,
    as with a key that never repeats) says so once after NEVER_ENGAGED_AFTER such launches."""
    d, _, launches = direct
    monkeypatch.setattr(tl, "NEVER_ENGAGED_AFTER", 4)
    x, y = torch.zeros(64), torch.zeros(64)
    with caplog.at_level("WARNING"):
        for n in range(8):
            d.run((1,), (x, y, 100 + n, 16, 0.5), dict(HAS_Y=True, BLOCK=64, num_warps=4))
    assert (d.jit, d.direct, len(launches)) == (8, 0, 0)
    assert len([r for r in caplog.records if "direct launch of" in r.getMessage()]) == 1


@pytest.mark.parametrize("change", ["n==1", "n%16", "n>int32", "n", "unaligned", "dtype", "none", "constexpr",
                                    "num_warps", "device"])
def test_direct_launch_goes_through_jit_for_a_new_specialisation(direct, change):
    """Whatever Triton specialises on (and integers by value, which is finer) makes a new key: the first launch
    of each goes through JITFunction.run, and the key's later launches are direct."""
    d, jit_calls, launches = direct
    x, y = torch.zeros(64), torch.zeros(64)
    base = dict(args=[x, y, 100, 16, 0.5], kw=dict(HAS_Y=True, BLOCK=64, num_warps=4))
    d.run((1,), tuple(base["args"]), dict(base["kw"]))
    d.run((1,), tuple(base["args"]), dict(base["kw"]))
    assert (len(jit_calls), d.direct) == (1, 1)
    a, kw = list(base["args"]), dict(base["kw"])
    if change == "n==1":
        a[2] = 1
    elif change == "n%16":
        a[2] = 96
    elif change == "n>int32":
        a[3] = 2 ** 31 + 4
    elif change == "n":
        a[2] = 101
    elif change == "unaligned":
        a[0] = torch.zeros(65)[1:]  # 4 bytes off a 16-byte boundary
    elif change == "dtype":
        a[1] = torch.zeros(64, dtype=torch.bfloat16)
    elif change == "none":
        a[1] = None
    elif change == "constexpr":
        kw["BLOCK"] = 128
    elif change == "num_warps":
        kw["num_warps"] = 8
    else:
        d._driver.active.get_current_device = lambda: 1
    d.run((1,), tuple(a), dict(kw))
    assert (len(jit_calls), d.direct) == (2, 1), change
    d.run((1,), tuple(a), dict(kw))  # and then that specialisation launches directly too
    assert (len(jit_calls), d.direct) == (2, 2), change


def test_direct_launch_cache_starts_over_when_full(direct, monkeypatch):
    d, jit_calls, launches = direct
    monkeypatch.setattr(tl, "DIRECT_CACHE_MAX", 3)
    x = torch.zeros(64)
    for n in (10, 11, 12, 10, 11, 12, 13, 10):
        d.run((1,), (x, x, n, 16, 0.5), dict(HAS_Y=True, BLOCK=64))
    assert (d.jit, d.direct) == (5, 3)  # 13 filled it past 3 keys: emptied, then 10 compiled (looked up) again
    assert len(d._kernels) == 2


def test_direct_launch_leaves_hooked_launches_and_other_argument_types_to_jit(direct):
    from triton import knobs

    d, jit_calls, launches = direct
    x = torch.zeros(64)
    call = lambda *extra: d.run((1,), (x, x, 100, 16, 0.5, *extra), dict(HAS_Y=True, BLOCK=64))  # noqa: E731
    call(), call()
    assert (len(jit_calls), d.direct) == (1, 1)
    hook = lambda *a: None  # noqa: E731
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            call()
        finally:
            chain.remove(hook)
        assert (len(jit_calls), d.direct) == (2, 1)  # a profiler's hook sees every launch
    call()
    assert d.direct == 2
    n = len(jit_calls)
    d.run((1,), (x, x, (1, 2), 16, 0.5), dict(HAS_Y=True, BLOCK=64))  # a tuple argument: Triton's to specialise
    d.run((1,), (x, x, (1, 2), 16, 0.5), dict(HAS_Y=True, BLOCK=64))
    assert len(jit_calls) == n + 2 and d.direct == 2


def test_direct_launch_only_where_jit_run_launches_as_mirrored(monkeypatch, caplog):
    """The installed Triton's JITFunction.run makes the launcher call DirectLaunch mirrors; a Triton whose run reads
    differently (here: the expected call changed) gets no DirectLaunch, with a warning, and launches through
    JITFunction.run."""
    from triton.runtime.jit import JITFunction

    assert tl._launches_as_mirrored(JITFunction)
    monkeypatch.setattr(tl, "_PROTOCOL", {})
    monkeypatch.setattr(tl, "_LAUNCH_CALL", tl._LAUNCH_CALL.replace("launch_metadata,", "launch_metadata,scratch,"))
    with caplog.at_level("WARNING", logger=tl.logger.name):
        assert tl._direct_for(_toy_kernel) is None
    assert "no direct launch for _toy_kernel" in caplog.text


@pytest.fixture
def fake_mamba(monkeypatch):
    """mamba-ssm's four SSD modules as stand-ins holding real Autotuners (mamba-ssm itself needs CUDA)."""
    mods = {}
    for mod_name, names in tl.FORWARD_KERNELS.items():
        m = types.ModuleType(mod_name)
        for n in names:
            setattr(m, n, make_tuner([triton.Config({"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32},
                                                    num_stages=5, num_warps=2),
                                      triton.Config({"BLOCK_SIZE_M": 32}, num_stages=3, num_warps=4)])[0])
        monkeypatch.setitem(sys.modules, mod_name, m)
        mods[mod_name] = m
    for mod_name, names in tl.HEURISTIC_KERNELS.items():
        m = types.ModuleType(mod_name)
        for n in names:
            setattr(m, n, make_heuristics_stack()[0])
        monkeypatch.setitem(sys.modules, mod_name, m)
        mods[mod_name] = m
    return mods


@pytest.mark.parametrize("pinned", [False, True], ids=["autotuned", "deterministic"])
def test_install_wraps_extends_and_is_idempotent(fake_mamba, pinned, monkeypatch):
    monkeypatch.setattr(tl, "_deterministic_pins_configs", lambda: pinned)
    scan = fake_mamba["mamba_ssm.ops.triton.ssd_chunk_scan"]
    before = {n: len(getattr(fake_mamba[m], n).configs) for m, names in tl.FORWARD_KERNELS.items() for n in names}
    for _ in range(2):
        placed = tl.install(fast_launch=True, extra_configs=True)
    assert set(placed) == {n for kernels in (tl.FORWARD_KERNELS, tl.HEURISTIC_KERNELS) for names in kernels.values()
                           for n in names}
    for mod_name, names in tl.HEURISTIC_KERNELS.items():
        for n in names:
            obj = getattr(fake_mamba[mod_name], n)
            assert isinstance(obj, tl.FastHeuristics) and isinstance(obj.kernel, Heuristics) and placed[n] is obj
    for m in (fake_mamba[name] for name in tl.FORWARD_KERNELS):
        for n in tl.FORWARD_KERNELS[m.__name__]:
            obj = getattr(m, n)
            assert isinstance(obj, tl.FastLaunch) and isinstance(obj.tuner, Autotuner)
            added = 0 if pinned else len(tl.EXTRA_CONFIGS.get(n, ()))
            assert len(obj.tuner.configs) == before[n] + added, n  # once, however often install runs
    if not pinned:
        got = {(c.kwargs["BLOCK_SIZE_M"], c.kwargs.get("BLOCK_SIZE_N"), c.kwargs.get("BLOCK_SIZE_K"), c.num_stages,
                c.num_warps) for c in scan._chunk_scan_fwd_kernel.configs}
        assert set(tl.EXTRA_CONFIGS["_chunk_scan_fwd_kernel"]) <= got


def test_install_switches(fake_mamba, monkeypatch):
    monkeypatch.setattr(tl, "_deterministic_pins_configs", lambda: False)
    tl.install(fast_launch=False, extra_configs=False)
    for m in (fake_mamba[name] for name in tl.FORWARD_KERNELS):
        for n in tl.FORWARD_KERNELS[m.__name__]:
            assert isinstance(getattr(m, n), Autotuner) and len(getattr(m, n).configs) == 2
    for mod_name, names in tl.HEURISTIC_KERNELS.items():
        assert all(isinstance(getattr(fake_mamba[mod_name], n), Heuristics) for n in names)


def test_triton_own_launch_puts_tritons_objects_back_for_the_block(fake_mamba, monkeypatch):
    monkeypatch.setattr(tl, "_deterministic_pins_configs", lambda: False)
    placed = tl.install()
    ns = types.SimpleNamespace(ssu_kernel=placed["_selective_scan_update_kernel"], other=1)
    sites = [(fake_mamba[m], n) for kernels in (tl.FORWARD_KERNELS, tl.HEURISTIC_KERNELS) for m, names in
             kernels.items() for n in names]
    with tl.triton_own_launch(ns):
        for m, n in sites:
            assert getattr(m, n) is tl.unwrap(placed[n]) and not isinstance(getattr(m, n),
                                                                           (tl.FastLaunch, tl.FastHeuristics))
        assert isinstance(ns.ssu_kernel, Heuristics) and ns.other == 1
    assert all(getattr(m, n) is placed[n] for m, n in sites)
    assert ns.ssu_kernel is placed["_selective_scan_update_kernel"]
    with pytest.raises(RuntimeError):  # restored on the way out of an exception too
        with tl.triton_own_launch():
            raise RuntimeError("x")
    assert all(getattr(m, n) is placed[n] for m, n in sites)


def test_deterministic_mode_is_mamba_ssms_own(monkeypatch):
    det = types.ModuleType("mamba_ssm.utils.determinism")
    det.autotune_configs = lambda configs: configs  # autotuned mode: the list itself
    monkeypatch.setitem(sys.modules, "mamba_ssm.utils.determinism", det)
    monkeypatch.setitem(sys.modules, "mamba_ssm.utils", types.ModuleType("mamba_ssm.utils"))
    monkeypatch.setitem(sys.modules, "mamba_ssm", types.ModuleType("mamba_ssm"))
    assert tl._deterministic_pins_configs() is False
    det.autotune_configs = lambda configs: configs[:1]  # deterministic mode: one config
    assert tl._deterministic_pins_configs() is True


@pytest.mark.gpu
def test_kernels_are_bitwise_the_same_through_both_launch_paths():
    """On the GPU, at the 2.7b layer shape: mamba-ssm's SSD forward (a packed varlen batch with an initial state),
    the state update (the plugin's tuned launch and mamba-ssm's wrapper) and the gated norm, through
    FastLaunch / FastHeuristics (whose launches after the first go straight to the compiled kernels: DirectLaunch)
    and through Triton's Autotuner / Heuristics and JITFunction.run. The same launches, so every output is
    bit-identical; after the first call every SSD launch is a fast one, after the second every launch a direct one."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("mamba_ssm")
    from vllm_mamba2_plugin.kernels import cuda as ck
    from vllm_mamba2_plugin.kernels.cuda import decode_step, upstream

    k = upstream.kernels()  # installs (the default switches)
    placed = tl.install()
    assert all(isinstance(v, (tl.FastLaunch, tl.FastHeuristics)) for v in placed.values()), placed
    assert k.ssu_kernel is placed["_selective_scan_update_kernel"]
    g = torch.Generator().manual_seed(0)
    H, P, N, T, cs, slots = 80, 64, 128, 1000, 256, 40
    dev = torch.device("cuda")
    bf = lambda *shape: torch.randn(*shape, generator=g).to(dev, torch.bfloat16)  # noqa: E731
    x, dt, B, C = bf(1, T, H, P), bf(1, T, H), bf(1, T, 1, N), bf(1, T, 1, N)
    A = -torch.rand(H, generator=g).to(dev) - 0.1
    D, dt_bias = torch.randn(H, generator=g).to(dev), torch.randn(H, generator=g).to(dev)
    h0 = torch.randn(1, H, P, N, generator=g).to(dev)
    cu = torch.tensor([0, 300, 301, 1000], dtype=torch.int32, device=dev)
    seq_idx = torch.repeat_interleave(torch.arange(3, device=dev), cu.diff()).to(torch.int32)[None]
    pool = bf(slots, H, P, N)
    idx = torch.tensor([3, 17, 5, 39, 0, 21, 8], device=dev)
    xd, dtd, Bd, Cd, z, w = bf(7, H, P), bf(7, H), bf(7, 1, N), bf(7, 1, N), bf(7, H * P), bf(H * P)

    def run():
        ssd = k.ssd_fwd(x, dt, A, B, C, cs, D=D, dt_bias=dt_bias, dt_softplus=True, initial_states=h0,
                        seq_idx=seq_idx, cu_seqlens=cu)
        states = pool.clone()
        y_tuned = ck.ssm_state_update(states, xd, dtd, A, Bd, Cd, idx, D=D, dt_bias=dt_bias, dt_softplus=True,
                                      launch=(16, 2))
        with mock.patch.dict(decode_step.SSU_LAUNCH_TABLE, clear=True):  # no table entry: mamba-ssm's own wrapper
            y_wrapper = ck.ssm_state_update(states, xd, dtd, A, Bd, Cd, idx, D=D, dt_bias=dt_bias,
                                            dt_softplus=True)
        yn = ck.gated_rms_norm(xd.reshape(7, H * P), z, w, 1e-5, group_size=H * P // 8)
        return [t for t in ssd if t is not None] + [states, y_tuned, y_wrapper, yn]

    # Every call site also launches through a DirectLaunch (the default), which this GPU's Triton supports.
    assert all(isinstance(v.direct, tl.DirectLaunch) for v in placed.values()), {n: v.direct for n, v in placed.items()}
    run()  # tunes any SSD key not tuned yet (through the autotuners, whose launches bypass the DirectLaunch)
    run()  # a key's first launch through a DirectLaunch goes through JITFunction.run, which hands back its kernel
    counts = {n: v.fast for n, v in placed.items()}
    slow_counts = {n: v.slow for n, v in placed.items() if isinstance(v, tl.FastLaunch)}
    direct_counts = {n: (v.direct.direct, v.direct.jit) for n, v in placed.items()}
    fast = run()
    assert all(placed[n].slow == c for n, c in slow_counts.items()), slow_counts
    assert all(v.fast > counts[n] for n, v in placed.items()), {n: (v.fast, counts[n]) for n, v in placed.items()}
    # The third run's launches are all direct ones: same specialisations as the second run's.
    now = {n: (v.direct.direct, v.direct.jit) for n, v in placed.items()}
    assert all(now[n][0] > c[0] and now[n][1] == c[1] for n, c in direct_counts.items()), (direct_counts, now)
    with tl.triton_own_launch(k):
        assert k.ssu_kernel is placed["_selective_scan_update_kernel"].kernel
        slow = run()
    assert k.ssu_kernel is placed["_selective_scan_update_kernel"]
    assert len(fast) == len(slow)
    for i, (a, b) in enumerate(zip(fast, slow)):
        assert torch.equal(a, b), f"output {i} differs between the launch paths"
