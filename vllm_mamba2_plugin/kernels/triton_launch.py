"""mamba-ssm's Triton kernels: a cheaper launch, and vLLM's wider SSD tuning space (CUDA path only).

``install()`` runs once, from ``cuda._kernels()`` (lazily, at the first CUDA kernel call; never at import). It
leaves the kernels' code untouched and changes two things around them:

* **Launch without the autotuner's per-call bookkeeping** (``FastLaunch``). Every launch of an autotuned kernel
  goes through Triton's ``Autotuner.run``, which on every call rebuilds the argument dicts (with a list
  membership test per argument), the tuning key (``str(dtype)`` of every tensor argument) and the chosen config's
  kwargs: ~45 µs per launch under cProfile on the H200's host, six launches per layer of every prefill step, and
  prefill steps are host-bound (benchmarks/RESULTS.md, tenth session). ``FastLaunch`` takes the autotuner's place
  at mamba-ssm's call sites (the module globals that its wrappers look up at call time). It builds the same key
  from precomputed argument positions, takes the autotuner's own choice for it (``Autotuner.cache``), and calls
  the JIT function with that config the way ``Autotuner.run`` does (triton 3.6 runtime/autotuner.py:
  ``self.fn.run(*args, **kwargs, **config.all_kwargs())``, after ``self.best_config = config``). What it does not
  mirror still goes through the autotuner: the first call of a key (tuning, Triton's disk cache), and configs
  with a pre_hook. The kernels, configs and launches stay the same. ``FastHeuristics`` does the same for the
  state-update and gated-norm kernels, which are stacks of ``@triton.heuristics`` (one argument dict per stacked
  heuristic in Triton, one in all here).
* **vLLM's config lists** (``EXTRA_CONFIGS``). vLLM 0.26 ships its own copies of these kernels. Their autotune
  lists add configs that mamba-ssm 2.3.2's lists lack: 12 for ``_chunk_scan_fwd_kernel``, 5 for
  ``_chunk_state_fwd_kernel``. Among them is the config that vLLM's chunk scan picks on the H200 at the 2.7b shape
  ((64, 64, 32), 4 warps, 1 stage: 186 µs per layer, against 237 µs for mamba-ssm's choice; RESULTS.md, tenth
  session). ``install`` appends them to mamba-ssm's lists, so its autotuner also benchmarks them and keeps the
  fastest by its own measurement. This is skipped in mamba-ssm's deterministic mode (MAMBA_DETERMINISTIC=1 without
  TRITON_CACHE_AUTOTUNING=1), which pins one config per kernel on purpose.

Switches (envs.py): VLLM_MAMBA2_PLUGIN_FAST_LAUNCH=0 keeps Triton's launch path, and
VLLM_MAMBA2_PLUGIN_SSD_CONFIGS=upstream keeps mamba-ssm's config lists.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from typing import Dict, List, Tuple

logger = logging.getLogger(__name__)

# The SSD forward kernels that cuda.ssd_chunk_scan reaches through _mamba_chunk_scan_combined_fwd, by module.
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

_DTYPE_STR: Dict[object, str] = {}


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
            return t.run(*args, grid=grid, warmup=False, **kwargs)
        entry = self._cfg_kwargs.get(id(cfg))
        if entry is None or entry[0] is not cfg:
            entry = self._cfg_kwargs[id(cfg)] = (cfg, cfg.all_kwargs())
        self.fast += 1
        t.best_config = cfg
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

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        named = dict(zip(self.arg_names, args))
        named.update(kwargs)
        for layer in self.layers:
            for name, heur in layer.values.items():
                kwargs[name] = named[name] = heur(named)
        self.fast += 1
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
    gave a FastLaunch / FastHeuristics, and at any such attribute of ``namespaces`` (e.g. ``cuda._kernels()``):
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


def install(fast_launch: bool = True, extra_configs: bool = True) -> Dict[str, object]:
    """Wrap mamba-ssm's SSD forward autotuners in ``FastLaunch`` and/or extend their config lists, and its state
    update and gated-norm kernels in ``FastHeuristics``. Idempotent. Returns name -> the object now at each call
    site (a FastLaunch / FastHeuristics, or Triton's own object)."""
    from triton.runtime.autotuner import Autotuner, Heuristics

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
                if fast_launch and not isinstance(obj, wrapper):
                    obj = wrapper(target)
                    setattr(mod, name, obj)
                out[name] = obj
    return out
