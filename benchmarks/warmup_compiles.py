"""What the prefill warm-up compiles, layout by layout: Triton compiles, their seconds, and each layout's time.

An engine's start-up runs ``warmup.warm_prefill`` in its profile run: every layout of ``warmup.prefill_layouts``
through a layer's real prefill path, which compiles (and, unless MAMBA_DETERMINISTIC=1 with
TRITON_CACHE_AUTOTUNING=0, autotunes) mamba-ssm's SSD kernels for each Triton specialisation a step can hit. This
runs that warm-up on one grid model's first layer (``tiny_model.GRID``; float32 activations and states, the fp32
grid's setting) with an empty Triton cache (or --cache-dir) and
prints one JSON line per layout (lengths, resumed flags, seconds, the kernels compiled and their compile seconds),
then a total, flushed as it goes: a run cut short by a time limit still shows where the time went.

    MAMBA_DETERMINISTIC=1 TRITON_CACHE_AUTOTUNING=0 python benchmarks/warmup_compiles.py --model h64n128
    python benchmarks/warmup_compiles.py --model n32g4 --precision tf32x3      # autotuned, other fp32 products
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "kernels", "cuda"), os.path.join(ROOT, "tests")]


def timed_compiles():
    """Wrap Triton's JIT compile (``JITFunction._do_compile``, Triton 3.x) to add (count, seconds) per kernel."""
    from triton.runtime import jit

    stats = collections.defaultdict(lambda: [0, 0.0])
    real = jit.JITFunction._do_compile

    def do_compile(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(self, *args, **kwargs)
        finally:
            s = stats[self.__name__]
            s[0] += 1
            s[1] += time.perf_counter() - t0

    jit.JITFunction._do_compile = do_compile
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="h64n128", help="a tiny_model.GRID name")
    ap.add_argument("--tokens", type=int, default=256, help="the profile run's tokens (the step budget)")
    ap.add_argument("--precision", default=None, help="upstream.FP32_DOT_PRECISION (default: the plugin's)")
    ap.add_argument("--decode", action="store_true", help="then the decode warm-up (warmup.warm_decode)")
    ap.add_argument("--cache-dir", default=None,
                    help="Triton cache to use and fill (default: a new empty one, so that every compile counts)")
    args = ap.parse_args()
    os.environ["TRITON_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="triton-")
    import torch
    from cuda_helpers import grid_layer

    from vllm_mamba2_plugin.kernels.cuda import upstream, warmup

    if args.precision:
        upstream.FP32_DOT_PRECISION = args.precision
    stats = timed_compiles()
    dev = torch.device("cuda")
    layer = grid_layer(args.model, dev)
    layer.get_state_dtype = lambda: (torch.float32, torch.float32)
    layouts = warmup.prefill_layouts(layer.chunk_size, args.tokens)
    slots = 1 + max(len(lengths) for lengths, _ in layouts)
    conv_pool, ssm_pool = layer.scratch_pools(slots, dev)
    width = layer.projection_width
    start = time.perf_counter()
    for lengths, resumed in layouts:
        before = {k: tuple(v) for k, v in stats.items()}
        t0 = time.perf_counter()
        layer.run_prefill_block(torch.zeros(sum(lengths), width, device=dev), lengths, resumed, conv_pool, ssm_pool)
        torch.cuda.synchronize()
        new = {k: [v[0] - before.get(k, (0, 0.0))[0], round(v[1] - before.get(k, (0, 0.0))[1], 2)]
               for k, v in stats.items() if v[0] != before.get(k, (0, 0.0))[0]}
        print(json.dumps(dict(lengths=lengths if len(lengths) < 8 else f"{len(lengths)} sequences",
                              resumed=sum(resumed), seconds=round(time.perf_counter() - t0, 2), compiles=new)),
              flush=True)
    if args.decode:
        t0 = time.perf_counter()
        warmup.warm_decode(layer, torch.zeros(args.tokens, width, device=dev))
        print(json.dumps(dict(decode=True, seconds=round(time.perf_counter() - t0, 2))), flush=True)
    print(json.dumps(dict(model=args.model, precision=args.precision or upstream.FP32_DOT_PRECISION,
                          deterministic=os.environ.get("MAMBA_DETERMINISTIC", "") == "1"
                          and os.environ.get("TRITON_CACHE_AUTOTUNING") != "1",
                          device=torch.cuda.get_device_name(), layouts=len(layouts),
                          total_s=round(time.perf_counter() - start, 1),
                          compiles={k: [v[0], round(v[1], 1)] for k, v in sorted(stats.items(),
                                                                                  key=lambda kv: -kv[1][1])})),
          flush=True)


if __name__ == "__main__":
    main()
