"""One mixer layer's prefill path, without an engine: host time vs device time, and where the device time goes.

    python benchmarks/prefill_layer.py --model 130m --layouts 16x512,2x4096,16x512r --out $OUT/prefill_layer.jsonl
    python benchmarks/prefill_layer.py --model tiny --layouts 4x32,4x32r --device cpu     # smoke (reference kernels)
    python benchmarks/prefill_layer.py --model 130m --impls plugin,intree                 # + vLLM's own kernels (CUDA)
    python benchmarks/prefill_layer.py --model 2.7b --impls plugin,plugin-triton-launch   # FastLaunch A/B (CUDA)
    python benchmarks/prefill_layer.py --model 2.7b --layouts d33+r16+15x512+15 --host-profile  # a mixed step
    python benchmarks/prefill_layer.py --model 2.7b --layouts r1000+3x2200+16 --resume-context 1200 --block 256
                                                          # a prefix-caching step of cache misses (--block 0: off)
    python benchmarks/prefill_layer.py --model 2.7b --layouts "$(python benchmarks/schedule_steps.py --layouts 8 \
        --workload mixed --caching on --quiet | tail -1)" --block 256 --state-dtype bfloat16,float32
                                                          # steps of a workload (benchmarks/prefill_steps.sh)
    python benchmarks/prefill_layer.py --model 2048-48-p128-g8-n64 --layouts d240+r100+15x512+12 --device cpu \
        --kernels stub                                    # the CUDA path's own torch ops, on a CPU

Why: in the throughput harness the plugin prefills at ~0.5-0.6x in-tree vLLM (benchmarks/RESULTS.md), and an
8 192-token step of the 130m shape takes ~80 ms where a FLOP estimate of its GPU work is ~10 ms. An engine start
costs ~100 s of device time; this script measures the same per-layer work in seconds, so a change to the
prefill glue can be checked (and A/B'd) cheaply.

It runs the plugin's own code: a ``Mamba2Mixer`` of one layer of a real shape (``throughput.MODELS``) and
its ``conv_ssm_forward``, with metadata from the plugin's ``Mamba2PluginMetadataBuilder`` (whose ``build``
includes the step's prefill plan; its time is reported as build_us). With no engine there is no forward
context, so the one lookup the mixer makes in it (``compat.layer_metadata``) is answered with that metadata.
Layouts: "<S>x<L>" = S fresh prompts of L tokens packed together (T = S*L); a trailing "r" makes every other
prompt a resumed chunk (it starts from the state in its slot: a row group of ``ssd_prefill``); "r1" makes
only the first one resumed, as in a chunked-prefill step that continues the prompt the previous step cut (the
plugin hands that sequence's state to the packed kernel calls as their own initial state). Segments joined by "+"
make any step (``parse_layout``): "d<N>" decode rows first, "r<L>" one resumed chunk, "<L>" one fresh prompt, e.g.
"d33+r16+15x512+15", the mixed chunked-prefill step of the throughput harness's batch-64 cell (plugin only: the
in-tree runner has prefill rows only).

Reported per layout: host_us = CPU time to enqueue one layer (measured over ``--iters`` layers with no sync in
between), wall_us = wall time per layer with the GPU kept busy (sync after the loop), device breakdown per
kernel from torch.profiler, and the per-step estimate build_us + num_layers * wall_us. host_us close to wall_us means the
path is host-bound: the GPU waits for Python.

``--kernels stub`` runs the CUDA path's own code (the wrappers, plans, gathers, views) on the CPU, with mamba-ssm's
and causal-conv1d's entry points replaced by stubs that only allocate their outputs (``stub_kernels.py``): no GPU
needed. Its number is torch_ops, the torch operations a layer calls itself (not those nested in another), each of
which costs host time on the GPU too; the stubs stand in for the upstream wrappers' own ops with their output
allocations only. Its host time is not the GPU's: gathers and copies that are launches there move data here.

``--impls intree`` runs, on the same inputs and state pools, the kernel sequence vLLM's in-tree ``MambaMixer2``
runs for a prefill-only step (vllm/model_executor/layers/mamba/mamba_mixer2.py, conv_ssm_forward + its gated
norm): vLLM's Triton ``causal_conv1d_fn`` (in-place on the conv pool), ``mamba_chunk_scan_combined_varlen`` with
its chunk-aligned metadata and fused softplus(dt + dt_bias), the pool scatter, and ``rms_norm_gated``. Its chunk
and conv metadata come from vLLM's own helpers, built once outside the timed loop (as its metadata builder does
once per step). Both implementations' outputs and final states are also compared once (max abs difference),
from identical copies of the pools: the in-tree kernels are an independent oracle for the plugin's layer.
"""

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from types import SimpleNamespace
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import stub_kernels  # noqa: E402
import throughput  # noqa: E402

from vllm_mamba2_plugin import compat  # noqa: E402
from vllm_mamba2_plugin.backend import Mamba2PluginMetadataBuilder  # noqa: E402
from vllm_mamba2_plugin.mixer import Mamba2Mixer  # noqa: E402

CONV_WIDTH = 4
CHUNK = 256


def parse_layout(spec: str):
    """A layout -> (decode rows, prompt lengths, resumed: False, True (after --resume-context tokens) or the
    computed tokens). Segments joined by "+", in step order: "d<N>" N one-token decode rows (first: vLLM's runner
    puts decodes first), "<S>x<L>" S fresh prompts of L tokens ("...r": every other one resumed, "...r1": the first
    one resumed), "r<L>" one resumed chunk of L tokens ("r<L>@<C>": after C computed tokens; schedule_steps.py
    --layouts writes these), "<L>" one fresh prompt. E.g. "16x512r1", or "d33+r16+15x512+15" (a chunked-prefill
    mixed step of 8 192 tokens: 33 decode rows, the rest of a prompt the previous step cut, 15 prompts, the first
    15 tokens of another)."""
    nd, lengths, resumed = 0, [], []
    for i, seg in enumerate(spec.split("+")):
        if seg.startswith("d"):
            if i or not seg[1:].isdigit():
                raise SystemExit(f"layout {spec!r}: decode rows 'd<N>' come first, once")
            nd = int(seg[1:])
        elif seg.startswith("r") and seg[1:].partition("@")[0].isdigit():
            L, _, C = seg[1:].partition("@")
            if C and not C.isdigit():
                raise SystemExit(f"layout {spec!r}: bad segment {seg!r} (r<L> or r<L>@<computed tokens>)")
            lengths.append(int(L))
            resumed.append(int(C) if C else True)
        elif seg.isdigit():
            lengths.append(int(seg))
            resumed.append(False)
        elif "x" in seg:
            S_, _, rest = seg.partition("x")
            L, r, how = rest.partition("r")
            how = r + how
            if not (S_.isdigit() and L.isdigit()) or how not in ("", "r", "r1"):
                raise SystemExit(f"layout {spec!r}: bad segment {seg!r} (<S>x<L>, <S>x<L>r, <S>x<L>r1)")
            lengths += [int(L)] * int(S_)
            resumed += [(how == "r" and s % 2 == 1) or (how == "r1" and s == 0) for s in range(int(S_))]
        else:
            raise SystemExit(f"layout {spec!r}: bad segment {seg!r}")
    if not lengths:
        raise SystemExit(f"layout {spec!r} has no prompt (this benchmark is about prefill and mixed steps)")
    return nd, lengths, resumed


def make_layer(model: str, dtype, dev, seed=0) -> Mamba2Mixer:
    """One mixer layer of the model's shape with random weights (A, D, dt_bias float32, as the model loads them)."""
    c = throughput.MODELS[model]
    cfg = SimpleNamespace(hidden_size=c["hidden_size"], num_heads=c["num_heads"], head_dim=c["head_dim"],
                          n_groups=c["n_groups"], state_size=c["state_size"], conv_kernel=CONV_WIDTH, chunk_size=CHUNK,
                          layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True)
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # the layer registers itself in the config's forward context
        compat.init_single_rank_groups()  # the parallel linear layers read the TP group
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


def make_step(layer: Mamba2Mixer, nd, lengths, resumed, dtype, dev, seed=1, block=0, resume_context=7):
    """Inputs, state pools (host copies: every implementation starts from the same values) and scheduler-side
    metadata of one step: ``nd`` decode rows (one token each on a saved state), then the prompts, a resumed one
    after ``resume_context`` computed tokens. block > 0: prefix caching with blocks of that many tokens; each
    request then has a block per ``block`` tokens (``table``: (R, columns), distinct slots), its running state
    in the block of its last token, and the blocks of the boundaries its tokens cross keep their states."""
    g = torch.Generator().manual_seed(seed)
    S = len(lengths)
    R = nd + S  # requests
    T = nd + sum(lengths)
    n_proj = layer.projection_width
    qsl = torch.tensor([0] + [1] * nd + lengths).cumsum(0).to(torch.int32)
    context = torch.tensor([600] * nd + [(resume_context if r is True else int(r)) if r else 0 for r in resumed],
                           dtype=torch.int32)
    seq = context + qsl.diff()
    cols = int(((seq + block - 1) // block).max()) if block else 1
    slots_n = (R * cols if block else 2 * R) + 1
    pools = (torch.randn(slots_n, CONV_WIDTH - 1, layer.conv_dim, generator=g) * 0.1,
             torch.randn(slots_n, layer.num_heads, layer.head_dim, layer.state_size, generator=g) * 0.1)
    ids = torch.randperm(slots_n - 1, generator=g) + 1  # slot 0 is the null block
    table = torch.zeros(R, max(cols, 4), dtype=torch.int32)
    table[:, :cols] = ids[: R * cols].view(R, cols).to(torch.int32)
    running = (seq - 1).clamp(min=0) // block if block else torch.zeros(R, dtype=torch.int64)
    slots = table.gather(1, running.view(-1, 1).long()).view(-1).long()
    projected = torch.randn(T, n_proj, generator=g).to(dev, dtype)
    return dict(T=T, S=S, nd=nd, R=R, projected=projected, pools=pools, slots=slots, qsl=qsl, context=context,
                table=table, block=block)


def fresh_pools(step, dtype, dev, state_dtype=None):
    """Copies of the step's pools (layers write into them): conv states in the activations' dtype, SSM states in
    state_dtype (--state-dtype; default: the activations')."""
    conv, ssm = step["pools"]
    return [conv.to(dev, dtype, copy=True), ssm.to(dev, state_dtype or dtype, copy=True)]


def plugin_runner(layer: Mamba2Mixer, step, dev, holder):
    """The plugin's own path: the metadata builder once (timed), then ``conv_ssm_forward`` per call."""
    R, T, dtype = step["R"], step["T"], step["projected"].dtype
    table = step["table"]
    seq = step["context"] + step["qsl"].diff()
    qsl = step["qsl"]
    common = SimpleNamespace(num_reqs=R, query_start_loc_cpu=qsl, seq_lens_cpu_upper_bound=seq, seq_lens_cpu=seq,
                          query_start_loc=qsl.to(dev), seq_lens=seq.to(dev), block_table_tensor=table.to(dev),
                          num_actual_tokens=T)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(chunk_size=CHUNK, conv_kernel=CONV_WIDTH)),
        scheduler_config=SimpleNamespace(max_num_seqs=R), compilation_config=SimpleNamespace(), speculative_config=None)
    spec = SimpleNamespace(mamba_cache_mode="align", block_size=step["block"]) if step["block"] else None
    layer.prefix_caching = bool(step["block"])
    builder = Mamba2PluginMetadataBuilder(spec, [layer.prefix], vllm_config, dev)
    for _ in range(3):  # the last of three builds: the first pays one-time costs (pinned-memory set-up)
        t = time.perf_counter()
        meta = builder.build(0, common)
        build_us = (time.perf_counter() - t) * 1e6
    out = torch.empty(T, layer.d_inner, dtype=dtype, device=dev)

    def run():
        holder[0] = meta  # what the patched compat.layer_metadata answers
        layer.conv_ssm_forward(step["projected"], out)
        return out

    def first_layer():  # a step as the engine starts it: a fresh metadata build, then a layer planning from it
        holder[0] = builder.build(0, common)
        layer.conv_ssm_forward(step["projected"], out)
        return out

    run.build = lambda: builder.build(0, common)  # for --host-profile: where the per-step metadata build's time goes
    run.first_layer = first_layer  # for --host-profile's sync check: the per-step plans are built here, once
    return run, build_us


def plugin_triton_launch_runner(layer: Mamba2Mixer, step, dev, holder):
    """The plugin's path with every mamba-ssm Triton kernel launched through Triton's own ``Autotuner.run`` /
    ``Heuristics.run`` (as with VLLM_MAMBA2_PLUGIN_FAST_LAUNCH=0): the A/B of kernels/cuda/triton_launch.py in one
    process. Triton's objects go back to the call sites for the duration of each call (a few setattr, ~2 us)."""
    from vllm_mamba2_plugin.kernels.cuda import triton_launch as tl
    from vllm_mamba2_plugin.kernels.cuda import upstream

    k = upstream.kernels()
    run, build_us = plugin_runner(layer, step, dev, holder)

    def run_through_triton():
        with tl.triton_own_launch(k):
            return run()

    run_through_triton.build = run.build
    return run_through_triton, build_us


def intree_runner(layer: Mamba2Mixer, step, dev, holder):
    """vLLM's in-tree MambaMixer2 prefill kernels (vLLM 0.26 signatures) on the same weights, inputs and pools."""
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn
    from vllm.model_executor.layers.mamba.ops.layernorm_gated import rms_norm_gated
    from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen
    from vllm.v1.attention.backends.mamba_attn import BaseMambaAttentionMetadataBuilder
    from vllm.v1.attention.backends.utils import compute_causal_conv1d_metadata

    if step["nd"]:
        raise NotImplementedError("the in-tree runner has no decode rows (prefill-only layouts)")
    S, T = step["S"], step["T"]
    H, P = layer.num_heads, layer.head_dim
    t = time.perf_counter()
    cu_chunk, seq_idx, last_chunk = BaseMambaAttentionMetadataBuilder._compute_chunk_metadata(
        None, CHUNK, S, step["context"], step["qsl"])
    nums_dict, batch_ptr, offset_ptr = compute_causal_conv1d_metadata(step["qsl"], device=dev)
    i32 = dict(dtype=torch.int32, device=dev)
    cu_chunk, seq_idx, last_chunk = (torch.tensor(v, **i32) for v in (cu_chunk, seq_idx, last_chunk))
    conv_meta = SimpleNamespace(nums_dict=nums_dict, batch_ptr=batch_ptr, token_chunk_offset_ptr=offset_ptr)
    has_init = (step["context"] > 0).to(dev)
    any_init = bool((step["context"] > 0).any())
    idx = step["slots"].to(**i32)
    qsl = step["qsl"].to(dev)
    build_us = (time.perf_counter() - t) * 1e6
    w = layer.conv1d.weight.view(layer.conv_dim, CONV_WIDTH)
    y = torch.empty(T, layer.d_inner, dtype=step["projected"].dtype, device=dev)

    def run():
        conv_pool, ssm_pool = layer.kv_cache
        z, xBC, dt = layer._split_projection(step["projected"])
        xBC = causal_conv1d_fn(xBC.transpose(0, 1), w, layer.conv1d.bias, activation="silu",
                               conv_states=conv_pool.transpose(-1, -2), has_initial_state=has_init,
                               cache_indices=idx, metadata=conv_meta, query_start_loc=qsl).transpose(0, 1)[:T]
        x, B, C = layer._split_xbc(xBC)  # (T, H, P), (T, G, N), (T, G, N) views, as in-tree's .view calls
        init = torch.where(has_init[:, None, None, None], ssm_pool[idx], 0) if any_init else None
        states = mamba_chunk_scan_combined_varlen(
            x, dt, layer.A, B, C, chunk_size=CHUNK, D=layer.D, z=None,
            dt_bias=layer.dt_bias, seq_idx=seq_idx, cu_seqlens=qsl, cu_chunk_seqlens=cu_chunk,
            last_chunk_indices=last_chunk, initial_states=init, dt_softplus=True, dt_limit=(0.0, float("inf")),
            out=y.view(T, H, P), state_dtype=ssm_pool.dtype)
        ssm_pool[idx] = states
        return rms_norm_gated(y, layer.norm.weight, None, z=z, eps=layer.norm_eps, group_size=layer.norm_group_size,
                              norm_before_gate=False)

    return run, build_us


RUNNERS = {"plugin": plugin_runner, "plugin-triton-launch": plugin_triton_launch_runner, "intree": intree_runner}


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure(run, dev, iters: int, rows: int):
    for _ in range(3):  # compile / autotune outside the timed loops
        run()
    sync(dev)
    t = time.perf_counter()
    for _ in range(iters):
        run()
    host = (time.perf_counter() - t) / iters
    sync(dev)
    wall = (time.perf_counter() - t) / iters
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(iters):
            run()
        sync(dev)
    ka = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
    kernels = [(e.key[:70], round(e.self_device_time_total / iters, 1), e.count // iters) for e in ka
               if e.self_device_time_total > 0][:rows] if cuda else []
    # Where the host time goes (self CPU time per op; profiler overhead inflates all of them alike), and how many
    # torch ops the layer calls itself (not those nested inside another op).
    kc = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    host_ops = [(e.key[:70], round(e.self_cpu_time_total / iters, 1), e.count // iters) for e in kc][:rows]
    top_ops = sum(e.cpu_parent is None and e.name.startswith("aten::") for e in prof.events()) / iters
    return dict(host_us=host * 1e6, wall_us=wall * 1e6,
                device_us_per_layer=round(sum(k_[1] for k_ in kernels), 1) if kernels else None, kernels=kernels,
                host_ops=host_ops, torch_ops=top_ops)


def host_profile(run, dev, iters: int, rows: int) -> str:
    """Where one layer's host time goes. (1) Synchronising CUDA calls: a step's metadata build and first layer
    (which builds the step's plans; ``run.first_layer`` where the runner has one, else a layer) run once under
    torch's sync debug mode "error", which raises at the first operation that waits for the GPU: one would stall
    the host on the previous step's GPU work at every step, undoing the engine's overlap of the two; (2) cProfile
    of ``iters`` calls: Python functions by own and by cumulative time (cProfile's overhead inflates every call
    alike); (3) the same for the plugin's per-step metadata build."""
    import cProfile
    import pstats

    lines = []
    if dev.type == "cuda":
        sync(dev)
        torch.cuda.set_sync_debug_mode("error")
        first = getattr(run, "first_layer", None)
        try:
            (first or run)()
            lines.append("sync debug: no synchronising CUDA call in "
                         + ("a step's metadata build and first layer" if first else "one layer"))
        except RuntimeError:
            lines.append("sync debug: SYNCHRONISING CALL:\n" + "".join(traceback.format_exc().splitlines(True)[-14:]))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        sync(dev)
    parts = [("layer", run)] + ([("metadata build", run.build)] if hasattr(run, "build") else [])
    for what, fn in parts:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(iters):
            fn()
        prof.disable()
        sync(dev)
        stats = pstats.Stats(prof).stats  # (file, line, name) -> (prim calls, calls, own s, cumulative s, callers)
        for col, label in ((2, "own"), (3, "cumulative")):
            lines.append(f"cProfile of the {what}, per call, by {label} time: own us | cumulative us | calls | function")
            for (fn_, line, name), v in sorted(stats.items(), key=lambda kv: -kv[1][col])[:rows]:
                where = f"{os.path.basename(fn_)}:{line}({name})" if line else name
                lines.append(f"    {v[2] / iters * 1e6:8.1f} {v[3] / iters * 1e6:9.1f} {v[1] / iters:6.1f}  {where[:90]}")
    return "\n".join(lines)


def compare(layer, step, runs, dtype, dev, state_dtype=None):
    """One call of each implementation from identical pools: max |difference| of outputs and written states
    against the first implementation's."""
    results = {}
    slots = step["slots"].to(dev)
    for impl, run in runs.items():
        layer.kv_cache = fresh_pools(step, dtype, dev, state_dtype)
        out = run().float().clone()
        results[impl] = (out, layer.kv_cache[0][slots].float(), layer.kv_cache[1][slots].float())
    ref_impl, ref = next(iter(results.items()))
    diffs = {}
    for impl, got in list(results.items())[1:]:
        diffs[f"{impl}_vs_{ref_impl}"] = {name: round(float((a - b).abs().max()), 5) for name, a, b in
                                          zip(("out", "conv_state", "ssm_state"), got, ref)}
    diffs["out_scale"] = round(float(ref[0].abs().max()), 3)
    return diffs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="130m")
    ap.add_argument("--layouts", default="16x512,2x4096,16x512r")
    ap.add_argument("--impls", default="plugin", help="comma list of: " + ", ".join(RUNNERS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rows", type=int, default=15)
    ap.add_argument("--out", default=None, help="append one JSON line per layout and implementation")
    ap.add_argument("--block", type=int, default=0,
                    help="prefix caching with blocks of this many tokens (the plugin only; 0: off)")
    ap.add_argument("--resume-context", type=int, default=7, help="computed tokens before a resumed chunk")
    ap.add_argument("--state-dtype", default=None,
                    help="the SSM state pool's dtype, or a comma list run one after the other (default: --dtype)")
    ap.add_argument("--host-profile", action="store_true",
                    help="also: synchronising calls (CUDA) and a cProfile of the layer's Python host time")
    ap.add_argument("--kernels", choices=("device", "stub"), default="device",
                    help="stub (--device cpu, --impls plugin): the CUDA path's own code with the upstream kernels "
                         "replaced by stubs that only allocate their outputs (stub_kernels.py): its torch ops, counted "
                         "on a CPU")
    args = ap.parse_args()
    impls = args.impls.split(",")
    unknown = [i for i in impls if i not in RUNNERS]
    if unknown:
        ap.error(f"unknown implementation(s) {unknown}; choose from {list(RUNNERS)}")
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    state_dtypes = [getattr(torch, d) for d in args.state_dtype.split(",")] if args.state_dtype else [dtype]
    jobs = [(impl, RUNNERS[impl]) for impl in impls]
    if args.block and impls != ["plugin"]:
        ap.error("--block (prefix caching) runs the plugin's path only: --impls plugin")
    if "intree" in impls and dev.type != "cuda":
        ap.error("--impls intree runs vLLM's Triton kernels: it needs --device cuda")
    if args.kernels == "stub" and (dev.type != "cpu" or impls != ["plugin"]):
        ap.error("--kernels stub runs the plugin's CUDA path on the CPU: --device cpu --impls plugin")
    layer = make_layer(args.model, dtype, dev)
    if args.kernels == "stub":
        layer.norm_in_op = layer.whole_groups  # as on the GPU: the op runs the gated norm (a compiled CPU model not)
    layers = throughput.MODELS[args.model]["num_hidden_layers"]
    holder = [None]
    stubs = stub_kernels.installed() if args.kernels == "stub" else contextlib.nullcontext()
    # No engine, so no forward context: the mixer's one lookup in it answers with this step's metadata.
    with mock.patch.object(compat, "layer_metadata", lambda prefix: holder[0]), stubs:
        for state_dtype in state_dtypes:
            run_layouts(args, layer, layers, jobs, holder, dtype, dev, state_dtype)


def run_layouts(args, layer, layers, jobs, holder, dtype, dev, state_dtype):
    """Every layout of ``--layouts`` through every job, with SSM state pools of ``state_dtype``."""
    for spec in args.layouts.split(","):
        nd, lengths, resumed = parse_layout(spec)
        step = make_step(layer, nd, lengths, resumed, dtype, dev, block=args.block,
                         resume_context=args.resume_context)
        T, S = step["T"], step["S"]
        runs = {}
        for impl, runner in jobs:
            layer.kv_cache = fresh_pools(step, dtype, dev, state_dtype)
            try:  # one implementation failing (e.g. another vLLM release's signatures) must not hide the rest
                run, build_us = runner(layer, step, dev, holder)
                r = dict(model=args.model, impl=impl, layout=spec, tokens=T, sequences=S, decode_rows=nd,
                         resumed=sum(map(bool, resumed)), state_dtype=str(state_dtype).split(".")[-1],
                         device=str(dev), dtype=args.dtype, build_us=build_us,
                         **measure(run, dev, args.iters, args.rows))
            except Exception:
                traceback.print_exc()
                print(f"{args.model} {impl:>6} {spec:>9}: FAILED (traceback above)", flush=True)
                continue
            runs[impl] = run
            r["step_ms_estimate"] = (r["wall_us"] * layers + build_us) / 1e3
            print(f"{args.model} {impl:>6} {spec:>9} T={T}: metadata build {build_us:.0f} us | per layer: "
                  f"host {r['host_us']:.0f} us, wall {r['wall_us']:.0f} us, device {r['device_us_per_layer']} "
                  f"us, {r['torch_ops']:.0f} torch ops | x{layers} layers = {r['step_ms_estimate']:.1f} ms per step",
                  flush=True)
            for name, us, count in r["kernels"]:
                print(f"    {us:9.1f} us  x{count:<3} {name}")
            if r["host_ops"]:
                print("    host (self CPU time per layer, under the profiler):")
            for name, us, count in r["host_ops"]:
                print(f"    {us:9.1f} us  x{count:<3} {name}")
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
            if args.host_profile:
                print(f"{args.model} {impl:>6} {spec:>9} host profile:\n{host_profile(run, dev, args.iters, args.rows)}",
                      flush=True)
        if len(runs) > 1:
            diffs = compare(layer, step, runs, dtype, dev, state_dtype)
            print(f"{args.model} {spec:>9} max |difference| from identical pools: {json.dumps(diffs)}", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(dict(model=args.model, layout=spec, state_dtype=str(state_dtype).split(".")[-1],
                                           compare=diffs)) + "\n")


if __name__ == "__main__":
    with torch.no_grad():
        main()
