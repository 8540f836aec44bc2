"""Many engine steps of one mixer layer, scheduled as a server schedules them, against each request run alone.

A small scheduler makes the batches a serving engine makes: requests arrive at random, take a state slot from the
pool (freed slots are handed out again at once, with their last owner's state left in them), are prefilled in
chunks under a token budget, decode one token a step and finish or are aborted mid-stream. Rows are ordered as
vLLM's V1 runner orders them (one-token rows first, in no particular order; fresh one-token prompts among them).
Every step goes through the real metadata builder and ``Mamba2Mixer.conv_ssm_forward``. Each request's outputs
must equal its tokens run alone, as one fresh prefill, through the reference kernels.

Two ways of running a step:
  * "eager": the mixer runs on the metadata the builder returned (eager steps, piecewise CUDA graphs).
  * "full-graph": as vLLM's runner with FULL decode graphs: a batch of one-token rows (fresh prompts included:
    the runner's dispatch looks at the shape only) is padded to a captured size and replayed, i.e. the decode
    kernels run on the builder's persistent slot buffer, whatever metadata the builder returned.

Backends as in conftest.py: "fake" (the CUDA wrappers over plain-torch stand-ins of the upstream kernels, CPU)
and "cuda" (the real kernels, marked gpu).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from cuda_helpers import kern  # noqa: F401  (fixtures)
from cuda_helpers import _mixer_layer, gen, grid_layer, rnd
from vllm_mamba2_plugin import backend as backend_mod
from vllm_mamba2_plugin import compat
from vllm_mamba2_plugin import mixer as mixer_mod
from vllm_mamba2_plugin.kernels import cuda as ck
from vllm_mamba2_plugin.kernels import reference as ref

CAPTURE_SIZES = (1, 2, 4, 8)


def _layer(dev, H=8, P=16, G=4, N=16, W=4, cs=16, seed=5):
    layer = _mixer_layer("sim.mixer", H, P, G, N, W, cs)
    g = gen(seed)
    with torch.no_grad():
        for _, p in layer.named_parameters():
            p.copy_(rnd(g, *p.shape, scale=0.3))
        layer.A.copy_(-torch.rand(H, generator=g) - 0.5)
        layer.dt_bias.copy_(torch.rand(H, generator=g) - 2.0)
    return layer.to(dev)


def _builder(layer, pools, dev, max_num_seqs):
    layer.kv_cache = pools
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(chunk_size=layer.chunk_size,
                                                               conv_kernel=layer.conv_kernel)),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs), speculative_config=None,
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=CAPTURE_SIZES[-1],
                                           static_forward_context={layer.prefix: layer}))
    return backend_mod.Mamba2PluginMetadataBuilder(None, [layer.prefix], cfg, dev)


def _common_metadata(rows, dev):
    """CommonAttentionMetadata of a step: rows of (query_len, context_len, slot)."""
    q = torch.tensor([r[0] for r in rows], dtype=torch.int32)
    ctx = torch.tensor([r[1] for r in rows], dtype=torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), q.cumsum(0).to(torch.int32)])
    table = torch.zeros(len(rows), 2, dtype=torch.int32)
    table[:, 0] = torch.tensor([r[2] for r in rows], dtype=torch.int32)
    return SimpleNamespace(num_reqs=len(rows), query_start_loc_cpu=qsl, seq_lens_cpu_upper_bound=q + ctx,
                           query_start_loc=qsl.to(dev), seq_lens=(q + ctx).to(dev), block_table_tensor=table.to(dev),
                           num_actual_tokens=int(qsl[-1]))


class Scheduler:
    """Requests of random lengths through a pool of slots, chunked prefill under a token budget."""

    def __init__(self, rng, num_requests, num_slots, max_num_seqs, budget, chunk, W):
        self.rng, self.budget, self.max_num_seqs = rng, budget, max_num_seqs
        short = list(range(1, max(W, 3)))  # fresh prompts shorter than the conv width, and of 2 tokens
        lengths = short + [1, 1, chunk - 1, chunk, chunk + 1, 3 * chunk + 2, 5 * chunk + 7]
        self.waiting = [dict(id=i, prompt=rng.choice(lengths) if rng.random() < 0.6 else rng.randint(1, 6 * chunk),
                             decode=rng.randint(1, 6), done=0, abort_at=rng.randint(1, 4) if rng.random() < 0.2
                             else None) for i in range(num_requests)]
        self.requests = list(self.waiting)
        self.free = list(range(1, num_slots))  # slot 0 is the null block
        self.running = []

    def total(self, r):
        return r["prompt"] + r["decode"]

    def step(self):
        """The rows of the next step, [(request, query_len)], or [] when everything has finished."""
        left, rows = self.budget, []
        for r in list(self.running):  # aborts arrive between steps; the slot goes back to the pool at once
            if r["abort_at"] is not None and r["done"] >= r["prompt"] + r["abort_at"]:
                self.running.remove(r)
                self.free.append(r["slot"])
        for r in self.running:
            n = min(self.total(r) - r["done"], 1 if r["done"] >= r["prompt"] else r["prompt"] - r["done"], left)
            if n > 0:
                rows.append((r, n))
                left -= n
        while self.waiting and left > 0 and len(self.running) < self.max_num_seqs and self.rng.random() < 0.7:
            r = self.waiting.pop(0)
            r["slot"] = self.free.pop(self.rng.randrange(len(self.free)))
            self.running.append(r)
            n = min(r["prompt"], left)
            rows.append((r, n))
            left -= n
        if not rows and self.waiting:
            return self.step()
        # V1 runner order: one-token rows first (in any order), then the rest.
        ones, rest = [x for x in rows if x[1] == 1], [x for x in rows if x[1] > 1]
        self.rng.shuffle(ones)
        self.rng.shuffle(rest)
        return ones + rest

    def finish(self, rows):
        for r, n in rows:
            r["done"] += n
            if r["done"] == self.total(r):
                self.running.remove(r)
                self.free.append(r["slot"])


def _run_step(layer, builder, rows, inputs, mode, dev, monkeypatch):
    """One engine step: returns the mixer's output rows (num_tokens, d_inner)."""
    common_rows = [(n, r["done"], r["slot"]) for r, n in rows]
    toks = torch.cat([inputs[r["id"]][r["done"]: r["done"] + n] for r, n in rows])
    uniform = all(n == 1 for _, n in rows) and len(rows) <= CAPTURE_SIZES[-1]
    if mode == "full-graph" and uniform:
        padded = next(s for s in CAPTURE_SIZES if s >= len(rows))
        common_rows += [(0, 0, 0)] * (padded - len(rows))  # the runner's padding rows: no tokens, the null block
        toks = torch.cat([toks, toks.new_zeros(padded - len(rows), toks.shape[1])])
    meta = builder.build(0, _common_metadata(common_rows, dev))
    if mode == "full-graph" and uniform:  # the replay: the captured decode kernels on the persistent buffers
        n = len(common_rows)
        meta = backend_mod.Mamba2PluginMetadata(
            num_decodes=n, num_decode_tokens=n, num_prefills=0, num_prefill_tokens=0, chunk_size=layer.chunk_size,
            state_indices_d=builder.graph_slots.slots[:n], state_indices_d_i32=builder.graph_slots.slots_i32[:n])
    monkeypatch.setattr(compat, "layer_metadata", lambda prefix: meta)
    out = torch.full((toks.shape[0], layer.d_inner), float("nan"), device=dev)
    layer.conv_ssm_forward(toks, out)
    return out[: sum(n for _, n in rows)]


def _alone(layer, tokens):
    """One request's tokens as one fresh prefill through the reference kernels, on fresh pools."""
    pools = tuple(torch.zeros(2, *shape, device=tokens.device) for shape in layer.get_state_shape())
    return layer.run_prefill_block(tokens, [tokens.shape[0]], [False], *pools, kernels=ref)


@pytest.mark.parametrize("mode", ["eager", "full-graph"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_served_steps_equal_each_request_alone(kern, mode, seed, monkeypatch):
    big = kern.name == "cuda"
    _serve_and_compare(kern, _layer(kern.dev, **(dict(H=8, P=32, G=4, N=16, cs=64) if big else {})), mode, seed,
                       monkeypatch)


@pytest.mark.parametrize("mode", ["eager", "full-graph"])
@pytest.mark.parametrize("name", ["n32g4", "h64n128", "n16g8", "h128n64", "n128g4", "n64g8w2"])
def test_grid_layers_served_steps_equal_each_request_alone(kern, name, mode, monkeypatch):
    """The model grid's layers (large step sizes, dt limits, every grid shape) through the same served steps."""
    _serve_and_compare(kern, grid_layer(name, kern.dev), mode, 7, monkeypatch)


def _serve_and_compare(kern, layer, mode, seed, monkeypatch):
    dev = kern.dev
    monkeypatch.setenv("VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS", "1" if mode == "full-graph" else "0")
    big = kern.name == "cuda"
    rng = random.Random(seed)
    num_slots, max_num_seqs = 12, 8
    sched = Scheduler(rng, 120 if big else 40, num_slots, max_num_seqs, budget=256 if big else 48,
                      chunk=layer.chunk_size, W=layer.conv_kernel)
    width = layer.projection_width
    g = gen(100 + seed)
    inputs = {r["id"]: rnd(g, sched.total(r), width).to(dev) for r in sched.requests}
    # Garbage in every slot: a slot is handed to a new request as its last owner left it.
    pools = tuple(torch.full((num_slots, *shape), float("nan"), device=dev) for shape in layer.get_state_shape())
    builder = _builder(layer, pools, dev, max_num_seqs)
    builder.kernels = ck
    outputs = {r["id"]: [] for r in sched.requests}
    kinds = set()
    monkeypatch.setattr(mixer_mod, "get_kernels", lambda d: ck)
    while True:
        rows = sched.step()
        if not rows:
            break
        out = _run_step(layer, builder, rows, inputs, mode, dev, monkeypatch)
        off = 0
        for r, n in rows:
            outputs[r["id"]].append(out[off: off + n])
            off += n
            kinds.add("fresh-1" if n == 1 and r["done"] == 0 else "short" if r["done"] == 0 and n < 3 else
                      "resumed" if 0 < r["done"] < r["prompt"] else "decode" if r["done"] >= r["prompt"] else "x")
        sched.finish(rows)
    assert {"fresh-1", "short", "resumed", "decode"} <= kinds
    # cuda: float32 kernels in another summation order. A stale or foreign state is off by O(1), or NaN; TF32
    # products in the SSD kernels (upstream.fp32_products_in_ieee) drift to ~1e-2 with the grid's step sizes.
    tol = 1e-3 if kern.name == "cuda" else 1e-4
    bad = []
    for r in sched.requests:
        got = torch.cat(outputs[r["id"]])
        want = _alone(layer, inputs[r["id"]][: got.shape[0]])
        err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
        if not err <= tol:  # NaN too: a stale or garbage state was read
            first = int(((got - want).abs().amax(-1) > tol * want.abs().max()).nonzero()[0, 0]) \
                if torch.isfinite(got).all() else -1
            bad.append((r["id"], r["prompt"], got.shape[0], first, round(err, 4)))
    assert not bad, (f"{len(bad)} of {len(sched.requests)} requests differ (id, prompt, tokens, first bad token, "
                     f"rel err): {bad[:8]}")
