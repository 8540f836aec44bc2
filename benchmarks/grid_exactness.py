"""The model grid through an engine, plugin or vLLM's in-tree Mamba2, greedy against the float64 recurrence.

Not a speed benchmark: for each model of ``tiny_model.GRID`` (built under --model-dir), one fp32 engine serves
--prompts prompts twice, shuffled, some with n = 2, under chunked prefill (``tests/grid.py``: the same check as
the grid tests), and one JSON line reports the completions, the wrong ones (prompt length, position, the
recurrence's top-1 / top-2 margin there, got, want) and the near-ties (margin < 5e-3). Each model runs in its
own process (vLLM loads plugins once per process; the in-tree run sets VLLM_PLUGINS="").

    python benchmarks/grid_exactness.py --impl plugin --mode full --out grid.jsonl
    python benchmarks/grid_exactness.py --impl intree --mode eager --models n32g4,h64n128
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

MODES = ("full", "piecewise", "eager")


def run_one(args) -> dict:
    """In the child process: one engine on one grid model."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS"] = "0" if args.mode == "piecewise" else "1"
    if args.impl == "intree":
        os.environ["VLLM_PLUGINS"] = ""
    import torch
    from grid import divergences, grid_prompts, serve_twice
    from oracle import RecurrentMamba2
    from vllm import LLM

    from vllm_mamba2_plugin import tiny_model

    spec = tiny_model.GRID[args.models]
    model_dir = tiny_model.build(os.path.join(args.model_dir, args.models), spec)
    prompts = grid_prompts(spec.vocab_size, spec.chunk_size, args.prompts, seed=spec.seed, max_len=args.max_prompt)
    kw = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=args.budget, max_model_len=1024, seed=0,
              enforce_eager=args.mode == "eager")
    if torch.cuda.is_available():
        kw["gpu_memory_utilization"] = 0.1
        if args.mode != "eager":
            kw["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8]}
    llm = LLM(model=model_dir, **kw)
    model_class = llm.apply_model(lambda m: type(m).__name__)[0]
    got_prompts, got = serve_twice(llm, prompts, args.max_tokens, spec.seed)
    wrong, ties = divergences(RecurrentMamba2(model_dir), got_prompts, got, args.max_tokens)
    return dict(model=args.models, impl=args.impl, model_class=model_class, mode=args.mode,
                device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                completions=len(got), exact=len(got) - len(wrong) - ties, near_ties=ties, wrong=wrong)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=["plugin", "intree"], default="plugin")
    ap.add_argument("--mode", choices=MODES, default="full", help="full: FULL decode graphs (CUDA only)")
    ap.add_argument("--models", default="all", help="comma-separated names of tiny_model.GRID, or all")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-prompt", type=int, default=408)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--model-dir", default="/tmp/mamba2-grid")
    ap.add_argument("--out", default=None, help="append the JSON lines here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return
    from vllm_mamba2_plugin import tiny_model

    names = list(tiny_model.GRID) if args.models == "all" else args.models.split(",")
    for name in names:
        cmd = [sys.executable, __file__, "--child", "--models", name] + [
            a for k, v in vars(args).items() if k not in ("models", "child", "out") and v is not None
            for a in (f"--{k.replace('_', '-')}", str(v))]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        result = json.loads(lines[-1]) if lines else dict(model=name, impl=args.impl, mode=args.mode,
                                                           error=proc.stderr[-2000:])
        line = json.dumps(result)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
