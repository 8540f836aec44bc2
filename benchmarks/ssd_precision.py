"""mamba-ssm's SSD forward on float32 activations at each tl.dot precision: error, compile time, run time.

Triton multiplies float32 ``tl.dot`` operands at the precision TRITON_F32_DEFAULT names: "tf32" (its default on
NVIDIA GPUs: a 10-bit mantissa), "tf32x3" (three TF32 products, near float32) or "ieee" (float32 FMAs, no tensor
cores). The plugin picks one for fp32 models (``upstream.FP32_DOT_PRECISION``); this measures the choice on each
grid model's layer shape (``tiny_model.GRID``): one packed varlen prefill of the grid's prompt lengths, step sizes
drawn as the wide init draws them, through the plugin's own ``upstream.kernels().ssd_fwd`` (its launch path and
extended configs included). Reported per (model, precision): max |error| / max |reference| of the output and of
the final states against the float64 reference (``kernels/reference.py``), the first call's time (compiles, plus
autotuning unless --deterministic), and the median time of later calls.

Each (model, precision) runs in its own process with an empty Triton cache, so compile times are cold:

    python benchmarks/ssd_precision.py --deterministic --out $OUT/ssd_precision.jsonl
    python benchmarks/ssd_precision.py --models n32g4,h64n128 --precisions tf32x3,ieee     # autotuned
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

from prefix_cache import emit  # noqa: E402  (one JSON line on stdout and in --out)

PRECISIONS = ("tf32", "tf32x3", "ieee")
LENGTHS = (3, 21, 69, 250, 408)  # prompt lengths of the grid's serving runs: one packed prefill step


def layer_inputs(spec, seed: int = 0):
    """CPU float64 inputs of one SSD call: x (T, H, P), raw dt (T, H), A (H,), B, C (T, G, N), D, dt_bias (H,),
    cu_seqlens (S+1,). Activations N(0, 1) (silu of the wide init's conv outputs are of that size), raw dt
    N(0, 1.6) (in_proj N(0, 0.1) of a unit-RMS hidden state 256 wide) and dt_bias N(0, 1), A = -1 .. -H."""
    import torch

    g = torch.Generator().manual_seed(seed)
    T, H, P, G, N = sum(LENGTHS), spec.num_heads, spec.head_dim, spec.n_groups, spec.state_size
    f64 = dict(generator=g, dtype=torch.float64)
    return dict(x=torch.randn(T, H, P, **f64), dt=torch.randn(T, H, **f64) * 1.6,
                A=-torch.arange(1, H + 1, dtype=torch.float64), B=torch.randn(T, G, N, **f64),
                C=torch.randn(T, G, N, **f64), D=torch.ones(H, dtype=torch.float64),
                dt_bias=torch.randn(H, **f64),
                cu_seqlens=torch.tensor((0,) + LENGTHS).cumsum(0).to(torch.int32))


def rel_err(got, want) -> float:
    return float((got.double().cpu() - want).abs().max() / want.abs().max())


def run_one(args) -> dict:
    """In the child: one model's SSD call at one precision (the environment set by the parent)."""
    import torch

    from vllm_mamba2_plugin import tiny_model
    from vllm_mamba2_plugin.kernels import reference as ref
    from vllm_mamba2_plugin.kernels.interface import PrefillBatch
    from vllm_mamba2_plugin.kernels.cuda import upstream

    spec = tiny_model.GRID[args.models]
    upstream.FP32_DOT_PRECISION = args.precisions
    inp = layer_inputs(spec)
    limit = tuple(spec.time_step_limit)
    y_ref, states_ref, _ = ref.ssd_chunk_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"],
                                              PrefillBatch.of(inp["cu_seqlens"], chunk_size=spec.chunk_size),
                                              D=inp["D"], dt_bias=inp["dt_bias"], dt_limit=limit,
                                              state_dtype=torch.float64)
    dev = torch.device("cuda")
    cu = inp["cu_seqlens"].to(dev)
    seq_idx = torch.repeat_interleave(torch.arange(len(LENGTHS), dtype=torch.int32, device=dev),
                                      cu.diff()).unsqueeze(0)
    t = {k: v.to(dev, torch.float32) for k, v in inp.items() if k != "cu_seqlens"}
    ssd_fwd = upstream.kernels().ssd_fwd

    def call():
        res = ssd_fwd(t["x"].unsqueeze(0), t["dt"].unsqueeze(0), t["A"], t["B"].unsqueeze(0),
                      t["C"].unsqueeze(0), spec.chunk_size, D=t["D"], dt_bias=t["dt_bias"], seq_idx=seq_idx,
                      cu_seqlens=cu, dt_softplus=True, dt_limit=limit)
        return res[0], res[-1]

    t0 = time.perf_counter()
    y, states = call()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(args.iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return dict(model=args.models, precision=args.precisions, deterministic=args.deterministic,
                tokens=sum(LENGTHS), device=torch.cuda.get_device_name(),
                out_rel_err=rel_err(y[0], y_ref), state_rel_err=rel_err(states, states_ref),
                first_call_s=round(first_s, 2), median_us=round(statistics.median(times) * 1e6, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="all", help="comma list of tiny_model.GRID names, or all")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--deterministic", action="store_true",
                    help="MAMBA_DETERMINISTIC=1: one fixed config per kernel (else: autotuned)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per (model, precision) process")
    ap.add_argument("--out", default=None, help="append one JSON line per (model, precision)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_one(args)), flush=True)
        return
    from vllm_mamba2_plugin import tiny_model

    models = list(tiny_model.GRID) if args.models == "all" else args.models.split(",")
    for model in models:
        for precision in args.precisions.split(","):
            env = {**os.environ, "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="triton-"),
                   "MAMBA_DETERMINISTIC": "1" if args.deterministic else "0"}
            env["TRITON_CACHE_AUTOTUNING"] = "0"  # not unset: an import of vLLM sets it to "1" when unset
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--models", model, "--precisions",
                   precision, "--iters", str(args.iters)] + (["--deterministic"] if args.deterministic else [])
            t0 = time.perf_counter()
            try:
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
                lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
                row = json.loads(lines[-1]) if p.returncode == 0 and lines else dict(
                    model=model, precision=precision, error=p.stderr[-2000:])
            except subprocess.TimeoutExpired:
                row = dict(model=model, precision=precision, error=f"timed out after {args.timeout:.0f} s")
            row["process_s"] = round(time.perf_counter() - t0, 1)
            emit(row, args.out)


if __name__ == "__main__":
    main()
