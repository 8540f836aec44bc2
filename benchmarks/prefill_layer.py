"""One mixer layer's prefill path, without an engine: host time vs device time, and where the device time goes.

    python benchmarks/prefill_layer.py --model 130m --layouts 16x512,2x4096,16x512r --out $OUT/prefill_layer.jsonl
    python benchmarks/prefill_layer.py --model tiny --layouts 4x32,4x32r --device cpu     # smoke (reference kernels)

Why: in the throughput harness the plugin prefills at ~0.5-0.6x in-tree vLLM (benchmarks/RESULTS.md), and an
8 192-token step of the 130m shape takes ~80 ms where a FLOP estimate of its GPU work is ~10 ms. An engine start
costs ~100 s of device time; this script measures the same per-layer work in seconds, so a change to the
prefill glue can be checked (and A/B'd) cheaply.

It runs the sequence of calls ``Mixer.conv_ssm_forward`` makes for a prefill-only step (kept in step by hand:
``run_layer`` below mirrors it), on one layer of a real shape (``throughput.MODELS``), with the step's
``plan_prefill`` built once, as the metadata builder does:
    causal_conv1d(plan) -> conv state scatter -> process_dt -> ssd_chunk_scan(plan) -> SSM state scatter
    -> gated RMSNorm into the output.
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

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import throughput  # noqa: E402

from vllm_mamba2_plugin.kernels import get_kernels  # noqa: E402

CONV_WIDTH = 4
CHUNK = 256


def parse_layout(spec: str):
    resumed = spec.endswith("r")
    s, l = spec.rstrip("r").split("x")
    return int(s), int(l), resumed


def make_layer(model: str, dtype, dev, seed=0):
    c = throughput.MODELS[model]
    H, P, G, N, d = c["num_heads"], c["head_dim"], c["n_groups"], c["state_size"], c["hidden_size"]
    d_inner = H * P
    conv_dim = d_inner + 2 * G * N
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dtype)

    return dict(
        H=H, P=P, G=G, N=N, d=d, d_inner=d_inner, conv_dim=conv_dim, layers=c["num_hidden_layers"],
        conv_w=rnd(conv_dim, CONV_WIDTH, scale=0.5), conv_b=rnd(conv_dim, scale=0.1),
        dt_bias=rnd(H, scale=0.5), A=-torch.rand(H, generator=g).to(dev, torch.float32) - 0.5,
        D=rnd(H), norm_w=1 + rnd(d_inner, scale=0.1),
    )


def make_step(layer, S, L, resumed, dtype, dev, seed=1):
    g = torch.Generator().manual_seed(seed)
    T = S * L
    projected = torch.randn(T, 2 * layer["d_inner"] + 2 * layer["G"] * layer["N"] + layer["H"], generator=g)
    slots_n = 2 * S + 1
    conv_pool = torch.randn(slots_n, CONV_WIDTH - 1, layer["conv_dim"], generator=g) * 0.1
    ssm_pool = torch.randn(slots_n, layer["H"], layer["P"], layer["N"], generator=g) * 0.1
    cu = torch.arange(S + 1, dtype=torch.int64) * L
    flags = torch.tensor([resumed and s % 2 == 1 for s in range(S)])
    slots = torch.randperm(slots_n - 1, generator=g)[:S] + 1  # slot 0 is the null block
    return dict(
        T=T, projected=projected.to(dev, dtype), conv_pool=conv_pool.to(dev, dtype), ssm_pool=ssm_pool.to(dev, dtype),
        cu_cpu=cu, flags_cpu=flags, qsl=cu.to(dev, torch.int32), flags=flags.to(dev), slots=slots.to(dev),
        any_init=bool(flags.any()),
    )


def run_layer(k, layer, step, plan, out):
    """Mirror of Mamba2Mixer.conv_ssm_forward for a prefill-only step (no decode rows): keep in sync."""
    d_inner, conv_dim, H = layer["d_inner"], layer["conv_dim"], layer["H"]
    G, N, P = layer["G"], layer["N"], layer["P"]
    z, xBC, dt = torch.split(step["projected"], [d_inner, conv_dim, H], dim=-1)
    slots, resume = step["slots"], step["any_init"]
    conv_state, ssm_state = step["conv_pool"], step["ssm_pool"]
    xBC_p, conv_final = k.causal_conv1d(
        xBC, layer["conv_w"], layer["conv_b"], step["qsl"],
        initial_states=conv_state[slots] if resume else None,
        has_initial_state=step["flags"] if resume else None, activation="silu", plan=plan,
    )
    conv_state[slots] = conv_final.to(conv_state.dtype)
    x, B, C = torch.split(xBC_p, [d_inner, G * N, G * N], dim=-1)
    x, B, C = x.reshape(-1, H, P), B.reshape(-1, G, N), C.reshape(-1, G, N)
    dt_p = k.process_dt(dt, layer["dt_bias"], (0.0, float("inf")))
    y, ssm_final = k.ssd_chunk_scan(
        x, dt_p, layer["A"], B, C, CHUNK, step["qsl"],
        initial_states=ssm_state[slots] if resume else None,
        has_initial_state=step["flags"] if resume else None, D=layer["D"], plan=plan,
    )
    ssm_state[slots] = ssm_final.to(ssm_state.dtype)
    k.gated_rms_norm(y.view(y.shape[0], d_inner), z, layer["norm_w"], 1e-5, d_inner // G, out=out)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure(k, layer, step, dev, iters: int, rows: int):
    out = torch.empty(step["T"], layer["d_inner"], dtype=step["projected"].dtype, device=dev)
    t = time.perf_counter()
    plan = k.plan_prefill(step["cu_cpu"], step["flags_cpu"], step["T"], CHUNK, CONV_WIDTH, dev)
    plan_us = (time.perf_counter() - t) * 1e6
    for _ in range(3):  # compile / autotune outside the timed loops
        run_layer(k, layer, step, plan, out)
    sync(dev)
    t = time.perf_counter()
    for _ in range(iters):
        run_layer(k, layer, step, plan, out)
    host = (time.perf_counter() - t) / iters
    sync(dev)
    wall = (time.perf_counter() - t) / iters
    kernels = []
    if dev.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                run_layer(k, layer, step, plan, out)
            sync(dev)
        ka = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
        kernels = [(e.key[:70], round(e.self_device_time_total / iters, 1), e.count // iters) for e in ka
                   if e.self_device_time_total > 0][:rows]
    return dict(plan_us=plan_us, host_us=host * 1e6, wall_us=wall * 1e6, step_ms_estimate=wall * layer["layers"] * 1e3,
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
    k = get_kernels(dev)
    layer = make_layer(args.model, dtype, dev)
    for spec in args.layouts.split(","):
        S, L, resumed = parse_layout(spec)
        step = make_step(layer, S, L, resumed, dtype, dev)
        r = dict(model=args.model, layout=spec, tokens=S * L, sequences=S, resumed=resumed, kernels_module=k.__name__,
                 dtype=args.dtype, **measure(k, layer, step, dev, args.iters, args.rows))
        print(f"{args.model} {spec:>9} T={S * L}: plan {r['plan_us']:.0f} us | per layer: host {r['host_us']:.0f} us, "
              f"wall {r['wall_us']:.0f} us, device {r['device_us_per_layer']} us | x{layer['layers']} layers = "
              f"{r['step_ms_estimate']:.1f} ms per step", flush=True)
        for name, us, count in r["kernels"]:
            print(f"    {us:9.1f} us  x{count:<3} {name}")
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
