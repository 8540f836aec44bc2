"""One mixer layer's prefill path, without an engine: host time vs device time, and where the device time goes.

    python benchmarks/prefill_layer.py --model 130m --layouts 16x512,2x4096,16x512r --out $OUT/prefill_layer.jsonl
    python benchmarks/prefill_layer.py --model tiny --layouts 4x32,4x32r --device cpu     # smoke (reference kernels)

Why: in the throughput harness the plugin prefills at ~0.5-0.6x in-tree vLLM (benchmarks/RESULTS.md), and an
8 192-token step of the 130m shape takes ~80 ms where a FLOP estimate of its GPU work is ~10 ms. An engine start
costs ~100 s of device time; this script measures the same per-layer work in seconds, so a change to the
prefill glue can be checked (and A/B'd) cheaply.

It runs the plugin's own code: a ``Mamba2Mixer`` of one layer of a real shape (``throughput.MODELS``) and
its ``conv_ssm_forward``, with metadata from the plugin's ``Mamba2PluginMetadataBuilder`` (whose ``build``
includes the step's prefill plan; its time is reported as build_us). With no engine there is no forward
context, so the one lookup the mixer makes in it (``compat.layer_metadata``) is answered with that metadata.
Layouts: "<S>x<L>" = S fresh prompts of L tokens packed together (T = S*L); a trailing "r" makes every other
prompt a resumed chunk (it starts from the state in its slot: the initial-state correction path).

Reported per layout: host_us = CPU time to enqueue one layer (measured over ``--iters`` layers with no sync in
between), wall_us = wall time per layer with the GPU kept busy (sync after the loop), device breakdown per
kernel from torch.profiler, and the per-step estimate num_layers * wall_us. host_us close to wall_us means the
path is host-bound: the GPU waits for Python.
"""

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import throughput  # noqa: E402

from vllm_mamba2_plugin import compat  # noqa: E402
from vllm_mamba2_plugin.backend import Mamba2PluginMetadataBuilder  # noqa: E402
from vllm_mamba2_plugin.mixer import Mamba2Mixer  # noqa: E402

CONV_WIDTH = 4
CHUNK = 256


def parse_layout(spec: str):
    resumed = spec.endswith("r")
    s, l = spec.rstrip("r").split("x")
    return int(s), int(l), resumed


def make_layer(model: str, dtype, dev, seed=0) -> Mamba2Mixer:
    """One mixer layer of the model's shape with random weights (A, D, dt_bias float32, as the model loads them)."""
    c = throughput.MODELS[model]
    cfg = SimpleNamespace(hidden_size=c["hidden_size"], num_heads=c["num_heads"], head_dim=c["head_dim"],
                          n_groups=c["n_groups"], state_size=c["state_size"], conv_kernel=CONV_WIDTH,
                          layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True)
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # the layer registers itself in the config's forward context
        layer = Mamba2Mixer(cfg, model_config=None, cache_config=None, prefix="bench.mixer")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        layer.A.copy_(-torch.rand(layer.num_heads, generator=g) - 0.5)
        layer.norm.weight.add_(1.0)
    for m in (layer.in_proj, layer.conv1d, layer.out_proj):
        m.to(dtype)
    layer.norm.weight.data = layer.norm.weight.data.to(dtype)
    return layer.to(dev)


def make_step(layer: Mamba2Mixer, S, L, resumed, dtype, dev, seed=1):
    """Inputs, state pools and scheduler-side metadata of one prefill-only step."""
    g = torch.Generator().manual_seed(seed)
    T = S * L
    n_proj = layer.in_proj.out_features
    slots_n = 2 * S + 1
    conv_pool = torch.randn(slots_n, CONV_WIDTH - 1, layer.conv_dim, generator=g) * 0.1
    ssm_pool = torch.randn(slots_n, layer.num_heads, layer.head_dim, layer.state_size, generator=g) * 0.1
    layer.kv_cache = [conv_pool.to(dev, dtype), ssm_pool.to(dev, dtype)]
    slots = torch.randperm(slots_n - 1, generator=g)[:S] + 1  # slot 0 is the null block
    qsl = torch.arange(S + 1, dtype=torch.int32) * L
    context = torch.tensor([7 if resumed and s % 2 == 1 else 0 for s in range(S)], dtype=torch.int32)
    table = torch.zeros(S, 4, dtype=torch.int32)
    table[:, 0] = slots
    seq = context + L
    cam = SimpleNamespace(num_reqs=S, query_start_loc_cpu=qsl, seq_lens_cpu_upper_bound=seq, seq_lens_cpu=seq,
                          query_start_loc=qsl.to(dev), seq_lens=seq.to(dev), block_table_tensor=table.to(dev),
                          num_actual_tokens=T)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(chunk_size=CHUNK, conv_kernel=CONV_WIDTH)),
        scheduler_config=SimpleNamespace(max_num_seqs=S), compilation_config=SimpleNamespace())
    builder = Mamba2PluginMetadataBuilder(None, [layer.prefix], vllm_config, dev)
    projected = torch.randn(T, n_proj, generator=g).to(dev, dtype)
    return dict(T=T, projected=projected, builder=builder, cam=cam)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure(layer, step, dev, iters: int, rows: int):
    out = torch.empty(step["T"], layer.d_inner, dtype=step["projected"].dtype, device=dev)
    for _ in range(3):  # the last of three builds: the first pays one-time costs (pinned-memory set-up)
        t = time.perf_counter()
        meta = step["builder"].build(0, step["cam"])
        build_us = (time.perf_counter() - t) * 1e6

    def run():
        layer.conv_ssm_forward(step["projected"], out)

    kernels = []
    # No engine, so no forward context: the mixer's one lookup in it answers with this step's metadata.
    with mock.patch.object(compat, "layer_metadata", lambda prefix: meta):
        for _ in range(3):  # compile / autotune outside the timed loops
            run()
        sync(dev)
        t = time.perf_counter()
        for _ in range(iters):
            run()
        host = (time.perf_counter() - t) / iters
        sync(dev)
        wall = (time.perf_counter() - t) / iters
        if dev.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(iters):
                    run()
                sync(dev)
            ka = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
            kernels = [(e.key[:70], round(e.self_device_time_total / iters, 1), e.count // iters) for e in ka
                       if e.self_device_time_total > 0][:rows]
    layers = throughput.MODELS[step["model"]]["num_hidden_layers"]
    return dict(build_us=build_us, host_us=host * 1e6, wall_us=wall * 1e6, step_ms_estimate=wall * layers * 1e3,
                device_us_per_layer=round(sum(k_[1] for k_ in kernels), 1) if kernels else None, kernels=kernels)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="130m")
    ap.add_argument("--layouts", default="16x512,2x4096,16x512r")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rows", type=int, default=15)
    ap.add_argument("--out", default=None, help="append one JSON line per layout")
    args = ap.parse_args()
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    layer = make_layer(args.model, dtype, dev)
    layers = throughput.MODELS[args.model]["num_hidden_layers"]
    for spec in args.layouts.split(","):
        S, L, resumed = parse_layout(spec)
        step = dict(make_step(layer, S, L, resumed, dtype, dev), model=args.model)
        r = dict(model=args.model, layout=spec, tokens=S * L, sequences=S, resumed=resumed, device=str(dev),
                 dtype=args.dtype, **measure(layer, step, dev, args.iters, args.rows))
        print(f"{args.model} {spec:>9} T={S * L}: metadata build {r['build_us']:.0f} us | per layer: host "
              f"{r['host_us']:.0f} us, wall {r['wall_us']:.0f} us, device {r['device_us_per_layer']} us | "
              f"x{layers} layers = {r['step_ms_estimate']:.1f} ms per step", flush=True)
        for name, us, count in r["kernels"]:
            print(f"    {us:9.1f} us  x{count:<3} {name}")
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
