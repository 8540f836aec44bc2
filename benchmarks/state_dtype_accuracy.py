"""What a 16-bit SSM state costs in accuracy over a long decode: bf16 vs fp32 state against a float64 recurrence.

    python benchmarks/state_dtype_accuracy.py [--shape 2.7b] [--steps 2048] [--batch 8] [--md RESULTS.md]

The speed side is arithmetic: a decode step moves weight bytes + 2 * batch * state bytes, and an fp32 state
doubles the second term (2.7b at batch 256: 43 -> 86 GB per step against 5.4 GB of weights). This measures the
other side on one layer of a benchmark shape (head_dim 64, d_state 128): the plugin's state update
(``kernels.reference.ssm_state_update``, the same math as mamba-ssm's kernel: compute in float32, store the state
back in the pool dtype) runs ``--steps`` decode steps from a zero state with a bf16 pool and with an fp32 pool, on
the same bf16-valued inputs (x passed as float32 so that y is not rounded to bf16 on the way out: the numbers
are the state's error alone), and both are compared with a plain float64 recurrence (h = exp(dt A) h + dt x B^T,
y = h C + D x). Parameters follow Mamba2's initialisation: A = -U[1, 16], dt = softplus(dt_raw + dt_bias) with
dt_bias = softplus^-1(U_log[1e-3, 1e-1]) and dt_raw ~ N(0, 0.5): slow heads keep a state for ~1000 steps, which
is where rounding the state to bf16 every step accumulates.

Reported per checkpoint step: relative error of y (||y - y64|| / ||y64|| over the batch) for both pool dtypes,
and at the end the relative error of the state itself. CPU only (plain torch); runs in about a minute.
"""

import argparse
import datetime
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import throughput  # noqa: E402  (the benchmark shapes: throughput.MODELS)

from vllm_mamba2_plugin.kernels import reference  # noqa: E402

SHAPES = ("130m", "2.7b", "7b")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2.7b", choices=SHAPES)
    ap.add_argument("--steps", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--md", default=None, help="append the markdown table here")
    args = ap.parse_args()
    cfg = throughput.MODELS[args.shape]
    H, G, P, N = cfg["num_heads"], cfg["n_groups"], cfg["head_dim"], cfg["state_size"]
    Bsz, T = args.batch, args.steps
    g = torch.Generator().manual_seed(args.seed)
    A = -(1 + 15 * torch.rand(H, generator=g))
    dt0 = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * torch.rand(H, generator=g))
    dt_bias = dt0 + torch.log(-torch.expm1(-dt0))  # softplus^-1
    D = torch.randn(H, generator=g)
    idx = torch.arange(Bsz)
    pools = {name: torch.zeros(Bsz, H, P, N, dtype=dt) for name, dt in (("bf16", torch.bfloat16),
                                                                          ("fp32", torch.float32))}
    h64 = torch.zeros(Bsz, H, P, N, dtype=torch.float64)
    R = H // G
    checkpoints = sorted({1, 16, 64, 256, 1024, T} & set(range(1, T + 1)))
    rows = []
    for t in range(1, T + 1):
        x = torch.randn(Bsz, H, P, generator=g).bfloat16().float()  # bf16 values; y comes back in fp32
        dt_raw = (0.5 * torch.randn(Bsz, H, generator=g)).bfloat16()
        Bm = torch.randn(Bsz, G, N, generator=g).bfloat16()
        Cm = torch.randn(Bsz, G, N, generator=g).bfloat16()
        dt = reference.process_dt(dt_raw, dt_bias)  # float32, as both kernels compute it
        ys = {name: reference.ssm_state_update(pool, x, dt, A, Bm, Cm, idx, D=D) for name, pool in pools.items()}
        # The float64 oracle, written out (not the plugin's code): same inputs, no rounding of the state.
        d64 = dt.double()
        decay = torch.exp(d64 * A.double())  # (B, H)
        Bh = Bm.double().repeat_interleave(R, dim=1)  # (B, H, N): head h reads group h // R
        Ch = Cm.double().repeat_interleave(R, dim=1)
        h64 = decay[..., None, None] * h64 + (x.double() * d64[..., None])[..., None] * Bh[:, :, None, :]
        y64 = torch.einsum("bhpn,bhn->bhp", h64, Ch) + D.double()[None, :, None] * x.double()
        if t in checkpoints:
            rows.append((t, rel(ys["bf16"], y64), rel(ys["fp32"], y64)))
            print(f"step {t:5d}: y rel err  bf16 state {rows[-1][1]:.2e}  fp32 state {rows[-1][2]:.2e}", flush=True)
    st = {name: rel(pool, h64) for name, pool in pools.items()}
    print(f"final state rel err: bf16 {st['bf16']:.2e}  fp32 {st['fp32']:.2e}")

    lines = ["| step | y rel. err., bf16 state | y rel. err., fp32 state |", "|---|---|---|"]
    lines += [f"| {t} | {b:.2e} | {f:.2e} |" for t, b, f in rows]
    lines += [f"| state after {T} steps | {st['bf16']:.2e} | {st['fp32']:.2e} |"]
    table = "\n".join(lines)
    print(table)
    if args.md:
        with open(args.md, "a") as f:
            f.write(f"\n### SSM state dtype accuracy, {args.shape} layer ({H} heads), batch {Bsz}, {T} decode steps "
                    f"({datetime.date.today()}, CPU)\n\n`python benchmarks/state_dtype_accuracy.py --shape "
                    f"{args.shape} --steps {T} --batch {Bsz}`\n\n{table}\n")


if __name__ == "__main__":
    main()
