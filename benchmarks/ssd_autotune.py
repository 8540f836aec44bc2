"""Does the batch that the SSD kernels are autotuned on decide how fast every later prefill runs?

    python benchmarks/ssd_autotune.py --models 2.7b,7b --tunes engine,2x4096 --layouts 2x4096,16x512,1x512

mamba-ssm's SSD kernels (and vLLM's copies of them) are ``@triton.autotune``d on keys that hold only head, state
and chunk sizes (``_chunk_scan_fwd_kernel``: chunk_size, hdim, dstate, IS_CAUSAL; ``_state_passing_fwd_kernel``:
dim): the first call in a process benchmarks every config on ITS arguments, and the winner then serves every
later call, however long. vLLM's ``_warmup_ssd_kernels`` makes that first call on one chunk, where few
programs favour small tiles, while the steps that cost GPU time pack 8 192 tokens; the plugin's
``kernels/cuda/warmup.warm_prefill`` makes it on the profile run's whole token budget (``prefill_layouts``).

Per model shape and tuning batch ("engine": each implementation's own start-up warm-up; "<S>x<L>": that packed
batch), the script clears the autotuners' choices (in memory; disk caching off), tunes, prints the configs the
tuners chose, then measures one mixer layer's prefill (``prefill_layer.py``'s runners and ``measure``: host, wall
and per-kernel device time) on each layout, for the plugin and, with ``--impls plugin,intree``, vLLM's in-tree
kernels tuned the same way.
"""

import argparse
import json
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import prefill_layer as pl  # noqa: E402

from vllm_mamba2_plugin import compat  # noqa: E402
from vllm_mamba2_plugin.kernels.cuda import triton_launch, warmup  # noqa: E402

TUNER_MODULES = {
    "plugin": ["mamba_ssm.ops.triton.ssd_chunk_state", "mamba_ssm.ops.triton.ssd_state_passing",
               "mamba_ssm.ops.triton.ssd_bmm", "mamba_ssm.ops.triton.ssd_chunk_scan"],
    "intree": ["vllm.model_executor.layers.mamba.ops.ssd_chunk_state",
               "vllm.model_executor.layers.mamba.ops.ssd_state_passing",
               "vllm.model_executor.layers.mamba.ops.ssd_bmm", "vllm.model_executor.layers.mamba.ops.ssd_chunk_scan"],
}


def autotuners(impl: str) -> dict:
    """name -> triton Autotuner of the implementation's SSD kernels (forward and backward alike)."""
    import importlib

    from triton.runtime.autotuner import Autotuner

    out = {}
    for m in TUNER_MODULES[impl]:
        mod = importlib.import_module(m)
        tuners = {n: triton_launch.unwrap(v) for n, v in vars(mod).items()}  # the plugin's FastLaunch call sites
        out.update({f"{m.rsplit('.', 1)[1]}.{n}": v for n, v in tuners.items() if isinstance(v, Autotuner)})
    return out


def use_configs(tuners: dict, which: str) -> None:
    """The plugin's SSD autotuners on mamba-ssm's own config lists ("upstream") or with vLLM's configs added
    ("extended", the plugin's default: kernels/cuda/triton_launch.py)."""
    for name, t in tuners.items():
        kernel = name.rsplit(".", 1)[1]
        if kernel in triton_launch.EXTRA_CONFIGS:
            up = triton_launch.UPSTREAM_CONFIGS.get(kernel, t.configs)
            t.configs[:] = list(up)
            if which == "extended":
                triton_launch._extend(t, kernel)


def reset(tuners: dict) -> None:
    for t in tuners.values():
        t.cache.clear()
        t.cache_results = False  # no disk cache: every tuning benchmarks afresh


def chosen(tuners: dict) -> dict:
    return {n: {str(k): str(c) for k, c in t.cache.items()} for n, t in tuners.items() if t.cache}


def tune(impl, spec, layer, dtype, dev, holder):
    """Make the tuners' first call: the implementation's engine warm-up, or one call on the packed batch."""
    if spec == "engine":
        if impl == "plugin":
            warmup._WARMED_PREFILL.clear()
            layer.get_state_dtype = lambda: (dtype, dtype)  # no model/cache config here: bf16 pools, as measured
            projected = torch.zeros(8, layer.projection_width, dtype=dtype, device=dev)
            warmup.warm_prefill(layer, projected)  # its first layout is the autotuners' first call
            return
        spec = f"1x{pl.CHUNK}"  # vLLM's _warmup_ssd_kernels: one chunk
    S, L, resumed = pl.parse_layout(spec)
    step = pl.make_step(layer, S, L, resumed, dtype, dev)
    layer.kv_cache = pl.fresh_pools(step, dtype, dev)
    run, _ = pl.RUNNERS[impl](layer, step, dev, holder)
    run()
    torch.cuda.synchronize(dev)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="2.7b")
    ap.add_argument("--tunes", default="engine,2x4096")
    ap.add_argument("--layouts", default="2x4096,16x512,1x512")
    ap.add_argument("--impls", default="plugin,intree")
    ap.add_argument("--configs", default="extended",
                    help="the plugin's SSD config lists to tune over: upstream (mamba-ssm's), extended (+ vLLM's), "
                         "or both, comma-separated (in-tree always uses vLLM's own)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--out", default=None, help="append one JSON line per measurement")
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    impls = args.impls.split(",")
    holder = [None]
    if "plugin" in impls:
        from vllm_mamba2_plugin.kernels.cuda import upstream

        upstream.kernels()  # imports mamba-ssm and installs the plugin's launch path and config lists
    variants = [(impl, cfg) for impl in impls for cfg in (args.configs.split(",") if impl == "plugin" else ["-"])]
    with mock.patch.object(compat, "layer_metadata", lambda prefix: holder[0]):
        for model in args.models.split(","):
            layer = pl.make_layer(model, dtype, dev)
            for tspec in args.tunes.split(","):
                for impl, cfg in variants:
                    tuners = autotuners(impl)
                    if impl == "plugin":
                        use_configs(tuners, cfg)
                    reset(tuners)
                    tune(impl, tspec, layer, dtype, dev, holder)
                    print(f"## {model} {impl} ({cfg} configs) tuned on {tspec}: {json.dumps(chosen(tuners))}",
                          flush=True)
                    for spec in args.layouts.split(","):
                        S, L, resumed = pl.parse_layout(spec)
                        step = pl.make_step(layer, S, L, resumed, dtype, dev)
                        layer.kv_cache = pl.fresh_pools(step, dtype, dev)
                        run, _ = pl.RUNNERS[impl](layer, step, dev, holder)
                        r = pl.measure(run, dev, args.iters, args.rows)
                        print(f"{model} {impl:>6} {cfg:>8} tuned {tspec:>7} | {spec:>8}: device {r['device_us_per_layer']} us, "
                              f"host {r['host_us']:.0f} us, wall {r['wall_us']:.0f} us per layer", flush=True)
                        for name, us, count in r["kernels"]:
                            print(f"    {us:9.1f} us  x{count:<3} {name}")
                        if args.out:
                            with open(args.out, "a") as f:
                                f.write(json.dumps(dict(model=model, impl=impl, configs=cfg, tuned_on=tspec,
                                                        layout=spec,
                                                        **{k: v for k, v in r.items() if k != "host_ops"})) + "\n")


if __name__ == "__main__":
    with torch.no_grad():
        main()
