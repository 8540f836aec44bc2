"""Launch configs of mamba-ssm's selective-state-update kernel (the decode step's largest cost), on the GPU.

    python benchmarks/ssu_launch.py [--out results.jsonl]

mamba-ssm's wrapper launches ``_selective_scan_update_kernel`` with (BLOCK_SIZE_M, num_warps) = (4, 4) for
d_state 128 whatever the batch; vLLM's in-tree copy of the same kernel reads tuned H200 configs
(vllm/model_executor/layers/mamba/ops/configs/selective_state_update/). This runs the plugin's CUDA
``ssm_state_update`` on the three benchmark shapes (130m, 2.7b, 7b: head_dim 64, d_state 128; ``--shapes grid``:
also the decode grid's head_dim 128 / d_state 64 shapes of benchmarks/throughput.py; bf16 state, or
fp32 with ``--state-dtype float32``, i.e. ``--mamba-ssm-cache-dtype float32`` with bf16 weights) at batch
1 / 64 / 256 with the plugin's default launch (``ssu_launch_config``: the table's entry, else mamba-ssm's
wrapper), upstream's (4, 4) tile and other candidates, and reports device time per call (CUDA-graph replay of 20
calls) and achieved state bandwidth (read + write of batch * H * P * N states). Every config's output and states
are checked against the default launch and against the plain-torch
reference (``kernels.reference.ssm_state_update``) from the same initial pool.

Needs only torch, triton and mamba-ssm's Triton files (not vLLM, not causal-conv1d): on the GPU machine
PYTHONPATH can point at the unpacked mamba-ssm source tree. (throughput.py, for the shapes, imports no vLLM at
module level.)
"""

import argparse
import json
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import GRID, MODELS  # noqa: E402  (the model shapes: heads, groups, head_dim, d_state)
# None = the plugin's default launch for the shape (SSU_LAUNCH_TABLE's entry, else mamba-ssm's wrapper, which
# launches ``wrapper_tile``); (4, 4) and (8, 4), the wrapper's tiles for d_state 128 and 64, are listed explicitly
# because once the table has an entry, None is no longer upstream's.
CANDIDATES = [None, (4, 4), (4, 1), (8, 1), (8, 2), (8, 4), (16, 1), (16, 2), (16, 4), (32, 2), (32, 4)]


def load_kernels():
    """mamba-ssm's selective_state_update module without running mamba_ssm/__init__ (which imports the
    Mamba1 CUDA extension and causal-conv1d)."""
    import importlib
    import importlib.util

    if "mamba_ssm" not in sys.modules:
        spec = importlib.util.find_spec("mamba_ssm")
        root = list(spec.submodule_search_locations)[0]
        for name, path in (("mamba_ssm", root), ("mamba_ssm.ops", os.path.join(root, "ops")),
                           ("mamba_ssm.ops.triton", os.path.join(root, "ops", "triton"))):
            m = types.ModuleType(name)
            m.__path__ = [path]
            sys.modules[name] = m
    ssu = importlib.import_module("mamba_ssm.ops.triton.selective_state_update")
    return types.SimpleNamespace(selective_state_update=ssu.selective_state_update,
                                 ssu_kernel=ssu._selective_scan_update_kernel)


def wrapper_tile(dstate: int) -> tuple:
    """The (BLOCK_SIZE_M, num_warps) mamba-ssm's wrapper launches (selective_state_update.py:193-197)."""
    return (32, 4) if dstate <= 16 else (16, 4) if dstate <= 32 else (8, 4) if dstate <= 64 else (4, 4) \
        if dstate <= 128 else (4, 8)


def device_time_us(fn, reps=20, replays=5) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * replays)


def emit(row: dict, out_f) -> None:
    """One result row as a JSON line on stdout and, if given, appended to the results file (flushed: a cut run
    keeps what it measured)."""
    print(json.dumps(row), flush=True)
    if out_f:
        out_f.write(json.dumps(row) + "\n")
        out_f.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="130m,2.7b,7b", help="names of throughput.MODELS, or grid")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--state-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    from vllm_mamba2_plugin.kernels import cuda, reference
    from vllm_mamba2_plugin.kernels.cuda import decode_step, upstream

    upstream._KERNELS = load_kernels()  # only the state-update entry points are used here
    dev = torch.device("cuda")
    state_dtype = getattr(torch, args.state_dtype)
    out_f = open(args.out, "a") if args.out else None
    g = torch.Generator(device="cpu").manual_seed(0)
    for shape in GRID if args.shapes == "grid" else args.shapes.split(","):
        m = MODELS[shape]
        H, G, P, N = m["num_heads"], m["n_groups"], m["head_dim"], m["state_size"]
        for bs in [int(b) for b in args.batches.split(",")]:
            slots = 2 * bs + 1
            pool0 = (0.5 * torch.randn(slots, H, P, N, generator=g)).to(dev, state_dtype)
            idx = torch.randperm(slots, generator=g)[:bs].to(dev)
            x = torch.randn(bs, H, P, generator=g).to(dev, torch.bfloat16)
            dt = torch.randn(bs, H, generator=g).to(dev, torch.bfloat16)
            dt_bias = (0.5 * torch.randn(H, generator=g)).to(dev)
            A = -torch.exp(torch.rand(H, generator=g) * 2.7).to(dev)
            Bm, Cm = (torch.randn(bs, G, N, generator=g).to(dev, torch.bfloat16) for _ in range(2))
            D = torch.randn(H, generator=g).to(dev)

            ref_pool = pool0.clone()
            y_ref = reference.ssm_state_update(ref_pool, x, reference.process_dt(dt, dt_bias), A, Bm, Cm, idx, D=D)
            up_pool = pool0.clone()
            y_up = cuda.ssm_state_update(up_pool, x, dt, A, Bm, Cm, idx, D=D, dt_bias=dt_bias, dt_softplus=True)
            base_us = None
            default = decode_step.ssu_launch_config(bs, H, P, N, state_dtype)
            default_label = f"default: table {default}" if default else f"default: upstream wrapper {wrapper_tile(N)}"
            for cfg in CANDIDATES:
                pool = pool0.clone()
                y = cuda.ssm_state_update(pool, x, dt, A, Bm, Cm, idx, D=D, dt_bias=dt_bias, dt_softplus=True,
                                          launch=cfg)
                err_up = (y.float() - y_up.float()).abs().max().item()
                err_ref = (y.float() - y_ref.float()).abs().max().item() / max(y_ref.float().abs().max().item(), 1e-6)
                st_ref = ((pool[idx].float() - ref_pool[idx].float()).abs().max().item()
                          / max(ref_pool[idx].float().abs().max().item(), 1e-6))
                untouched = torch.ones(slots, dtype=torch.bool, device=dev)
                untouched[idx] = False
                ok_untouched = torch.equal(pool[untouched], pool0[untouched])
                us = device_time_us(lambda: cuda.ssm_state_update(pool, x, dt, A, Bm, Cm, idx, D=D, dt_bias=dt_bias,
                                                                  dt_softplus=True, launch=cfg))
                base_us = us if cfg is None else base_us
                gbs = 2 * bs * H * P * N * state_dtype.itemsize / (us * 1e-6) / 1e9
                label = cfg or default_label
                row = dict(shape=shape, state_dtype=args.state_dtype, batch=bs, heads=H, groups=G, head_dim=P,
                           d_state=N, config=label,
                           us=round(us, 2), state_GBps=round(gbs), speedup=round(base_us / us, 2),
                           max_abs_diff_vs_default=err_up,
                           rel_err_vs_reference=round(err_ref, 5), state_rel_err_vs_reference=round(st_ref, 5),
                           untouched_slots_identical=ok_untouched)
                emit(row, out_f)


if __name__ == "__main__":
    main()
