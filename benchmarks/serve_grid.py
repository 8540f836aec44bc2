"""The model grid under the OpenAI server: ``scripts/serve_load.py`` on every grid model in every mode.

For each model of ``tiny_model.GRID`` (built under --model-dir) and each mode, one server (plugin, or vLLM's
in-tree Mamba2 with --impl intree) takes --requests streaming requests from --concurrency clients (random arrivals,
n = 2, disconnects; ``--bad-inputs``), every token checked against the float64 recurrence. One JSON line per
(model, mode): exact, wrong (with the oracle's margins), near-ties, failed requests, whether every bad input got
its 4xx, the start-up and load times, and serve_load's verdict. The server arguments are those of the fp32 grid
runs (``SERVER_ARGS``); modes: "full" (the default: FULL decode graphs), "piecewise" (the plugin's FULL decode
graphs off), "eager" (--enforce-eager). ``--speculative-config`` serves every model with speculative decoding,
``--prefix-caching`` with prefix caching (both: the two together).

    python benchmarks/serve_grid.py --impl plugin --modes full,piecewise,eager --out serve_grid.jsonl \
        --env MAMBA_DETERMINISTIC=1 --env TRITON_CACHE_AUTOTUNING=0    # on the GPU: one config per kernel
    python benchmarks/serve_grid.py --answers-only --answers-dir answers    # the oracle's answers, no server
    python benchmarks/serve_grid.py --parallel 6 --budget 560 ...    # six servers at a time on one GPU

``--parallel N`` runs N servers at once. Each then gets a fixed state pool (``--kv-cache-memory-bytes``), which
skips vLLM's memory profiling (a neighbour's start-up would skew it), and the memory-growth check reads its own
processes' GPU memory. Start-up is host-bound (imports, compiles): six at once on a 16-core host start in about
two minutes, twelve did not within four (benchmarks/RESULTS.md, Exactness). ``--budget`` fits a run into a device
call: past it no server starts, and every running one stops.

The oracle's answers depend only on the model and the workload: ``--answers-only`` computes them (on any
machine) into --answers-dir, where later runs with the same --requests and --seed find them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

from prefix_cache import emit  # noqa: E402  (one JSON line on stdout and in --out)

SERVER_ARGS = ["--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--max-model-len", "1024",
               "--skip-tokenizer-init", "--mamba-ssm-cache-dtype", "float32"]
SHARED_GPU_ARGS = ["--kv-cache-memory-bytes", str(1 << 30), "--gpu-memory-utilization", "0.05"]
MODES = {"full": ([], []), "piecewise": (["VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS=0"], []),
         "eager": ([], ["--enforce-eager"])}  # mode: (server environment, server arguments)


def serve_load_cmd(args, model_dir: str, answers: str, report: str, log: str, mode: str,
                   limit: float = 900) -> list:
    env, extra = MODES[mode]
    if args.impl == "intree":
        env = env + ["VLLM_PLUGINS="]
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "serve_load.py"), "--model", model_dir,
           "--requests", str(args.requests), "--concurrency", str(args.concurrency), "--seed", str(args.seed),
           "--answers", answers, "--out", report, "--log", log, "--start-timeout", str(limit * 0.8)]
    cmd += ["--bad-inputs"] if args.bad_inputs else []
    cmd += ["--gpu-memory-of", "server"] if args.parallel > 1 else []
    cmd += ["--answers-only"] if args.answers_only else []
    for e in env + args.env:
        cmd += ["--env", e]
    spec = ["--speculative-config", args.speculative_config] if args.speculative_config else []
    spec += ["--enable-prefix-caching"] if args.prefix_caching else []
    return cmd + ["--"] + SERVER_ARGS + extra + spec + (SHARED_GPU_ARGS if args.parallel > 1 else [])


def summary(report: dict) -> dict:
    bad = report.get("bad_inputs", [])
    m = report.get("metrics_after") or {}
    spec = {k: m[f"spec_decode_num_{k}_tokens_total"] for k in ("draft", "accepted")
            if f"spec_decode_num_{k}_tokens_total" in m}
    return dict(exact=report["exact"], wrong=report["wrong"], near_ties=len(report["near_ties"]),
                errors=len(report["errors"]), completed=report.get("completed"),
                disconnected=report.get("disconnected"),
                bad_inputs=len(bad), bad_inputs_ok=sum(400 <= b["status"] < 500 and b["names_problem"]
                                                       and b["next_request_exact"] for b in bad),
                healthy_after=report.get("healthy_after"), start_s=report.get("start_s"),
                load_s=report.get("load_s"), **({"spec_tokens": spec} if spec else {}))


_RUNNING: set = set()  # serve_load processes now running (one per server)


def stop_running(signum, frame) -> None:
    """On SIGTERM (a `timeout` around this script): SIGTERM to every serve_load, on which each stops its server."""
    for p in list(_RUNNING):
        p.terminate()
    for p in list(_RUNNING):
        p.wait(60)
    sys.exit(128 + signum)


def run_stopping_on_timeout(cmd: list, timeout: float) -> tuple[int, str, str]:
    """Run serve_load; past ``timeout`` stop it with SIGTERM, on which it stops its server (a SIGKILL would leave
    the server holding the GPU for the next run)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _RUNNING.add(p)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        err += f"\ntimed out after {timeout:.0f} s"
    finally:
        _RUNNING.discard(p)
    return p.returncode, out, err


def run(args, name: str, mode: str) -> dict:
    left = args.budget - (time.time() - args.t0)
    if not args.answers_only and left < args.min_run:
        return dict(model=name, impl=args.impl, mode=mode, requests=args.requests, rc=None,
                    verdict=f"not started: {left:.0f} s of --budget left, under --min-run {args.min_run:.0f} s")
    model_dir = os.path.join(args.model_dir, name)
    answers = os.path.join(args.answers_dir, f"{name}-r{args.requests}-s{args.seed}.json")
    if args.answers_only:
        subprocess.run(serve_load_cmd(args, model_dir, answers, "/dev/null", "/dev/null", mode), check=True)
        return dict(model=name, answers=answers)
    report_path = os.path.join(args.log_dir, f"{args.impl}-{name}-{mode}.json")
    log = os.path.join(args.log_dir, f"{args.impl}-{name}-{mode}.log")
    t0 = time.time()
    limit = min(args.timeout, left)
    rc, out, err = run_stopping_on_timeout(serve_load_cmd(args, model_dir, answers, report_path, log, mode, limit),
                                           limit)
    verdict = [ln for ln in out.splitlines() if ln.startswith("VERDICT")]
    row = dict(model=name, impl=args.impl, mode=mode, requests=args.requests, rc=rc,
               verdict=verdict[-1][8:] if verdict else err[-1500:], wall_s=round(time.time() - t0, 1))
    if os.path.exists(report_path):
        with open(report_path) as f:
            row.update(summary(json.load(f)))
    return row


def main() -> None:
    from vllm_mamba2_plugin import tiny_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=("plugin", "intree"), default="plugin")
    ap.add_argument("--models", default="all", help="comma list of tiny_model.GRID names, or all")
    ap.add_argument("--modes", default="full,piecewise,eager")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bad-inputs", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for every server's environment")
    ap.add_argument("--speculative-config", default=None,
                    help='JSON for every server\'s --speculative-config, e.g. \'{"method": "ngram", '
                         '"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}\'')
    ap.add_argument("--prefix-caching", action="store_true",
                    help="every server with --enable-prefix-caching (serve_load.py then also requires cache hits)")
    ap.add_argument("--model-dir", default="/tmp/grid-models")
    ap.add_argument("--answers-dir", default="/tmp/grid-answers")
    ap.add_argument("--answers-only", action="store_true")
    ap.add_argument("--log-dir", default="/tmp/serve-grid")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per server run")
    ap.add_argument("--out", default=None, help="append one JSON line per (model, mode)")
    ap.add_argument("--parallel", type=int, default=1, help="servers at a time")
    ap.add_argument("--budget", type=float, default=float("inf"),
                    help="seconds for the whole grid, counted from $GPU_TEST_T0 (the device call's start) if set: "
                         "every server stops by then, and none starts with less than --min-run left")
    ap.add_argument("--min-run", type=float, default=150)
    args = ap.parse_args()
    args.t0 = float(os.environ.get("GPU_TEST_T0", time.time()))
    for d in (args.model_dir, args.answers_dir, args.log_dir):
        os.makedirs(d, exist_ok=True)
    models = list(tiny_model.GRID) if args.models == "all" else args.models.split(",")
    for name in models:  # each built once, before the servers that read it
        tiny_model.build(os.path.join(args.model_dir, name), tiny_model.GRID[name])
    # Mode-major: one mode's servers start together, one per model, and a model's later modes find its Triton
    # kernels compiled (same-model servers at once would compile the same kernels side by side).
    modes = args.modes.split(",") if not args.answers_only else ["full"]
    jobs = [(name, mode) for mode in modes for name in models]
    signal.signal(signal.SIGTERM, stop_running)
    with concurrent.futures.ThreadPoolExecutor(max(1, args.parallel)) as pool:
        for done in concurrent.futures.as_completed([pool.submit(run, args, *job) for job in jobs]):
            emit(done.result(), args.out)


if __name__ == "__main__":
    main()
