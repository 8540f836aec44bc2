"""The steps vLLM's scheduler makes for prefix_cache.py's workloads, and the prefill path the plugin takes in each.

    python benchmarks/schedule_steps.py --model 2.7b --workload misses          # caching off and on, vLLM 0.32
    PYTHONPATH=<an unpacked vLLM 0.26 wheel> python benchmarks/schedule_steps.py --model 2.7b    # 0.26, CPU too
    PYTHONPATH=<vllm-0.34.0.tar.gz unpacked> VLLM_MAMBA2_PLUGIN_UNVERIFIED_VLLM=1 python benchmarks/schedule_steps.py
    python benchmarks/schedule_steps.py --model 2.7b --caching on --vllm-cut     # vLLM's own "align" cut

No model and no GPU: vLLM's own ``Scheduler`` with the plugin's state spec and cache manager, fed the workload of
``prefix_cache.py`` (same seed, lengths and engine limits) and a stand-in model that samples one token whenever a
request has computed all its tokens. It answers "does caching change the steps?" in seconds, on either supported
vLLM: under another release, put its python sources (an unpacked wheel or sdist) first on PYTHONPATH; the script
then selects vLLM's CPU platform itself (their builds are not for this machine).

Each step's prefill block goes, in the order vLLM's runner puts it (sequences that continue a prompt, then fresh
prompts: ``reorder_batch_to_split_decodes_and_prefills``), through the plugin's own step planning
(``varlen_plan.build_plan`` and, with caching, ``add_boundaries``). Reported per run: steps, steps with prefill,
their prefill tokens, prefill sequences per step, how often each resume path of ``ssd_prefill`` is taken (none /
native / rows: ``varlen_plan.ResumePath``) and how often a resumed first sequence takes the packed call's own
state while others take row groups, the SSD forward calls per layer that implies, and the steps whose boundary
states need a second pass, and with ``--layouts N`` N of its prefill steps in ``prefill_layer.py``'s layout
syntax (to time them there). ``--vllm-cut`` shows the steps vLLM's own "align" cut would
make instead (chunks also stopped at each prompt's last block boundary; the plugin replaces it: patches.py, 4).
"""

import argparse
import dataclasses
import json
import os
import sys
import types
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import vllm  # noqa: E402

if "site-packages" not in vllm.__file__:  # another release's sources on PYTHONPATH: no build for this machine
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()
    import vllm.triton_utils

    vllm.triton_utils.HAS_TRITON = True  # 0.34's CPU platform refuses x86 without triton-cpu; no kernel runs here

from prefix_cache import add_workload_args, emit, workload_prompts  # noqa: E402  (the same workloads)
from throughput import write_config  # noqa: E402  (the shared model shapes)


def make_scheduler(model_dir: str, caching: bool, args):
    """vLLM's Scheduler as EngineCore builds it, with the plugin's spec and manager for every layer."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    import vllm_mamba2_plugin
    from vllm_mamba2_plugin import compat
    from vllm_mamba2_plugin.spec import Mamba2StateSpec, state_shapes

    vllm_mamba2_plugin.register()
    max_len = -(-(args.system + args.suffix_max + args.new + 16) // 128) * 128
    cfg = EngineArgs(model=model_dir, skip_tokenizer_init=True, load_format="dummy", max_model_len=max_len,
                     enable_prefix_caching=caching, max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens).create_engine_config()
    hf = cfg.model_config.hf_config
    spec = compat.make_state_spec(Mamba2StateSpec, shapes=state_shapes(hf),
                                  dtypes=compat.state_dtypes(cfg.model_config, cfg.cache_config),
                                  vllm_config=cfg, mamba_type=compat.plugin_mamba_type())
    layers = [f"backbone.layers.{i}.mixer" for i in range(hf.num_hidden_layers)]
    kv = KVCacheConfig(num_blocks=args.num_blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    cfg.cache_config.num_gpu_blocks = args.num_blocks
    cfg.cache_config.block_size = spec.block_size  # as EngineCore sets it: the groups' block
    block, hash_block = resolve_kv_cache_block_sizes(kv, cfg)
    sched = Scheduler(vllm_config=cfg, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(cfg),
                      block_size=block, hash_block_size=hash_block, log_stats=True)
    hasher = None
    if caching:
        from vllm.utils.hashing import get_hash_fn_by_name

        fn = get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
        init_none_hash(fn)
        hasher = get_request_block_hasher(hash_block, fn)
    if caching and args.vllm_cut:  # vLLM's own block-aligned cut, which the plugin's manager turned off
        cut = Scheduler._mamba_block_aligned_split
        sched._mamba_block_aligned_split = types.MethodType(getattr(cut, "__wrapped__", cut), sched)
    return sched, hasher, hf, spec.block_size if caching else 0


def prompts_of(args, vocab: int):
    """prefix_cache.py's workload: the cache-filling request, then the batch."""
    system, _, batch = workload_prompts(vars(args), vocab, torch.Generator().manual_seed(0))
    return [system + [5]], batch


def prefill_block(sched, out):
    """(computed, scheduled) of the step's prefill sequences, continuing ones first (vLLM's runner order)."""
    rows = []
    for rid, n in out.num_scheduled_tokens.items():
        req = sched.requests[rid]
        done = req.num_computed_tokens - n  # the scheduler has advanced it already
        if done < req.num_prompt_tokens and n > 1 or done == 0:
            rows.append((done, n))
    return sorted(rows, key=lambda r: r[0] == 0)


def plan_of(rows, chunk: int, block: int) -> dict:
    """The plugin's plan of one prefill block: resume path, SSD forward calls per layer, second pass."""
    from vllm_mamba2_plugin.kernels.cuda import varlen_plan

    cu = torch.tensor([0] + [n for _, n in rows]).cumsum(0)
    flags = torch.tensor([c > 0 for c, _ in rows])
    plan = varlen_plan.build_plan(cu, flags, True, int(cu[-1]), chunk, (), torch.device("cpu"))
    calls = plan.packed_call + len(plan.groups)
    second = False
    if block:
        offsets = [[(b + 1) * block - c for b in range(c // block, (c + n) // block)] for c, n in rows]
        varlen_plan.add_boundaries(plan, offsets)
        second = plan.boundary.rest is not None
    return dict(path=plan.path.value, first_native=plan.first_native, groups=len(plan.groups), calls=calls + second,
                second_pass=second)


def layout_of(decodes: int, rows) -> str:
    """A step in ``prefill_layer.py``'s layout syntax: "d<decode rows>", then "r<tokens>@<computed>" for a
    continued prompt and "<tokens>" for a fresh one, in the runner's order."""
    segments = ([f"d{decodes}"] if decodes else []) + [f"r{n}@{c}" if c else str(n) for c, n in rows]
    return "+".join(segments)


def run(sched, hasher, batch, tag, params, chunk, block):
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    for i, p in enumerate(batch):
        sched.add_request(Request(f"{tag}{i}", p, params, None, block_hasher=hasher))
    steps = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        rows = prefill_block(sched, out)
        if rows:
            steps.append(dict(tokens=out.total_num_scheduled_tokens, prefill=len(rows),
                              prefill_tokens=sum(n for _, n in rows), **plan_of(rows, chunk, block),
                              layout=layout_of(len(ids) - len(rows), rows)))
        elif ids:
            steps.append(dict(tokens=out.total_num_scheduled_tokens, prefill=0))
        done = [r for r in ids if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens]
        sampled = [[7] if r in done else [] for r in ids]
        result = dict(req_ids=ids, sampled_token_ids=sampled)
        if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:  # up to 0.33
            result["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
        sched.update_from_output(out, ModelRunnerOutput(**result))
    return steps


def summary(steps, caching: bool, args) -> dict:
    pre = [s for s in steps if s["prefill"]]
    return dict(vllm=vllm.__version__, model=args.model, workload=args.workload, caching=caching,
                vllm_cut=caching and args.vllm_cut, steps=len(steps),
                prefill_steps=len(pre), prefill_tokens=sum(s["prefill_tokens"] for s in pre),
                prefill_seqs_per_step=round(sum(s["prefill"] for s in pre) / max(len(pre), 1), 2),
                paths=dict(Counter(s["path"] for s in pre)),
                first_native_with_groups=sum(s["first_native"] and s["groups"] > 0 for s in pre),
                ssd_calls_per_layer=round(sum(s["calls"] for s in pre) / max(len(pre), 1), 2),
                second_pass_steps=sum(s["second_pass"] for s in pre),
                layouts=[pre[i * len(pre) // args.layouts]["layout"] for i in range(min(args.layouts, len(pre)))])


def measure(args) -> list:
    """One summary per caching mode of ``args.caching``."""
    from vllm import SamplingParams

    root = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"schedule_steps-{os.getpid()}")
    os.makedirs(root, exist_ok=True)
    model_dir = write_config(args.model, root)
    if args.chunk_size:
        path = os.path.join(model_dir, "config.json")
        cfg = dict(json.load(open(path)), chunk_size=args.chunk_size)
        json.dump(cfg, open(path, "w"))
    params = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    results = []
    for mode in args.caching.split(","):
        sched, hasher, hf, block = make_scheduler(model_dir, mode == "on", args)
        fill, batch = prompts_of(args, hf.vocab_size)
        run(sched, hasher, fill, "fill", params, hf.chunk_size, block)
        results.append(summary(run(sched, hasher, batch, "r", params, hf.chunk_size, block), mode == "on", args))
    return results


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="2.7b")
    ap.add_argument("--chunk-size", type=int, default=0, help="override the shape's SSD chunk (= the block)")
    add_workload_args(ap)
    ap.set_defaults(workload="misses")
    ap.add_argument("--caching", default="off,on")
    ap.add_argument("--num-blocks", type=int, default=4096, help="state blocks in the pool")
    ap.add_argument("--vllm-cut", action="store_true", help="with caching, let vLLM's scheduler cut prefill chunks "
                    "at block boundaries as its \"align\" mode does (the plugin turns that off: patches.py, 4)")
    ap.add_argument("--layouts", type=int, default=0, help="report N prefill steps spread evenly over the run "
                    "(lengths are random: steps seldom repeat), as prefill_layer.py layouts")
    ap.add_argument("--quiet", action="store_true", help="print only those layouts, comma-separated (the input "
                    "of prefill_layer.py --layouts)")
    ap.add_argument("--out", default=None, help="append one JSON line per run here")
    return ap


def main():
    args = parser().parse_args()
    results = measure(args)
    if args.quiet:
        print(",".join(dict.fromkeys(layout for r in results for layout in r["layouts"])))
        return
    for result in results:
        emit(result, args.out)


if __name__ == "__main__":
    main()
