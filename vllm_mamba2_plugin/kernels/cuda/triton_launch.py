"""Patch list: mamba-ssm's Triton kernels launched without Triton's per-call work, over vLLM's SSD configs.

CUDA path only. ``install()`` runs once, from ``upstream.kernels()`` (at the first CUDA kernel call; never at
import). The kernels' code is untouched; what changes is how they are launched and which configs their
autotuners benchmark. Switches (envs.py): VLLM_MAMBA2_PLUGIN_FAST_LAUNCH=0 (patches 1-3 off),
VLLM_MAMBA2_PLUGIN_DIRECT_LAUNCH=0 (patch 3 off), VLLM_MAMBA2_PLUGIN_SSD_CONFIGS=upstream (patch 4 off).

**Verified versions**: Triton 3.6.0 with mamba-ssm 2.3.2.post1 on the H200 (torch 2.11+cu130; the kernels'
outputs are bit-identical through both launch paths: tests/kernels/cuda/test_triton_launch.py, gpu) and Triton
3.9.0 on the CPU (the same tests against Triton's own ``Autotuner.run`` / ``Heuristics.run`` and ``JITFunction``
source). The ``cuda`` extra pins ``triton<3.10``; on a Triton outside ``TESTED_TRITON`` ``install()`` leaves
patches 1-3 off (and says so).
Every patch checks what it reads of Triton and steps aside (Triton's own path, logged) where that differs, and
``FastLaunch`` / ``DirectLaunch`` warn if they never engage (``NEVER_ENGAGED_AFTER``): a changed key or
protocol would otherwise only make prefill silently slower.

1. **FastLaunch** -- replaces the ``Autotuner`` objects of mamba-ssm's SSD forward kernels at their call sites
   (the module globals of ``FORWARD_KERNELS``, which mamba-ssm's wrappers look up at call time).
   *Why*: every launch through ``Autotuner.run`` rebuilds the argument dicts (a list membership test per
   argument), the tuning key (``str(dtype)`` of every tensor) and the chosen config's kwargs, six launches per
   layer of every prefill step, and prefill steps are host-bound (benchmarks/RESULTS.md, "One prefill layer").
   *What*: the same key from precomputed argument positions, the autotuner's own choice for it
   (``Autotuner.cache``), and the JIT function called with that config as
   ``Autotuner.run`` calls it (triton 3.6 runtime/autotuner.py: ``self.fn.run(*args, **kwargs,
   **config.all_kwargs())`` after ``self.best_config = config``). The first call of a key (tuning, Triton's disk
   cache) and configs with a pre_hook still go through the autotuner.
   *Delete when*: Triton's autotuner launch costs a few µs (or mamba-ssm stops autotuning at every call).
2. **FastHeuristics** -- the same for the state-update and gated-norm kernels (``HEURISTIC_KERNELS``), stacks
   of ``@triton.heuristics``. *Why*: ``Heuristics.run`` builds one argument dict per stacked heuristic
   (five of ~45 entries per state-update launch), once per layer of every eager decode step and mixed step.
   *What*: the same heuristics, in the same order, on ONE dict. *Delete when*: as 1.
3. **DirectLaunch** -- under 1 and 2, launches the compiled kernel itself. *Why*: ``JITFunction.run`` binds and
   specialises every argument (~40 per SSD kernel) and builds its cache key (``str(options)``) on every call,
   ahead of each of a layer's six launches: a 2.7b prefill step spent more host time than GPU time
   (benchmarks/RESULTS.md, "One prefill layer" and "Resume paths and the launch bypass").
   *What*: each call is keyed on at least what Triton specialises on (every argument's type, each tensor's dtype
   and address modulo 16, the exact value of every integer, bool, constexpr and compile option, the device); after
   a first launch of a key through ``JITFunction.run`` (which compiles, or finds, the kernel) it calls that
   kernel's launcher with the arguments in the order ``JITFunction.run`` passes them (``_LAUNCH_CALL``: a Triton
   whose ``JITFunction.run`` does not make that call gets no DirectLaunch). Launch hooks (profilers such as
   proton), pre-run hooks and argument types it does not mirror go through ``JITFunction.run``. Integers keyed by
   value cost one ``JITFunction.run`` per new step shape and kernel, in the step's first layer.
   *Delete when*: Triton's ``JITFunction.run`` has a cheap path for repeated specialisations.
4. **EXTRA_CONFIGS** -- appends to mamba-ssm 2.3.2's autotune lists the configs of vLLM 0.26's copies of these
   kernels that they lack (12 for ``_chunk_scan_fwd_kernel``, 5 for ``_chunk_state_fwd_kernel``); the
   autotuner still keeps the fastest by its own measurement. *Why*: among them is the config vLLM's chunk scan
   picks on the H200 at the 2.7b shape ((64, 64, 32), 4 warps, 1 stage), faster there than mamba-ssm's choice
   (RESULTS.md, "One prefill layer"). Skipped in mamba-ssm's deterministic mode (MAMBA_DETERMINISTIC=1 with
   TRITON_CACHE_AUTOTUNING=0: vLLM sets it to 1 where unset), which pins one config per kernel on purpose.
   *Delete when*: mamba-ssm's lists contain them.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import operator
from collections.abc import Mapping
from typing import Dict, List, Tuple

logger = logging.getLogger(__name__)

# The SSD forward kernels that ssd_prefill.ssd_chunk_scan reaches through _mamba_chunk_scan_combined_fwd, by module.
FORWARD_KERNELS: Dict[str, Tuple[str, ...]] = {
    "mamba_ssm.ops.triton.ssd_chunk_state": ("_chunk_cumsum_fwd_kernel", "_chunk_state_fwd_kernel",
                                             "_chunk_state_varlen_kernel"),
    "mamba_ssm.ops.triton.ssd_state_passing": ("_state_passing_fwd_kernel",),
    "mamba_ssm.ops.triton.ssd_bmm": ("_bmm_chunk_fwd_kernel",),
    "mamba_ssm.ops.triton.ssd_chunk_scan": ("_chunk_scan_fwd_kernel",),
}

# Heuristics-only kernels (no autotuning) the plugin launches once per layer outside the SSD forward.
HEURISTIC_KERNELS: Dict[str, Tuple[str, ...]] = {
    "mamba_ssm.ops.triton.selective_state_update": ("_selective_scan_update_kernel",),
    "mamba_ssm.ops.triton.layernorm_gated": ("_layer_norm_fwd_1pass_kernel",),
}

# (BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, num_stages, num_warps): the configs of vLLM 0.26's copies
# (vllm/model_executor/layers/mamba/ops/ssd_chunk_scan.py:17-146, ssd_chunk_state.py:117-194) that mamba-ssm
# 2.3.2's lists (ssd_chunk_scan.py:32-46, ssd_chunk_state.py) do not have. M, N, K mean the same in both copies.
EXTRA_CONFIGS: Dict[str, List[Tuple[int, int, int, int, int]]] = {
    "_chunk_scan_fwd_kernel": [
        (32, 32, 32, 2, 8), (32, 64, 32, 2, 8), (64, 32, 32, 2, 8), (32, 32, 32, 3, 4), (32, 32, 64, 2, 4),
        (64, 64, 64, 1, 4), (64, 64, 32, 1, 4), (128, 64, 32, 1, 4), (32, 64, 32, 1, 4),
        (64, 64, 64, 2, 4), (64, 64, 32, 2, 4), (32, 64, 32, 2, 4),
    ],
    "_chunk_state_fwd_kernel": [
        (32, 32, 32, 3, 4), (32, 64, 32, 3, 4), (64, 32, 32, 3, 4), (64, 64, 64, 2, 4), (64, 128, 64, 2, 4),
    ],
}

# Triton (major, minor) versions these patches were verified with (module doc).
TESTED_TRITON = ((3, 6), (3, 9))
# A FastLaunch that has missed the autotuner's cache this many times without one fast launch, or a DirectLaunch
# that has gone through JITFunction.run this many times without one direct launch, warns once: its key or
# protocol no longer matches this Triton's (each miss is a new tuning key or specialisation; in a healthy
# process the same keys soon come back).
NEVER_ENGAGED_AFTER = 256

_DTYPE_STR: Dict[object, str] = {}

_UNSET = object()
_EMPTY = object()  # inspect.Parameter.empty, set by the first DirectLaunch (Triton and torch are imported lazily)
_TENSOR: type = object  # torch.Tensor, likewise
_NONE_TYPE = type(None)
# Kernels a DirectLaunch keeps per JIT function before it starts over: its key holds integer arguments exactly
# (sequence lengths, strides), so serving many step shapes makes many keys; each miss costs one JITFunction.run.
DIRECT_CACHE_MAX = 4096
# The launcher call DirectLaunch makes in JITFunction.run's place, as JITFunction.run makes it (whitespace removed;
# triton 3.6 and 3.9 runtime/jit.py). A Triton whose JITFunction.run reads differently gets no DirectLaunch: the
# compiled launcher takes its arguments by position, so a changed protocol would not fail loudly.
_LAUNCH_CALL = ("kernel.run(grid_0,grid_1,grid_2,stream,kernel.function,kernel.packed_metadata,launch_metadata,"
                "knobs.runtime.launch_enter_hook,knobs.runtime.launch_exit_hook,*bound_args.values())")
_PROTOCOL: Dict[type, bool] = {}


def _name(jit_fn) -> str:
    """A JIT function's kernel name (JITFunction copies its Python function's ``__name__``)."""
    return getattr(jit_fn, "__name__", None) or getattr(getattr(jit_fn, "fn", None), "__name__", repr(jit_fn))


def _warn_never_engaged(what: str, name: str, misses: int) -> None:
    import triton

    logger.warning("vllm_mamba2_plugin: the %s of %s has not engaged in %d launches (Triton %s; verified: %s): "
                   "its key or launch protocol does not match this Triton's, and prefill runs slower than it "
                   "should (results are unaffected). VLLM_MAMBA2_PLUGIN_FAST_LAUNCH=0 turns it off.", what, name,
                   misses, triton.__version__, ", ".join("%d.%d" % v for v in TESTED_TRITON))


def _launches_as_mirrored(jit_cls: type) -> bool:
    """Whether ``jit_cls.run`` (a JITFunction class) calls the compiled launcher as DirectLaunch does."""
    ok = _PROTOCOL.get(jit_cls)
    if ok is None:
        import inspect

        try:
            src = inspect.getsource(jit_cls.run)
        except (OSError, TypeError):  # no source shipped: nothing to check against
            src = ""
        ok = _PROTOCOL[jit_cls] = _LAUNCH_CALL in "".join(src.split())
    return ok


def _no_hook(hook) -> bool:
    """No launch hook set: None (older Triton) or an empty ``knobs.HookChain`` (newer; JITFunction.run then passes
    the empty chain, which the launcher calls to no effect, and passing None instead skips it)."""
    return hook is None or getattr(hook, "calls", None) == []


class _Meta(Mapping):
    """The grid function's view of a launch's arguments by name (what JITFunction.run hands it as ``bound_args``),
    read on demand: grid functions read two or three of some forty entries."""

    __slots__ = ("_index", "_values")

    def __init__(self, index: dict, values: tuple):
        self._index, self._values = index, values

    def __getitem__(self, name):
        return self._values[self._index[name]]

    def __iter__(self):
        return iter(self._index)

    def __len__(self):
        return len(self._index)


def _getter(idx: list):
    """seq -> tuple(seq[i] for i in idx), at C speed (itemgetter) for two or more indices."""
    if len(idx) > 1:
        return operator.itemgetter(*idx)
    return lambda seq, _i=tuple(idx): tuple(seq[i] for i in _i)


class _CallShape:
    """One form of call of a JIT function: which argument (positional or keyword) feeds each parameter, and which
    parts of the call its key reads. Built once per (argument count, keyword names, argument types)."""

    __slots__ = ("take", "names", "index", "tensors", "exact", "defaults", "ok")

    def __init__(self, params, nargs: int, kw_names: tuple, types: tuple):
        names = [p.name for p in params]
        pos = {n: i for i, n in enumerate(names)}
        self.ok = nargs <= len(names)  # more arguments than parameters: JITFunction.run raises; let it
        if not self.ok:
            return
        # merged = args + kwargs values (call order) + defaults: each parameter's value is merged[take[i]]
        kw_index = {n: nargs + j for j, n in enumerate(kw_names)}
        defaults, take = [], []
        for i, p in enumerate(params):
            if i < nargs:
                take.append(i)
            elif p.name in kw_index:
                take.append(kw_index[p.name])
            elif p.default is _EMPTY:
                self.ok = False  # a missing argument: JITFunction.run raises; let it
            else:
                take.append(nargs + len(kw_names) + len(defaults))
                defaults.append(p.default)
        self.names, self.index, self.defaults = names, pos, tuple(defaults)
        self.take = _getter(take)
        # What the key reads: tensors by (dtype, address mod 16); integers, bools, constexprs and compile options
        # (num_warps, ...) by value, which is finer than what Triton specialises on (integers: == 1, multiple of 16,
        # 32/64-bit); None and floats by their type alone (in the key already), as Triton does.
        tensors, exact = [], []
        for j, t in enumerate(types):
            name = names[j] if j < nargs else kw_names[j - nargs]
            param = params[pos[name]] if name in pos else None  # None: a compile option (num_warps, ...)
            if param is None or param.is_constexpr or t is int or t is bool:
                exact.append(j)
            elif t is _TENSOR:
                tensors.append(j)
            elif t is not _NONE_TYPE and t is not float:
                self.ok = False  # tuples, tensor descriptors, dtypes, ...: JITFunction.run's to specialise
        self.tensors = tuple(tensors)
        self.exact = _getter(exact)


class DirectLaunch:
    """Launches one Triton ``JITFunction``'s compiled kernels without ``JITFunction.run``'s per-call work (module
    doc). ``run(grid, args, kwargs)`` takes what ``fn.run(*args, grid=grid, warmup=False, **kwargs)`` takes and
    launches the same kernel with the same arguments. ``direct`` / ``jit`` count the two kinds of launches."""

    def __init__(self, fn):
        global _EMPTY, _TENSOR
        import inspect

        import torch
        from triton import knobs
        from triton.runtime.driver import driver

        _EMPTY, _TENSOR = inspect.Parameter.empty, torch.Tensor
        # What it reads of Triton's internals; a Triton without them gets no DirectLaunch (install() logs it).
        for obj, attr in ((fn, "params"), (fn, "pre_run_hooks"), (fn, "used_global_vals"), (fn, "run"),
                          (knobs.runtime, "launch_enter_hook"), (knobs.runtime, "launch_exit_hook")):
            if not hasattr(obj, attr):
                raise AttributeError(f"{type(obj).__name__} has no {attr!r}")
        if not _launches_as_mirrored(type(fn)):
            raise RuntimeError(f"{type(fn).__name__}.run does not launch with the call DirectLaunch mirrors")
        self.fn = fn
        self.params = list(fn.params)
        self._knobs = knobs.runtime
        self._driver = driver
        self._shapes: Dict[tuple, _CallShape] = {}
        self._kernels: Dict[tuple, tuple] = {}
        self.direct = 0
        self.jit = 0

    def _jit(self, grid, args, kwargs):
        self.jit += 1
        if self.jit == NEVER_ENGAGED_AFTER and self.direct == 0:
            _warn_never_engaged("direct launch", _name(self.fn), self.jit)
        return self.fn.run(*args, grid=grid, warmup=False, **kwargs)

    def run(self, grid, args: tuple, kwargs: dict):
        fn, rt = self.fn, self._knobs
        if fn.pre_run_hooks or not (_no_hook(rt.launch_enter_hook) and _no_hook(rt.launch_exit_hook)):
            return self._jit(grid, args, kwargs)
        merged = args + tuple(kwargs.values())
        types = tuple(map(type, merged))
        skey = (len(args), tuple(kwargs), types)
        shape = self._shapes.get(skey)
        if shape is None:
            norm = tuple(_TENSOR if issubclass(t, _TENSOR) else t for t in types)
            shape = self._shapes[skey] = _CallShape(self.params, len(args), tuple(kwargs), norm)
        if not shape.ok:
            return self._jit(grid, args, kwargs)
        drv = self._driver.active
        device = drv.get_current_device()
        key = (skey, device, tuple([(merged[j].dtype, merged[j].data_ptr() & 15) for j in shape.tensors]),
               shape.exact(merged))
        try:
            hit = self._kernels.get(key)
        except TypeError:  # an unhashable constexpr: JITFunction.run's to handle
            return self._jit(grid, args, kwargs)
        if hit is None:
            kernel = self._jit(grid, args, kwargs)
            if hasattr(kernel, "result"):  # an asynchronous compile's future
                kernel = kernel.result()
            if all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
                if len(self._kernels) >= DIRECT_CACHE_MAX:
                    self._kernels.clear()
                # CompiledKernel.run is its launcher (initialised at its first launch, just now).
                self._kernels[key] = (kernel.run, kernel.function, kernel.packed_metadata, kernel)
            return kernel
        c_run, function, packed, kernel = hit
        if fn.used_global_vals:  # as JITFunction.run: a global a kernel read must not have changed since
            for (name, _), (val, globals_dict) in fn.used_global_vals.items():
                if globals_dict.get(name, _UNSET) != val:
                    return self._jit(grid, args, kwargs)
        values = shape.take(merged + shape.defaults if shape.defaults else merged)
        if callable(grid):
            grid = grid(_Meta(shape.index, values))
        n = len(grid)
        c_run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, drv.get_current_stream(device), function,
              packed, None, None, None, *values)
        self.direct += 1
        return kernel


class FastLaunch:
    """Stands in for one ``triton.runtime.autotuner.Autotuner`` at its call sites: ``kernel[grid](*args, **kw)``.

    Launches with the autotuner's cached choice for the call's key when there is one, else through the autotuner.
    ``fast`` / ``slow`` count the two kinds of launches (for tests and benchmarks)."""

    def __init__(self, tuner):
        self.tuner = tuner
        names = list(tuner.arg_names)
        self._pos = {name: i for i, name in reversed(list(enumerate(names)))}  # first position, as list.index
        self._nnames = len(names)
        # Autotuner.run: key = [_args[k] for k in self.keys if k in _args], _args = {**nargs, **kwargs} filtered
        # to arg_names, nargs = dict(zip(arg_names, args)); then str(arg.dtype) of every arg of _args, in order.
        self._key_pos = [(k, self._pos[k]) for k in tuner.keys if k in self._pos]
        self._cfg_kwargs: Dict[int, tuple] = {}  # id(config) -> (config, config.all_kwargs())
        self.fast = 0
        self.slow = 0
        self.misses = 0  # slow launches for want of a cached choice (not for a pre_hook)
        self.direct = None  # a DirectLaunch of the tuner's JIT function (install(direct_launch=True))

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def key(self, args: tuple, kwargs: dict) -> tuple:
        """Exactly the key ``Autotuner.run`` computes for this call (triton 3.6)."""
        n = len(args)
        key = []
        for name, i in self._key_pos:
            if name in kwargs:
                key.append(kwargs[name])
            elif i < n:
                key.append(args[i])
        values = list(args[: self._nnames])
        for name, v in kwargs.items():
            i = self._pos.get(name)
            if i is not None:
                if i < n:
                    values[i] = v  # {**nargs, **kwargs}: a keyword overrides in place
                else:
                    values.append(v)
        for v in values:
            if hasattr(v, "dtype"):
                d = v.dtype
                s = _DTYPE_STR.get(d)
                if s is None:
                    s = _DTYPE_STR[d] = str(d)
                key.append(s)
        return tuple(key)

    def launch(self, grid, args: tuple, kwargs: dict):
        t = self.tuner
        cfg = t.cache.get(self.key(args, kwargs)) if len(t.configs) > 1 else t.configs[0]
        if cfg is None or cfg.pre_hook is not None:
            self.slow += 1
            if cfg is None:
                self.misses += 1
                if self.misses == NEVER_ENGAGED_AFTER and self.fast == 0:
                    _warn_never_engaged("fast launch", _name(t.fn), self.misses)
            return t.run(*args, grid=grid, warmup=False, **kwargs)
        entry = self._cfg_kwargs.get(id(cfg))
        if entry is None or entry[0] is not cfg:
            entry = self._cfg_kwargs[id(cfg)] = (cfg, cfg.all_kwargs())
        self.fast += 1
        t.best_config = cfg
        if self.direct is not None:
            return self.direct.run(grid, args, {**kwargs, **entry[1]})
        return t.fn.run(*args, grid=grid, warmup=False, **kwargs, **entry[1])

    def __getattr__(self, name):  # anything else (configs, cache, keys, fn, ...) is the autotuner's
        return getattr(self.tuner, name)


class FastHeuristics:
    """Stands in for a stack of ``@triton.heuristics`` over a JIT function at its call sites.

    Triton's ``Heuristics.run`` builds a dict of all arguments for every heuristic (triton 3.6
    runtime/autotuner.py: ``kwargs[v] = heur({**dict(zip(self.arg_names, args)), **kwargs})``), one stacked layer
    per heuristic: five dicts of ~45 entries per launch of mamba-ssm's state update (selective_state_update.py:
    18-22), which runs once per layer in every eager decode step and every mixed step. This evaluates the same
    heuristics in the same order on ONE dict that carries each layer's results to the next (what the next layer
    sees in its kwargs), then launches the JIT function with the same kwargs."""

    def __init__(self, kernel):
        from triton.runtime.autotuner import Heuristics

        self.kernel = kernel
        self.layers, fn = [], kernel
        while isinstance(fn, Heuristics):
            self.layers.append(fn)
            fn = fn.fn
        self.fn = fn
        self.arg_names = list(self.layers[0].arg_names) if self.layers else []
        self.fast = 0
        self.direct = None  # a DirectLaunch of the JIT function (install(direct_launch=True))

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        named = dict(zip(self.arg_names, args))
        named.update(kwargs)
        for layer in self.layers:
            for name, heur in layer.values.items():
                kwargs[name] = named[name] = heur(named)
        self.fast += 1
        if self.direct is not None:
            return self.direct.run(grid, args, kwargs)
        return self.fn.run(*args, grid=grid, warmup=False, **kwargs)

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def unwrap(obj):
    """The Triton object behind a ``FastLaunch`` / ``FastHeuristics`` (anything else unchanged)."""
    if isinstance(obj, FastLaunch):
        return obj.tuner
    if isinstance(obj, FastHeuristics):
        return obj.kernel
    return obj


@contextlib.contextmanager
def triton_own_launch(*namespaces):
    """Within the block, Triton's own Autotuner / Heuristics objects are back at every call site that ``install``
    gave a FastLaunch / FastHeuristics, and at any such attribute of ``namespaces`` (e.g. ``upstream.kernels()``):
    the launch paths' A/B in one process (tests, benchmarks/prefill_layer.py)."""
    holders = [importlib.import_module(m) for kernels in (FORWARD_KERNELS, HEURISTIC_KERNELS) for m in kernels]
    sites = [(h, name, v) for h in holders + list(namespaces) for name, v in list(vars(h).items())
             if isinstance(v, (FastLaunch, FastHeuristics))]
    for h, name, v in sites:
        setattr(h, name, unwrap(v))
    try:
        yield
    finally:
        for h, name, v in sites:
            setattr(h, name, v)


def _deterministic_pins_configs() -> bool:
    """mamba-ssm's deterministic mode reduces every autotune list to one config (its own autotune_configs)."""
    try:
        import triton
        from mamba_ssm.utils.determinism import autotune_configs
    except ImportError:
        return False
    probe = [triton.Config({"BLOCK_SIZE_M": 32}), triton.Config({"BLOCK_SIZE_M": 64})]
    return autotune_configs(probe) is not probe


UPSTREAM_CONFIGS: Dict[str, list] = {}  # kernel name -> mamba-ssm's own list, before ``_extend`` (benchmarks)


def _extend(tuner, name: str) -> int:
    import triton

    UPSTREAM_CONFIGS.setdefault(name, list(tuner.configs))
    have = {(tuple(sorted(c.kwargs.items())), c.num_stages, c.num_warps) for c in tuner.configs}
    added = 0
    for m, n, k, stages, warps in EXTRA_CONFIGS.get(name, ()):
        kw = {"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k}
        if (tuple(sorted(kw.items())), stages, warps) not in have:
            tuner.configs.append(triton.Config(kw, num_stages=stages, num_warps=warps))
            added += 1
    return added


def _direct_for(jit_fn):
    """A DirectLaunch of ``jit_fn``, or None where it is not a plain JITFunction or this Triton lacks what
    DirectLaunch reads (logged once per kernel)."""
    from triton.runtime.jit import JITFunction

    if not isinstance(jit_fn, JITFunction):
        return None
    try:
        return DirectLaunch(jit_fn)
    except Exception as e:  # another Triton's internals: JITFunction.run it is
        logger.warning("vllm_mamba2_plugin: no direct launch for %s (%r); launching through JITFunction.run",
                       getattr(jit_fn, "__name__", jit_fn), e)
        return None


def install(fast_launch: bool = True, extra_configs: bool = True, direct_launch: bool = True) -> Dict[str, object]:
    """Wrap mamba-ssm's SSD forward autotuners in ``FastLaunch`` and/or extend their config lists, and its state
    update and gated-norm kernels in ``FastHeuristics``; with ``direct_launch`` (and ``fast_launch``) these launch
    compiled kernels through a ``DirectLaunch``. Idempotent. Returns name -> the object now at each call site (a
    FastLaunch / FastHeuristics, or Triton's own object)."""
    import triton
    from triton.runtime.autotuner import Autotuner, Heuristics

    version = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
    if fast_launch and not TESTED_TRITON[0] <= version <= TESTED_TRITON[-1]:
        logger.warning("vllm_mamba2_plugin: Triton %s is outside the range its launch patches were verified in "
                       "(%d.%d-%d.%d): mamba-ssm's kernels launch through Triton's own path (slower prefill).",
                       triton.__version__, *TESTED_TRITON[0], *TESTED_TRITON[-1])
        fast_launch = False
    extend = extra_configs and not _deterministic_pins_configs()
    if extra_configs and not extend:
        logger.info("vllm_mamba2_plugin: mamba-ssm's deterministic mode pins one config per SSD kernel; "
                    "VLLM_MAMBA2_PLUGIN_SSD_CONFIGS=extended does not apply")
    out = {}
    for kernels, kind, wrapper in ((FORWARD_KERNELS, Autotuner, FastLaunch),
                                   (HEURISTIC_KERNELS, Heuristics, FastHeuristics)):
        for mod_name, names in kernels.items():
            mod = importlib.import_module(mod_name)
            for name in names:
                obj = getattr(mod, name, None)
                target = unwrap(obj)
                if not isinstance(target, kind):  # another mamba-ssm: leave its call sites alone
                    logger.warning("vllm_mamba2_plugin: %s.%s is not a Triton %s (%s); launching it unchanged",
                                   mod_name, name, kind.__name__, type(obj).__name__)
                    continue
                if kind is Autotuner and extend and _extend(target, name):
                    logger.debug("vllm_mamba2_plugin: %s tunes over %d configs", name, len(target.configs))
                if fast_launch != isinstance(obj, wrapper):  # on: wrap Triton's object; off: put it back
                    obj = wrapper(target) if fast_launch else target
                    setattr(mod, name, obj)
                if isinstance(obj, wrapper):
                    jit_fn = obj.tuner.fn if wrapper is FastLaunch else obj.fn
                    if not direct_launch:
                        obj.direct = None
                    elif obj.direct is None or obj.direct.fn is not jit_fn:
                        obj.direct = _direct_for(jit_fn)
                out[name] = obj
    return out
