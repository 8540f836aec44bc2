"""Prefix caching: many requests sharing a long system prompt, with and without the cache; plugin and in-tree.

    python benchmarks/prefix_cache.py --model 2.7b --out $OUT            # the H200 measurement
    python benchmarks/prefix_cache.py --model tiny --smoke                # the harness itself, on a CPU

One worker process per (implementation, caching mode), one after the other (vLLM loads plugins once per process;
in-tree runs with VLLM_PLUGINS=""). Models: random weights in the shapes of benchmarks/throughput.py. Workload:
a random system prompt of --system tokens; one request with it first (it fills the cache), then --requests
requests, each the system prompt and a unique suffix of --suffix-min..--suffix-max tokens, submitted at once,
greedy, --new tokens each (``--workload misses``: prompts of the same lengths sharing nothing, to measure what
caching costs when nothing hits; ``mixed``: every other request so, which mixes cache hits with long prompts in
the same steps). Reported per worker, over the batch: wall time, output and total tok/s, mean time
to first token (vLLM's histogram), start-up time, vLLM's prefix-cache counters (queries, hits) and preemptions, the
tokens each request took from cached states (``RequestOutput.num_cached_tokens``, summed: the hit share's
numerator, independent of the stats path) against the ideal (per sharing request the system prompt rounded down
to a block), the memory the cached states take (blocks holding a hash x bytes per block), the engine steps of the
batch (all, those with prefill tokens, wall time per step) and the Triton kernels compiled during it (a stall the
first engine of a device run to meet a kernel pays: compare modes run in both orders, or with none). Every
engine captures CUDA graphs for the same --capture-sizes.
Modes: "off" (no prefix caching), "on" (the plugin's, or in-tree's default mode), and for in-tree any of
--intree-modes (its ``mamba_cache_mode`` values, e.g. "align"; vLLM 0.26 also has "all"). A job's optional
third field sets vLLM's block size (``intree:on:256``): vLLM 0.26's in-tree "all" mode needs a multiple of the
chunk, since its mixer steps through chunk states block_size // chunk_size at a time (mamba_mixer2.py:883),
and with the default 16 that stride is 0 ("slice step cannot be zero").
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import write_config  # noqa: E402  (the shared model shapes)


def metric_totals(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions"):
            out[m.name] = out.get(m.name, 0) + m.value
        elif m.name == "vllm:time_to_first_token_seconds":
            count, total = out.get("ttft", (0, 0.0))
            out["ttft"] = (count + m.count, total + m.sum)
    return out


def cached_state_bytes(llm):
    """Blocks that hold a hash (cached states, in use or evictable) x bytes per block over all layers; None where
    this vLLM's internals differ (the engine must run in process: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    try:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        pool = sched.kv_cache_manager.block_pool
        cfg = sched.kv_cache_config
        per_block = sum(t.size for t in cfg.kv_cache_tensors) / cfg.num_blocks
        cached = sum(1 for b in pool.blocks if getattr(b, "block_hash", None) is not None)
        return int(cached * per_block)
    except Exception:  # another release's layout: not reported
        return None


def record_steps(llm):
    """A list that gets (scheduled tokens, requests) per non-empty step the scheduler makes from now on: whether a
    slower mode makes more steps or slower ones. None where this vLLM's internals differ (in process only)."""
    try:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
    except AttributeError:
        return None
    steps, schedule = [], sched.schedule

    def recorded(*args, **kwargs):
        out = schedule(*args, **kwargs)
        if out.total_num_scheduled_tokens:
            steps.append((out.total_num_scheduled_tokens, len(out.num_scheduled_tokens)))
        return out

    sched.schedule = recorded
    return steps


def record_compiles():
    """A list that gets the name of every Triton kernel this process compiles from now on (Triton's compile hook,
    as tests/kernels/cuda/test_warmup.py uses it): a compile during the timed batch is a stall the start-up
    warm-up should have taken, and it lands on whichever engine of a device run meets the kernel first. None
    without the hook."""
    try:
        from triton import knobs
    except ImportError:
        return None
    compiled, previous = [], knobs.runtime.jit_post_compile_hook

    def hook(**kw):
        compiled.append(getattr(kw.get("fn"), "name", "?"))
        return previous(**kw) if previous else None

    knobs.runtime.jit_post_compile_hook = hook
    return compiled


def workload_prompts(spec: dict, vocab: int, g):
    """(system prompt, suffix lengths, the batch's prompts) of a workload (``spec``: workload, requests, system,
    suffix_min, suffix_max), drawn from the generator ``g``; benchmarks/schedule_steps.py replays the same."""
    import torch

    system = torch.randint(3, vocab, (spec["system"],), generator=g).tolist()
    lens = torch.randint(spec["suffix_min"], spec["suffix_max"] + 1, (spec["requests"],), generator=g).tolist()
    return system, lens, draw_batch(spec["workload"], system, lens, vocab, g)


def draw_batch(workload: str, system: list, lens: list, vocab: int, g) -> list:
    """Each request the system prompt and a random suffix of its length; "misses": prompts of those lengths sharing
    nothing (what caching costs when nothing hits); "mixed": every other request so, from the first."""
    import torch

    prompts = [system + torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    for i in {"misses": range(len(prompts)), "mixed": range(0, len(prompts), 2)}.get(workload, ()):
        prompts[i] = torch.randint(3, vocab, (len(prompts[i]),), generator=g).tolist()
    return prompts


def sharing_requests(workload: str, requests: int) -> int:
    """The requests of a batch that share the system prompt."""
    return {"hits": requests, "mixed": requests // 2}.get(workload, 0)


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The workload's and the engine limits' options (benchmarks/schedule_steps.py takes the same)."""
    ap.add_argument("--workload", default="hits", choices=["hits", "misses", "mixed"],
                    help="hits: every request shares the system prompt; misses: the same lengths, nothing shared; "
                    "mixed: every other request shares it")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--system", type=int, default=2048)
    ap.add_argument("--suffix-min", type=int, default=64)
    ap.add_argument("--suffix-max", type=int, default=256)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)


def emit(result: dict, out) -> None:
    """A result as one JSON line on stdout, and appended to the file ``out`` when given."""
    print(json.dumps(result), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(result) + "\n")


def worker(job: dict) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    g = torch.Generator().manual_seed(0)
    vocab = job["vocab"]
    system, lens, prompts = workload_prompts(job, vocab, g)
    # A multiple of 128: vLLM 0.26's in-tree "all" mode sizes its FULL-graph decode buffer cdiv(max_model_len, 16)
    # blocks wide and copies the block table (rounded up to 8 columns) into it, so other lengths crash at capture.
    max_model_len = -(-(job["system"] + job["suffix_max"] + job["new"] + 16) // 128) * 128
    kwargs = dict(model=job["model_dir"], dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True,
                  max_model_len=max_model_len, seed=0,
                  max_num_seqs=job["max_num_seqs"], max_num_batched_tokens=job["max_num_batched_tokens"],
                  enable_prefix_caching=job["mode"] != "off", disable_log_stats=False)
    if job["mode"] not in ("off", "on"):
        kwargs["mamba_cache_mode"] = job["mode"]
    if job.get("block_size"):
        kwargs["block_size"] = job["block_size"]
    if job["profile_dir"]:  # vLLM's engine-core torch profiler (benchmarks/trace_steps.py reads its trace)
        kwargs["profiler_config"] = dict(profiler="torch", torch_profiler_dir=job["profile_dir"],
                                         torch_profiler_with_stack=False, ignore_frontend=True)
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = 0.85
        if job["capture_sizes"]:  # the same CUDA-graph sizes for every engine (fewer: a shorter start-up)
            kwargs["compilation_config"] = {"cudagraph_capture_sizes": job["capture_sizes"]}
    t_start = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - t_start
    params = SamplingParams(temperature=0.0, max_tokens=job["new"], ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=system + [5])], params, use_tqdm=False)  # fills the cache
    block = llm.llm_engine.vllm_config.cache_config.block_size
    before = metric_totals(llm)
    steps, compiled = record_steps(llm), record_compiles()
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    steps, compiled = (None if x is None else list(x) for x in (steps, compiled))
    after = metric_totals(llm)
    new_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    count = after.get("ttft", (0, 0.0))[0] - before.get("ttft", (0, 0.0))[0]
    total = after.get("ttft", (0, 0.0))[1] - before.get("ttft", (0, 0.0))[1]
    hits = after.get("vllm:prefix_cache_hits", 0) - before.get("vllm:prefix_cache_hits", 0)
    ideal = sharing_requests(job["workload"], len(prompts)) * (job["system"] // block * block)
    cached_tokens = sum(o.num_cached_tokens or 0 for o in outs)  # each request's own count: no stats path
    if job["profile_dir"]:  # the same workload with new suffixes (the timed ones are cached now), profiled
        again = draw_batch(job["workload"], system, lens, vocab, g)
        llm.start_profile()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in again], params, use_tqdm=False)
        llm.stop_profile()
    return dict(impl=job["impl"], mode=job["mode"], workload=job["workload"], block=block, startup_s=round(startup, 1),
                wall_s=round(wall, 3),
                output_tok_s=round(new_tokens / wall, 1),
                total_tok_s=round((new_tokens + sum(map(len, prompts))) / wall, 1),
                mean_ttft_ms=round(1000 * total / count, 2) if count else None,
                queries=after.get("vllm:prefix_cache_queries", 0) - before.get("vllm:prefix_cache_queries", 0),
                hits=hits, cached_tokens=cached_tokens, ideal_hits=ideal,
                hit_share_of_ideal=round(cached_tokens / ideal, 3) if ideal else None,
                preemptions=after.get("vllm:num_preemptions", 0) - before.get("vllm:num_preemptions", 0),
                cached_state_bytes=cached_state_bytes(llm),
                steps=None if steps is None else len(steps),
                prefill_steps=None if steps is None else sum(1 for t, r in steps if t > r),
                mean_step_ms=round(1000 * wall / len(steps), 2) if steps else None,
                compiles_in_batch=None if compiled is None else sorted(set(compiled)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="2.7b", help="a shape of benchmarks/throughput.py (MODELS)")
    ap.add_argument("--impls", default="plugin,intree")
    ap.add_argument("--modes", default="off,on", help="off, on (each implementation's default caching mode)")
    ap.add_argument("--intree-modes", default="", help="extra in-tree mamba_cache_mode values, e.g. align")
    ap.add_argument("--jobs", default="", help="impl:mode[:block size] in run order (instead of --impls/--modes), "
                    "e.g. plugin:off,plugin:on,intree:on:256,intree:align")
    ap.add_argument("--capture-sizes", default="1,2,4,8,16,32,64,128,256",
                    help="CUDA-graph capture sizes of every engine; empty: vLLM's default list")
    add_workload_args(ap)
    ap.add_argument("--profile", default=None, help="also profile a second batch (new suffixes) of every worker "
                    "into DIR/<impl>-<mode>[-b<block size>]/ (benchmarks/trace_steps.py reads it)")
    ap.add_argument("--logs", default=None, help="write each worker's output (vLLM's log: start-up phases, Triton "
                    "compiles during serving) to DIR/<impl>-<mode>[-b<block size>]-<workload>.log")
    ap.add_argument("--smoke", action="store_true", help="a tiny workload: checks the harness on a CPU")
    ap.add_argument("--out", default=None, help="append one JSON line per worker here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    if args.smoke:
        args.requests, args.system, args.suffix_min, args.suffix_max, args.new = 8, 40, 4, 12, 4
        args.max_num_seqs, args.max_num_batched_tokens = 8, 64
    from throughput import MODELS

    root = tempfile.mkdtemp()
    model_dir = write_config(args.model, root)
    if args.smoke:  # a chunk the tiny workload spans several times
        cfg_path = os.path.join(model_dir, "config.json")
        cfg = dict(json.load(open(cfg_path)), chunk_size=8)
        json.dump(cfg, open(cfg_path, "w"))
    jobs = [(impl, mode) for impl in args.impls.split(",") for mode in args.modes.split(",")]
    jobs += [("intree", m) for m in args.intree_modes.split(",") if m and "intree" in args.impls]
    if args.jobs:
        jobs = [tuple(j.split(":")) for j in args.jobs.split(",")]
    capture_sizes = [int(c) for c in args.capture_sizes.split(",") if c]
    for impl, mode, *block in jobs:
        block_size = int(block[0]) if block else None
        name = f"{impl}-{mode}" + (f"-b{block_size}" if block_size else "")
        job = dict(impl=impl, mode=mode, block_size=block_size, model_dir=model_dir,
                   vocab=MODELS[args.model]["vocab_size"],
                   capture_sizes=capture_sizes,
                   profile_dir=os.path.abspath(os.path.join(args.profile, name)) if args.profile else None,
                   **{k: getattr(args, k) for k in ("workload", "requests", "system", "suffix_min", "suffix_max", "new",
                                                     "max_num_seqs", "max_num_batched_tokens")})
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        if impl == "intree":
            env["VLLM_PLUGINS"] = ""
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], env=env,
                              capture_output=True, text=True)
        if args.logs:
            os.makedirs(args.logs, exist_ok=True)
            with open(os.path.join(args.logs, f"{name}-{args.workload}.log"), "w") as f:
                f.write(proc.stdout + proc.stderr)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        result = json.loads(lines[-1][7:]) if lines else dict(impl=impl, mode=mode, workload=args.workload,
                                                              error=proc.stderr[-2000:])
        result["block_size_arg"] = block_size
        result.update(model=args.model, command=" ".join(sys.argv))
        emit(result, args.out)


if __name__ == "__main__":
    main()
