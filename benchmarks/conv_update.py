"""The decode step's conv update, three ways, on the GPU: is a ring-buffer conv state worth it? (No.)

    python benchmarks/conv_update.py [--shapes 130m,2.7b,7b | grid] [--batches 1,64,256] [--out results.jsonl]

On the H200 the plugin's decode step spends ~1.9 ms of a 26 ms 7b batch-256 step in causal-conv1d's
``causal_conv1d_update`` against ~1 ms for vLLM's Triton conv update (RESULTS.md). causal-conv1d's
kernel shifts the (W-1)-row state left in place: per channel it loads a row, stores it one row up, loads the
next, ... (the compiler cannot hoist a load above a store that may alias), a chain of dependent memory
round trips. Given ``cache_seqlens`` it treats the state as a ring instead (causal_conv1d_update.cu:75-94): token
at position p lives in row p % (W-1), the W-1 loads are independent and only the new token is stored.

This times, per layer call (CUDA-graph replay of 20 calls), on the three benchmark shapes' conv_dim (bf16 x,
state and weights, silu, bias, slots scattered in a pool of 2*batch+1):
  linear  causal-conv1d update, state shifted in place (what the plugin does now)
  ring    causal-conv1d update with cache_seqlens = each row's position (the ring layout)
  intree  vLLM's Triton ``causal_conv1d_update`` (what vLLM's in-tree Mamba2 runs), if vLLM is importable
and checks that ring and in-tree give the linear path's output, and that the ring state holds the linear
state rotated by the position (all exact: the same products in the same order, or reported otherwise).

Answer on the H200 (RESULTS.md): ring is 1.01-1.17x linear (< 1 % of a decode step), vLLM's
Triton update 1.25-2.06x. The shift is not what makes causal-conv1d's update slow, so the plugin keeps
oldest-first states (a ring layout was built, measured with this script, and reverted).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ssu_launch import device_time_us, emit  # noqa: E402
from throughput import GRID, MODELS  # noqa: E402

W = 4
K = W - 1


def oldest_first_to_ring(states: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(B, K, D) states, oldest first, before positions ``pos`` -> ring order: the input of position q in row
    q % K (causal-conv1d's circular-buffer convention, causal_conv1d_interface.py:252-256)."""
    rows = (pos.long()[:, None] - K + torch.arange(K, device=states.device)[None, :]) % K  # row of the i-th oldest
    return torch.empty_like(states).scatter_(1, rows[:, :, None].expand(states.shape), states)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="130m,2.7b,7b")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from causal_conv1d import causal_conv1d_update

    try:
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update as intree_update
    except Exception as e:  # noqa: BLE001 - report and go on without the in-tree column
        print(f"vLLM's Triton conv update not importable ({e!r}): no intree rows", flush=True)
        intree_update = None
    dev = torch.device("cuda")
    out_f = open(args.out, "a") if args.out else None
    g = torch.Generator(device="cpu").manual_seed(0)
    for shape in GRID if args.shapes == "grid" else args.shapes.split(","):
        m = MODELS[shape]
        Dm = m["num_heads"] * m["head_dim"] + 2 * m["n_groups"] * m["state_size"]
        weight = (0.3 * torch.randn(Dm, W, generator=g)).to(dev, torch.bfloat16)
        bias = (0.1 * torch.randn(Dm, generator=g)).to(dev, torch.bfloat16)
        for bs in [int(b) for b in args.batches.split(",")]:
            slots = 2 * bs + 1
            pool0 = torch.randn(slots, K, Dm, generator=g).to(dev, torch.bfloat16)  # the plugin's (slot, K, D)
            idx = torch.randperm(slots - 1, generator=g)[:bs].add(1).to(dev, torch.int32)
            pos = torch.randint(3, 5000, (bs,), generator=g).to(dev, torch.int32)
            x = torch.randn(bs, Dm, generator=g).to(dev, torch.bfloat16)

            lin = pool0.clone()
            y_lin = causal_conv1d_update(x, lin.transpose(-1, -2), weight, bias, "silu", conv_state_indices=idx)
            ring0 = pool0.clone()
            ring0[idx.long()] = oldest_first_to_ring(pool0[idx.long()], pos)
            ring = ring0.clone()
            y_ring = causal_conv1d_update(x, ring.transpose(-1, -2), weight, bias, "silu", cache_seqlens=pos,
                                          conv_state_indices=idx)
            checks = {
                "ring_out_equal": torch.equal(y_ring, y_lin),
                "ring_state_equal": torch.equal(ring[idx.long()], oldest_first_to_ring(lin[idx.long()], pos + 1)),
            }
            runs = {
                "linear": lambda: causal_conv1d_update(x, lin.transpose(-1, -2), weight, bias, "silu",
                                                       conv_state_indices=idx),
                "ring": lambda: causal_conv1d_update(x, ring.transpose(-1, -2), weight, bias, "silu",
                                                     cache_seqlens=pos, conv_state_indices=idx),
            }
            if intree_update is not None:
                it = pool0.clone()
                y_it = intree_update(x, it.transpose(-1, -2), weight, bias, "silu", conv_state_indices=idx)
                checks["intree_out_max_abs_diff"] = (y_it.float() - y_lin.float()).abs().max().item()
                checks["intree_state_equal"] = torch.equal(it, lin)
                runs["intree"] = lambda: intree_update(x, it.transpose(-1, -2), weight, bias, "silu",
                                                       conv_state_indices=idx)
            base = None
            for name, fn in runs.items():
                us = device_time_us(fn)
                base = us if name == "linear" else base
                # Least traffic any layout needs: read K state rows, write one, read x, write out (bf16).
                gbs = bs * Dm * (K + 3) * 2 / (us * 1e-6) / 1e9
                row = dict(shape=shape, conv_dim=Dm, batch=bs, impl=name, us=round(us, 2), min_GBps=round(gbs),
                           speedup_vs_linear=round(base / us, 2), **checks)
                emit(row, out_f)


if __name__ == "__main__":
    main()
