"""Profile one engine's decode steps (or prefill steps) with torch.profiler (in-process engine core) and print
where time goes.

    python benchmarks/profile_decode.py --model 130m --batch 1 --mode graph [--impl intree]
    python benchmarks/profile_decode.py --model 130m --workload prefill [--impl intree]   # 16 x 4096, 1 new
    python benchmarks/profile_decode.py --model 130m --workload mixed [--impl intree]     # 256 x 512, 8 new
    python benchmarks/profile_decode.py --model 130m --batch 256 --workloads prefill,decode   # one engine, both

"mixed" profiles the start of the harness's batch-256 decode cell: 256 prompts of 512 tokens through an 8192-
token budget, so most steps carry prefill chunks (some resumed across steps) next to the first decodes.
Engine options follow the throughput harness (max_num_batched_tokens 8192).

Prints the top ops by self CPU time and by device time, and the measured step (or prefill) time.
"""

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the profiler must see the model's process
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import throughput  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="130m")
    ap.add_argument("--batch", type=int, default=1, help="decode batch")
    ap.add_argument("--mode", default="graph", choices=["graph", "eager"])
    ap.add_argument("--impl", default="plugin", choices=["plugin", "intree"])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--workload", "--workloads", dest="workloads", default="decode",
                    help="comma list of decode, prefill, mixed: all profiled through ONE engine (one start-up)")
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    unknown = set(workloads) - {"decode", "prefill", "mixed"}
    if unknown:
        ap.error(f"unknown workload(s) {sorted(unknown)}: use decode, prefill, mixed")
    if args.impl == "intree":
        os.environ["VLLM_PLUGINS"] = ""

    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir = throughput.write_config(args.model, tempfile.mkdtemp())
    batch_of = {"decode": args.batch, "prefill": throughput.PREFILL["batch"], "mixed": max(throughput.DECODE["batches"])}
    plen_of = {"decode": 64, "prefill": throughput.PREFILL["prompt"], "mixed": throughput.DECODE["prompt"]}
    max_seqs = max(batch_of[w] for w in workloads)
    kw = dict(model=model_dir, dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True,
              max_model_len=throughput.PREFILL["prompt"] + 16 if "prefill" in workloads else 1024,
              max_num_batched_tokens=8192, max_num_seqs=max_seqs, gpu_memory_utilization=0.85,
              enforce_eager=args.mode == "eager")
    if args.mode == "graph":
        kw["compilation_config"] = {"cudagraph_capture_sizes": sorted({1, args.batch} | (
            {batch_of["mixed"]} if "mixed" in workloads else set()))}
    llm = LLM(**kw)
    cuda = torch.cuda.is_available()  # the CPU runs this only as a smoke test of the script
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    for workload in workloads:
        batch, plen = batch_of[workload], plen_of[workload]
        prompts = [TokensPrompt(prompt_token_ids=[10 + (i * 7 + j) % 500 for j in range(plen)]) for i in range(batch)]

        def gen(n):
            sync()
            t = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False), use_tqdm=False)
            sync()
            return time.perf_counter() - t

        gen(4)
        if workload == "mixed":
            gen(8)
            print(f"{args.impl}/{args.mode} mixed {batch} x {plen}, 8 new: {gen(8) * 1e3:.1f} ms")
        elif workload == "prefill":
            gen(1)
            print(f"{args.impl}/{args.mode} prefill {batch} x {plen}: {gen(1) * 1e3:.1f} ms")
        else:
            t1, tn = gen(1), gen(1 + args.steps)
            print(f"{args.impl}/{args.mode} batch {batch}: decode step {(tn - t1) / args.steps * 1e3:.2f} ms")
        with profile(activities=activities) as prof:
            gen(8 if workload == "mixed" else 1 if workload == "prefill" else 1 + args.steps)
        ka = prof.key_averages()
        print(f"=== {args.impl} {workload}: top ops by self CPU time", flush=True)
        print(ka.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
        if cuda:
            print(f"=== {args.impl} {workload}: top ops by device time", flush=True)
            print(ka.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60),
                  flush=True)


if __name__ == "__main__":
    main()
