"""Throughput: the plugin and vLLM's in-tree Mamba2 side by side, same random-weight models, same workloads.

    python benchmarks/throughput.py --models 130m --modes graph,eager --out /tmp/bench
    python benchmarks/throughput.py --models 2.7b,7b --modes graph --out $OUT --md benchmarks/RESULTS.md
    python benchmarks/throughput.py --models 2.7b --modes eager --interleave --out $OUT   # host-bound cells
    MAMBA_DETERMINISTIC=1 python benchmarks/throughput.py --models grid --modes graph --workloads decode \
        --batches 1,256 --ssm-dtype auto,float32 --pack --out $OUT

One worker process per (model, implementation, mode) -- vLLM loads plugins once per process, so the plugin
(default environment) and in-tree (VLLM_PLUGINS="") need separate processes -- and every workload runs through
that one engine. By default the workers run one after the other. --interleave keeps every implementation's engine
alive (started one after the other, each with an equal share of the GPU memory) and runs each cell on all of them
in turn, alternating which goes first: host-bound cells (eager mode, mixed prefill steps) then compare runs a few
seconds apart instead of minutes apart. On the H200 the host's speed drifts by up to 2x between and within calls
(the same eager 2.7b batch-1 cell of the plugin: 47.5 ms per step in one call, 27.4 ms in the next).
--pack (GPU): every engine gets fixed state pools (the largest batch plus a few slots, ``kv_cache_memory_bytes``)
instead of a share of the memory it sees free, so engines can start at once; as many start together as their
weights, pools and a fixed overhead fit in the free GPU memory (``pack_groups``), and their cells then run one
engine at a time, interleaved as with --interleave. Start-up (compiles, mostly on the host) overlaps; the timed runs
do not. For the decode grid, whose per-shape start-ups (~2-3 min) dwarf its timed runs (~15 s per engine).
Weights are vLLM's dummy random init (load_format="dummy"); prompts are random token ids.
Implementations: ``plugin`` (defaults: in graph mode, FULL CUDA graphs for decode-only steps),
``plugin-piecewise`` (VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS=0: piecewise graphs only; graph mode only),
``plugin-jit-launch`` (VLLM_MAMBA2_PLUGIN_DIRECT_LAUNCH=0: every Triton launch through JITFunction.run),
``intree`` (vLLM's own Mamba2ForCausalLM). ``plugin-full`` is an old name of the default.

The decode grid runs with MAMBA_DETERMINISTIC=1 and TRITON_CACHE_AUTOTUNING=0 (recorded per row as
``mamba_deterministic``; vLLM sets the second to 1 where unset, which undoes the first): mamba-ssm then
uses one fixed config for each SSD prefill kernel instead of autotuning it at start-up (for a shape without
carried tunings, much of the plugin's start-up). No kernel of a decode step depends on it (the state update,
the gated norm and the conv update are not autotuned), so the engine's decode step is unchanged; the mixed
prefill steps are not what the grid measures.

Every cell first runs its exact workload once, untimed (prompt + a few new tokens, or the whole prefill cell):
Triton compiles a kernel per new integer specialisation (batch sizes, token counts), and a compile inside the
timed run would be charged to the decode steps.

Workloads: decode-heavy (prompt 512, 256 new tokens, batch 1 / 64 / 256) and prefill-heavy (prompt 4096,
1 new token, batch 16). Reported per cell: output tok/s and total tok/s over the whole generate() call, the
plugin / in-tree ratio of output tok/s, and for decode cells the share of the HBM floor:
    floor per decode step = (weight bytes + 2 * batch * state bytes) / measured copy bandwidth
    decode step           = (time(prompt + N new) - time(prompt + M new)) / (N - M),  N = 256, M = 32
The two runs share the same start (prompts longer than max_num_batched_tokens are prefilled in chunks, mixed
with the first requests' first decodes) and the same staggered finish, so their difference is N - M full-batch
decode steps. (Until 2026-12-02 the harness used M = 1, which charged the mixed prefill/decode steps of batches
64 and 256 to the decode steps; results before that say so.)
Results go out as JSON lines as they come (a run cut short still reports what finished).

The prefill cell runs once untimed and then ``PREFILL["repeats"]`` times timed: its tok/s come from the median
run (``runs_s`` lists all), its ``timeline.median_ms`` is the median engine step period over the timed runs
(shown in the step columns in parentheses), since one ~0.3 s run is within the host's noise. With --interleave
the timed runs alternate between the engines run by run (A B, B A, ...): at 2.7b with CUDA graphs the 8 192-token
prefill steps are host-bound (no graph that large), and the same engine's steps ranged 81-129 ms within one call.
``--prefill-repeats`` sets the number of timed runs. Interleaved, the table also gets the paired ratio: in-tree /
plugin time of each pair of runs that ran next to each other, and their geometric mean (each pair shares the
host's state of its moment; a ratio of medians mixes runs seconds apart).

Each decode cell also reports ``timeline``: the engine's own step periods during the timed run (``StepTimeline``:
engine-core timestamps of the steps' outputs, full-batch steps only; median, mean, p90, max, first and second
half), how far the front end lags behind, and the garbage collections (>= 0.2 ms) of the worker and the engine
core in that run; ``mid_timeline`` the same for the short run. The harness's step is a whole-run average; the
timeline says whether the engine's steps themselves are that long, or whether a few long ones (or a slow front
end) make the difference. ``engine_step_ms`` (the mean full-batch period) and ``floor_share_engine`` are the
decode step by the engine's clock; ``outside_full_batch_gap_ms`` is how much longer the long run's other steps
took than the short run's (``engine_step_stats``): the part of the harness's difference that is not decode.
The decode grid is judged on the engine's step, since its mixed steps (host-bound 8 192-token prefills)
vary by more between two runs than the decode steps do.

--profile: after a worker's timed cells (so they are not affected), vLLM's own torch profiler (engine-core process,
CPU + CUDA activity) records one decode run per batch of ``--profile-batch`` (default: the largest batch; prompt
512, ``PROFILE_NEW`` new tokens) and one prefill-heavy run; the gzipped chrome trace and vLLM's kernel table land
in <out>/profile-<model>-<impl>-<mode>/.
``benchmarks/trace_steps.py`` turns a trace into per-step host / device tables.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

MODELS = {
    "130m": dict(hidden_size=768, num_hidden_layers=24, num_heads=24, head_dim=64, n_groups=1, state_size=128,
                 vocab_size=50288),
    "2.7b": dict(hidden_size=2560, num_hidden_layers=64, num_heads=80, head_dim=64, n_groups=1, state_size=128,
                 vocab_size=50288),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32, n_groups=1, state_size=16,
                 vocab_size=512),  # --smoke only: checks the harness on a CPU
    "7b": dict(hidden_size=4096, num_hidden_layers=64, num_heads=128, head_dim=64, n_groups=8, state_size=128,
               vocab_size=32768),
    # The decode grid's other shapes (--models grid): head_dim 64 / 128, d_state 64 / 128, n_groups 1 / 4 / 8,
    # 24-64 layers. Named hidden-layers-head_dim-groups-state.
    "3072-48-p128-g4-n128": dict(hidden_size=3072, num_hidden_layers=48, num_heads=48, head_dim=128, n_groups=4,
                                 state_size=128, vocab_size=65536),
    "2048-48-p128-g8-n64": dict(hidden_size=2048, num_hidden_layers=48, num_heads=32, head_dim=128, n_groups=8,
                                state_size=64, vocab_size=32768),
    "1536-32-p64-g4-n64": dict(hidden_size=1536, num_hidden_layers=32, num_heads=48, head_dim=64, n_groups=4,
                               state_size=64, vocab_size=50288),
    "4096-32-p128-g1-n128": dict(hidden_size=4096, num_hidden_layers=32, num_heads=64, head_dim=128, n_groups=1,
                                 state_size=128, vocab_size=50288),
}
# --models grid: the shapes of the decode grid (run with --workloads decode --batches 256 --modes graph).
GRID = ["130m", "2.7b", "7b", "3072-48-p128-g4-n128", "2048-48-p128-g8-n64", "1536-32-p64-g4-n64",
        "4096-32-p128-g1-n128"]
DECODE = dict(prompt=512, new=256, mid=32, batches=[1, 64, 256])
PROFILE_NEW = 64  # new tokens in the profiled decode run: ~17 mixed steps, ~48 steady full-batch steps, the tail
PREFILL = dict(prompt=4096, new=1, batch=16, repeats=3)  # timed runs of the prefill cell: the median is reported
# The plugin's variants, each compared with "intree".
PLUGIN_IMPLS = ("plugin", "plugin-full", "plugin-piecewise", "plugin-jit-launch")


SMOKE_DECODE = dict(prompt=32, new=8, mid=4, batches=[1, 4])
SMOKE_PREFILL = dict(prompt=128, new=1, batch=2, repeats=2)


def engine_cells(batches, workloads, repeats) -> list:
    """One engine's cells in order: a decode cell per batch, then the prefill cell in parts (its untimed run, each
    timed run, the report). A sequential worker runs them itself; with --interleave the parent sends them one by
    one to every engine in turn, so the prefill cell's timed runs alternate between the engines run by run."""
    prefill = ["prefill-warm"] + ["prefill-run"] * repeats + ["prefill-report"]
    return ([dict(workload="decode", batch=b) for b in batches] if "decode" in workloads else []) + \
        ([dict(workload=part) for part in prefill] if "prefill" in workloads else [])


def sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def write_config(name: str, root: str) -> str:
    c = MODELS[name]
    path = os.path.join(root, f"mamba2-{name}-like")
    os.makedirs(path, exist_ok=True)
    # No time_step_limit: the released Mamba2 checkpoints have none, so HF's default (0, inf) applies.
    cfg = dict(architectures=["Mamba2ForCausalLM"], model_type="mamba2", expand=2, conv_kernel=4,
               chunk_size=256, use_bias=False, use_conv_bias=True, hidden_act="silu", layer_norm_epsilon=1e-5,
               rms_norm=True, residual_in_fp32=True, tie_word_embeddings=True,
               bos_token_id=0, eos_token_id=2, pad_token_id=1, torch_dtype="bfloat16", **c)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def bytes_per_step(name: str, batch: int, state_bytes: tuple[int, int]) -> tuple[int, int]:
    """(weight bytes read per decode step in bf16, state bytes per request)."""
    c = MODELS[name]
    d, L, H, P, G, N = (c[k] for k in ("hidden_size", "num_hidden_layers", "num_heads", "head_dim", "n_groups",
                                         "state_size"))
    d_inner = H * P
    conv_dim = d_inner + 2 * G * N
    per_layer = d * (2 * d_inner + 2 * G * N + H) + conv_dim * 5 + d_inner * d + d_inner + d + 3 * H
    weights = 2 * (L * per_layer + c["vocab_size"] * d + d)
    conv_b, ssm_b = state_bytes
    state = L * (3 * conv_dim * conv_b + H * P * N * ssm_b)
    return weights, state


def decode_bytes_by_kernel(name: str, batch: int, state_bytes: tuple[int, int], act_bytes: int = 2) -> dict:
    """The bytes one decode step of ``batch`` requests must move, by kernel family (``trace_steps.FAMILIES``): each
    request's conv and SSM state read and written, the step's activations in and out of those kernels, every
    weight read once by the GEMMs. conv state: (W-1, conv_dim) per layer; SSM state (H, P, N)."""
    c = MODELS[name]
    d, L, H, P, G, N = (c[k] for k in ("hidden_size", "num_hidden_layers", "num_heads", "head_dim", "n_groups",
                                         "state_size"))
    d_inner, W = H * P, 4
    conv_dim = d_inner + 2 * G * N
    conv_b, ssm_b = state_bytes
    proj = d * (2 * d_inner + 2 * G * N + H) + d_inner * d  # in_proj + out_proj
    return {
        "state update": L * batch * (2 * H * P * N * ssm_b + (2 * d_inner + 2 * G * N + H) * act_bytes),
        "conv update": L * batch * (2 * (W - 1) * conv_dim * conv_b + 2 * conv_dim * act_bytes),
        "gated norm": L * batch * 3 * d_inner * act_bytes,
        "GEMM": 2 * (L * proj + c["vocab_size"] * d),
    }


class StepTimeline:
    """Per-step times of one engine, seen from the front end: for each EngineCoreOutputs that arrives, the
    engine core's own timestamp (``EngineCoreOutputs.timestamp``, time.monotonic() in the engine-core process
    when the step's outputs were made; CLOCK_MONOTONIC is system-wide), the arrival time and the number of
    requests in it. The period between two engine timestamps is the engine's step time, host and GPU together.
    Garbage collections of the worker and of processes forked from it (the engine core) are logged by a gc
    callback into ``<dir>/gc-<pid>.log`` (collections >= 0.2 ms; the callback is inherited across fork)."""

    def __init__(self, llm, gc_dir: str):
        self.steps, self.gc_dir = [], gc_dir
        core = llm.llm_engine.engine_core
        get_output = core.get_output

        def timed_get_output():
            out = get_output()
            self.steps.append((out.timestamp, time.monotonic(), len(out.outputs)))
            return out

        core.get_output = timed_get_output

    @staticmethod
    def install_gc_probe(gc_dir: str) -> None:
        import gc

        os.makedirs(gc_dir, exist_ok=True)
        start = {}

        def probe(phase, info):
            if phase == "start":
                start["t"] = time.monotonic()
                return
            dt = time.monotonic() - start.get("t", time.monotonic())
            if dt >= 2e-4:
                with open(os.path.join(gc_dir, f"gc-{os.getpid()}.log"), "a") as f:
                    f.write(f"{start['t']:.6f} {dt:.6f} {info.get('generation')}\n")

        gc.callbacks.append(probe)

    def gc_between(self, t0: float, t1: float) -> dict:
        """{'pid': (total ms, longest ms, count)} of the logged collections that started in [t0, t1]."""
        res = {}
        for name in os.listdir(self.gc_dir):
            if not name.startswith("gc-"):
                continue
            pid = name[3:-4]
            ev = [tuple(map(float, line.split()))
                  for line in open(os.path.join(self.gc_dir, name)) if line.strip()]
            ev = [e for e in ev if t0 <= e[0] <= t1]
            if ev:
                res[pid] = (round(1e3 * sum(e[1] for e in ev), 2), round(1e3 * max(e[1] for e in ev), 2), len(ev))
        return res

    def summary(self, begin: int, batch: int, t0: float, t1: float) -> dict:
        """Step periods of the full-batch steps among the outputs from index ``begin`` on (one run)."""
        import statistics

        steps = self.steps[begin:]
        periods = [(b[0] - a[0]) * 1e3 for a, b in zip(steps, steps[1:]) if b[2] == batch and a[2] == batch]
        if not periods:
            return dict(steps=len(steps))
        half = len(periods) // 2
        q = sorted(periods)
        return dict(steps=len(steps), full_batch_periods=len(periods),
                    first_output_ms=round((steps[0][0] - t0) * 1e3, 2),
                    outside_full_batch_ms=round((steps[-1][0] - t0) * 1e3 - sum(periods), 2),
                    median_ms=round(statistics.median(periods), 3), mean_ms=round(statistics.fmean(periods), 3),
                    p90_ms=round(q[int(0.9 * (len(q) - 1))], 3), max_ms=round(q[-1], 3),
                    first_half_median_ms=round(statistics.median(periods[:half] or periods), 3),
                    second_half_median_ms=round(statistics.median(periods[half:]), 3),
                    front_lag_ms=round(1e3 * statistics.median(s[1] - s[0] for s in steps), 3),
                    gc=self.gc_between(t0, t1))


def worker(args) -> None:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(args.worker)
    global DECODE, PREFILL
    if job.get("smoke"):
        DECODE, PREFILL = SMOKE_DECODE, SMOKE_PREFILL
    if job.get("batches"):
        DECODE = dict(DECODE, batches=job["batches"])
    if job.get("prefill_repeats"):
        PREFILL = dict(PREFILL, repeats=job["prefill_repeats"])
    workloads = job.get("workloads") or ["decode", "prefill"]
    kwargs = dict(model=job["model_dir"], dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True,
                  max_model_len=PREFILL["prompt"] + 16, max_num_seqs=max(DECODE["batches"]),
                  max_num_batched_tokens=job["max_num_batched_tokens"],
                  mamba_ssm_cache_dtype=job["ssm_dtype"], seed=0, enforce_eager=job["mode"] == "eager")
    if torch.cuda.is_available():
        # --interleave: every implementation's engine is alive at once, so they share the GPU's memory.
        kwargs["gpu_memory_utilization"] = 0.85 / job.get("engines", 1)
    if job.get("kv_cache_memory_bytes"):
        # --pack: the engines of a group start at once, so none may size its pools from the memory it sees free
        # (a neighbour's start-up would count). With fixed pools vLLM skips that profiling; the utilisation is
        # then only its start-up check that this much memory is free.
        kwargs.update(kv_cache_memory_bytes=job["kv_cache_memory_bytes"], gpu_memory_utilization=0.05)
    if job["mode"] == "graph":
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": sorted(set(DECODE["batches"]))}
    if job.get("jit_verbose"):
        # vLLM's JIT monitor then logs each compile during serving with its signature and constexprs: which
        # specialisation the start-up warm-ups missed.
        kwargs["jit_monitor_verbose"] = True
    if job.get("profile_dir"):
        # Stack and shapes off: the trace stays a few MB. Front-end not profiled: the engine core is what runs
        # the model. Nothing is recorded until start_profile().
        kwargs["profiler_config"] = dict(profiler="torch", torch_profiler_dir=job["profile_dir"],
                                         torch_profiler_with_stack=False, ignore_frontend=True)
    gc_dir = os.path.join(job["out"], f"gc-{job['tag']}")
    StepTimeline.install_gc_probe(gc_dir)  # before LLM(): the forked engine core inherits it
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - t0
    timeline = StepTimeline(llm, gc_dir)
    # Which class serves the architecture, and the state dtypes it asked for (front-end view of the config).
    from vllm.model_executor.models import ModelRegistry

    vcfg = llm.llm_engine.vllm_config
    model_cls, _ = ModelRegistry.resolve_model_cls(vcfg.model_config.architectures, model_config=vcfg.model_config)
    cls = f"{model_cls.__module__}.{model_cls.__qualname__}"
    state_dtypes = [str(t) for t in model_cls.get_mamba_state_dtype_from_config(vcfg)]
    vocab = MODELS[job["model"]]["vocab_size"]
    g = torch.Generator().manual_seed(0)

    runs = []  # (batch, prompt, new, monotonic start, end, index of its first step in the timeline)

    def run(batch, prompt_len, new):
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(10, vocab - 1, (prompt_len,), generator=g).tolist())
                   for _ in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
        sync()
        begin, m0 = len(timeline.steps), time.monotonic()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync()
        el = time.perf_counter() - t
        runs.append((batch, prompt_len, new, m0, time.monotonic(), begin))
        # To the worker log as it happens: a call cut by its time limit still shows the runs that finished
        # (the interleaved prefill cell prints its RESULT only after its last run).
        print(f"run: batch {batch}, prompt {prompt_len}, new {new}: {el:.4f} s", flush=True)
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        return el, n_out, batch * prompt_len

    run(4, 64, 8)  # warm-up
    emit = dict(model=job["model"], impl=job["impl"], mode=job["mode"], model_class=cls, startup_s=startup,
                mamba_deterministic=os.environ.get("MAMBA_DETERMINISTIC", ""),
                ssm_cache_dtype=job["ssm_dtype"], state_dtypes=state_dtypes)

    def decode_cell(batch):
        run(batch, DECODE["prompt"], 4)  # warm-up: this batch's prefill shapes and decode batch size
        el_full, n_out, n_in = run(batch, DECODE["prompt"], DECODE["new"])
        steps = timeline.summary(runs[-1][5], batch, *runs[-1][3:5])
        el_mid, _, _ = run(batch, DECODE["prompt"], DECODE["mid"])
        mid_steps = timeline.summary(runs[-1][5], batch, *runs[-1][3:5])
        print("RESULT " + json.dumps(dict(emit, workload="decode", batch=batch, prompt=DECODE["prompt"],
                                          new=DECODE["new"], seconds=el_full, mid_new=DECODE["mid"], mid_seconds=el_mid,
                                          out_tok_s=n_out / el_full, total_tok_s=(n_out + n_in) / el_full,
                                          decode_step_s=(el_full - el_mid) / (DECODE["new"] - DECODE["mid"]),
                                          timeline=steps, mid_timeline=mid_steps)), flush=True)

    prefill_timed = []  # (seconds, outputs, inputs, index into runs) of the prefill cell's timed runs

    def prefill_run(timed=True):
        result = run(PREFILL["batch"], PREFILL["prompt"], PREFILL["new"])
        if timed:  # else the untimed warm-up run
            prefill_timed.append(result + (len(runs) - 1,))

    def prefill_report():
        import statistics

        timed = prefill_timed
        el = statistics.median(t[0] for t in timed)
        n_out, n_in = timed[0][1], timed[0][2]
        # Engine step periods inside the timed runs (8 192-token prefill steps, then one short last step).
        periods = []
        for r in (runs[t[3]] for t in timed):
            stamps = [st[0] for st in timeline.steps[r[5]:] if st[0] <= r[4]]
            periods += [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
        print("RESULT " + json.dumps(dict(emit, workload="prefill", batch=PREFILL["batch"], prompt=PREFILL["prompt"],
                                          new=PREFILL["new"], seconds=el, runs_s=[round(t[0], 4) for t in timed],
                                          out_tok_s=n_out / el, total_tok_s=(n_out + n_in) / el,
                                          timeline=dict(steps=len(periods) + len(timed),
                                                        median_ms=round(statistics.median(periods), 3)
                                                        if periods else None))), flush=True)

    handlers = {"decode": lambda cell: decode_cell(cell["batch"]), "prefill-warm": lambda _: prefill_run(timed=False),
                "prefill-run": lambda _: prefill_run(), "prefill-report": lambda _: prefill_report()}
    if job.get("interleave"):
        # The parent sends one cell of engine_cells at a time (a JSON line, or null to stop) and waits for this
        # worker's DONE before it sends that cell to the other implementation's worker (a prefill run is ~1 s,
        # and the host's speed moves within seconds).
        print("READY", flush=True)
        for line in sys.stdin:
            cell = json.loads(line)
            if cell is None:
                break
            handlers[cell["workload"]](cell)
            print("DONE", flush=True)
    else:
        for cell in engine_cells(DECODE["batches"], workloads, PREFILL["repeats"]):
            handlers[cell["workload"]](cell)
    # Raw timeline of every run (engine stamp, arrival, requests per step), for a closer look afterwards.
    with open(os.path.join(job["out"], f"timeline-{job['tag']}.json"), "w") as f:
        json.dump(dict(runs=runs, steps=timeline.steps), f)
    if job.get("profile_dir"):
        t = time.perf_counter()
        llm.start_profile()
        if "decode" in workloads:
            for batch in job.get("profile_batch") or [max(DECODE["batches"])]:
                run(batch, DECODE["prompt"], PROFILE_NEW)
        if "prefill" in workloads:
            run(PREFILL["batch"], PREFILL["prompt"], PREFILL["new"])
        llm.stop_profile()  # writes the trace (gzip) and the kernel table
        print(f"profiled in {time.perf_counter() - t:.1f} s -> {job['profile_dir']}", flush=True)


def copy_bandwidth() -> float:
    import torch

    if not torch.cuda.is_available():
        return float("nan")
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 10 / (time.perf_counter() - t)
    del x, y
    torch.cuda.empty_cache()
    return bw


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


def markdown(rows, bw, cmd) -> str:
    by = {(r["model"], r["mode"], r["workload"], r["batch"], r.get("ssm_cache_dtype", "auto"), r["impl"]): r
          for r in rows}
    lines = [f"### {datetime.date.today().isoformat()} — {device_name()}, bf16 weights, measured copy bandwidth "
             f"{bw / 1e12:.2f} TB/s", "", f"`{cmd}`", "",
             "| model | mode | workload | batch | ssm state | plugin variant | plugin out tok/s | in-tree out tok/s | "
             "ratio | plugin total tok/s | in-tree total tok/s | plugin step (engine median) | "
             "in-tree step (engine median) | "
             "plugin HBM-floor share | in-tree HBM-floor share | plugin step, engine mean (floor share) | "
             "in-tree step, engine mean (floor share) | step ratio (in-tree / plugin, engine means) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(r, field, fmt="{:.0f}"):
        return fmt.format(r[field]) if r and field in r else "—"

    def step(r):
        med = ((r or {}).get("timeline") or {}).get("median_ms")
        if r and r["workload"] == "prefill":  # no decode step: the engine's median prefill step alone
            return f"({med:.2f})" if med is not None else "—"
        return f(r, "decode_step_ms", "{:.2f} ms") + (f" ({med:.2f})" if med is not None else "")

    def engine(r):
        if not r or "engine_step_ms" not in r:
            return "—"
        return f"{r['engine_step_ms']:.2f} ms ({r['floor_share_engine']:.0%})"

    def step_ratio(p, t):
        if not (p and t and "engine_step_ms" in p and "engine_step_ms" in t):
            return "—"
        return f"{t['engine_step_ms'] / p['engine_step_ms']:.2f}"

    for key in sorted({k[:5] for k in by}, key=lambda k: (list(MODELS).index(k[0]), k[4], k[1], k[2], k[3])):
        t = by.get(key + ("intree",))
        variants = [v for v in PLUGIN_IMPLS if key + (v,) in by] or [None]
        for v in variants:
            p = by.get(key + (v,)) if v else None
            ratio = f"{p['out_tok_s'] / t['out_tok_s']:.2f}" if p and t else "—"
            sd = (p or t)["state_dtypes"]
            lines.append(
                f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {sd[1] if len(sd) > 1 else '?'} | {v or '—'} | "
                f"{f(p, 'out_tok_s')} | {f(t, 'out_tok_s')} | {ratio} | {f(p, 'total_tok_s')} | "
                f"{f(t, 'total_tok_s')} | {step(p)} | {step(t)} | {f(p, 'floor_share', '{:.0%}')} | "
                f"{f(t, 'floor_share', '{:.0%}')} | {engine(p)} | {engine(t)} | {step_ratio(p, t)} |")
    notes = [f"- {r['model']} {r['mode']} prefill, timed runs paired as they ran (each plugin run next to an in-tree "
             f"run): in-tree / plugin run time, geometric mean **{r['paired_ratio']:.2f}** over {r['pairs']} pairs "
             f"(per pair: {' / '.join(f'{x:.2f}' for x in r['pair_ratios'])})"
             for r in rows if r.get("paired_ratio") is not None]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def grid_table(rows) -> str:
    """The decode grid's table (``--grid-table``): per model, state dtype and batch, both implementations' output
    tok/s and engine median steps, and each one's share of the HBM floor by its engine median."""
    by = {(r["model"], r.get("ssm_cache_dtype", "auto"), r["batch"], r["impl"]): r
          for r in rows if r["workload"] == "decode"}
    lines = ["| model | ssm state | batch | out tok/s, plugin / in-tree (ratio) | step, engine median: plugin / "
             "in-tree (ratio) | floor | HBM-floor share, plugin / in-tree |", "|---|---|---|---|---|---|---|"]
    for key in sorted({k[:3] for k in by}, key=lambda k: (list(MODELS).index(k[0]), k[1], k[2])):
        p, t = by.get(key + ("plugin",)), by.get(key + ("intree",))
        if not (p and t):
            continue
        pm, tm = p["timeline"]["median_ms"], t["timeline"]["median_ms"]
        floor = 1e3 * p["floor_step_s"]
        lines.append(f"| {key[0]} | {'fp32' if key[1] == 'float32' else 'bf16'} | {key[2]} | "
                     f"{p['out_tok_s']:,.0f} / {t['out_tok_s']:,.0f} ({p['out_tok_s'] / t['out_tok_s']:.2f}) | "
                     f"{pm:.2f} / {tm:.2f} ms ({tm / pm:.2f}) | {floor:.2f} ms | {floor / pm:.0%} / {floor / tm:.0%} |")
    return "\n".join(lines) + "\n"


def engine_step_stats(r: dict, floor_step_s: float) -> dict:
    """The decode step by the engine's own clock: the mean period of the full-batch steps of the long run, its
    share of the HBM floor, and how much longer the long run's steps outside the full batch (the mixed prefill
    steps, the staggered finish) took than the short run's. Both runs have the same such steps, so
    ``decode_step_s`` = (n_long * mean_long - n_short * mean_short + gap) / (new - mid), n being each run's
    full-batch periods; with equal means, mean + gap / (new - mid). A gap well above zero means host noise in the
    mixed steps (host-bound, no graph that large) is charged to the harness's decode step."""
    full, mid = r.get("timeline") or {}, r.get("mid_timeline") or {}
    if not full.get("mean_ms"):
        return {}
    out = dict(engine_step_ms=full["mean_ms"], floor_share_engine=floor_step_s / (full["mean_ms"] / 1e3))
    if "outside_full_batch_ms" in full and "outside_full_batch_ms" in mid:
        out["outside_full_batch_gap_ms"] = round(full["outside_full_batch_ms"] - mid["outside_full_batch_ms"], 2)
    return out


def paired_prefill_ratio(plugin_runs, intree_runs):
    """In-tree / plugin time of each pair of timed prefill runs that ran next to each other (--interleave: run k
    of one engine, then run k of the other), and their geometric mean. A ratio of medians mixes runs that are
    seconds apart, and the host's speed moves within seconds (on the H200 one engine's runs
    0.80-1.35 s); each pair shares the host's state of its moment."""
    import math

    ratios = [t / p for p, t in zip(plugin_runs, intree_runs)]
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else None, ratios


class Worker:
    """One worker process (one engine): its log file, and the RESULT / READY / DONE lines of its stdout."""

    def __init__(self, job, env):
        self.job, self.name = job, job["tag"]
        self.log = open(os.path.join(job["out"], f"worker-{job['tag']}.log"), "w")
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(job)], env=env,
                                     stdin=subprocess.PIPE if job.get("interleave") else None,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def read(self, on_result, until=None) -> bool:
        """Read the worker's stdout until the line ``until`` (READY / DONE; None: to its end): RESULT lines go to
        on_result, everything else to its log (vLLM logs to stdout). False if the worker ended first."""
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                on_result(line)
            elif until is not None and line.strip() == until:
                return True
            else:
                self.log.write(line)
                self.log.flush()
        self.finish()
        return False

    def send(self, cell) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps(cell) + "\n")
            self.proc.stdin.flush()

    def finish(self) -> None:
        if self.proc.stdin:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        for line in self.proc.stdout:
            self.log.write(line)
        self.proc.wait()
        self.log.close()
        if self.proc.returncode:
            print(f"worker {self.name} exited {self.proc.returncode}", flush=True)


ENV_OF_IMPL = {"intree": {"VLLM_PLUGINS": ""},  # no plugin at all: vLLM's own Mamba2ForCausalLM
               "plugin-full": {"VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS": "1"},
               "plugin-piecewise": {"VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS": "0"},
               "plugin-jit-launch": {"VLLM_MAMBA2_PLUGIN_DIRECT_LAUNCH": "0"}}
DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}
PACK_SLOTS = 8  # state slots beyond the largest batch (vLLM's null block, and headroom)
PACK_OVERHEAD = 3 * 1024**3  # per engine beyond weights and pools: CUDA context, activations, graphs
PACK_FILL = 0.92  # share of the free GPU memory a group may plan to use


def unit_of(job) -> tuple:
    """The engines whose cells compare: one (model, state dtype, mode), one engine per implementation."""
    return job["model"], job["ssm_dtype"], job["mode"]


def engine_memory(job) -> int:
    """--pack: the bytes one engine is planned to hold: weights, its fixed state pools, overhead."""
    weights, _ = bytes_per_step(job["model"], 1, (2, DTYPE_BYTES[job["ssm_dtype"]]))
    return weights + job["kv_cache_memory_bytes"] + PACK_OVERHEAD


def pack_groups(jobs: list, capacity: int) -> list:
    """--pack: the engines in groups that start together, first fit by planned memory, largest first (fewest
    groups, fewest start-ups); the engines of one (model, state dtype, mode) stay in one group where they fit
    together, so their cells interleave."""
    units, groups = {}, []
    for job in jobs:
        units.setdefault(unit_of(job), []).append(job)
    for unit in sorted(units.values(), key=lambda u: -sum(map(engine_memory, u))):
        # a unit too large for one group runs one engine per group
        for part in ([unit] if sum(map(engine_memory, unit)) <= capacity else [[j] for j in unit]):
            need = sum(map(engine_memory, part))
            for g in groups:
                if g["bytes"] + need <= capacity:
                    g["jobs"] += part
                    g["bytes"] += need
                    break
            else:
                groups.append(dict(jobs=list(part), bytes=need))
    return [g["jobs"] for g in groups]


def run_cells(workers: list, cells: list, record) -> None:
    """Each cell on every worker in turn (--interleave, --pack), alternating which goes first, so neither is
    always the one after a long idle."""
    for i, cell in enumerate(cells if workers else []):
        for w in list(workers if i % 2 == 0 else workers[::-1]):
            w.send(cell)
            if not w.read(record, until="DONE"):
                workers.remove(w)  # it ended (crashed): the others go on


def add_paired_prefill(rows: list, unit: tuple) -> None:
    mine = {r["impl"]: r for r in rows if (r["model"], r["ssm_cache_dtype"], r["mode"]) == unit
            and r["workload"] == "prefill"}
    for impl in PLUGIN_IMPLS:
        if impl in mine and "intree" in mine:
            g, ratios = paired_prefill_ratio(mine[impl]["runs_s"], mine["intree"]["runs_s"])
            mine[impl].update(paired_ratio=g, pairs=len(ratios), pair_ratios=[round(x, 3) for x in ratios])
            print(f"{'/'.join(unit)}/{impl} prefill, paired runs: in-tree / plugin geometric mean {g:.3f} "
                  f"({len(ratios)} pairs)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="130m",
                    help=f"comma-separated names of MODELS, or grid ({', '.join(GRID)}); name:dtype gives that "
                         "model only this --ssm-dtype")
    ap.add_argument("--impls", default="plugin,intree", help="plugin, plugin-piecewise, plugin-jit-launch, intree")
    ap.add_argument("--modes", default="graph,eager")
    ap.add_argument("--ssm-dtype", default="auto",
                    help="--mamba-ssm-cache-dtype for both implementations; comma-separated: an engine per dtype")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="mamba2-bench-"))
    ap.add_argument("--md", default=None, help="append the markdown table here")
    ap.add_argument("--batches", default=None, help="decode batch sizes (default 1,64,256; also the capture sizes)")
    ap.add_argument("--workloads", default="decode,prefill", help="decode, prefill or both")
    ap.add_argument("--profile", action="store_true", help="also record a torch-profiler trace per worker")
    ap.add_argument("--profile-batch", default=None,
                    help="batch(es) of the profiled decode run(s), comma-separated (default: the largest of --batches)")
    ap.add_argument("--jit-verbose", action="store_true",
                    help="vLLM's JIT monitor logs each compile during serving with its signature (worker logs)")
    ap.add_argument("--interleave", action="store_true",
                    help="keep every implementation's engine alive and run each cell on all of them in turn "
                         "(host-bound cells, e.g. eager mode: the host's speed drifts over minutes)")
    ap.add_argument("--pack", action="store_true",
                    help="start as many engines at once as their fixed state pools fit in the GPU's memory, then "
                         "time one engine at a time (interleaved as --interleave): start-ups overlap")
    ap.add_argument("--prefill-repeats", type=int, default=None,
                    help=f"timed runs of the prefill cell (default {PREFILL['repeats']}); the median is reported")
    ap.add_argument("--smoke", action="store_true", help="tiny workloads, to check the harness on a CPU")
    ap.add_argument("--grid-table", nargs="+", metavar="JSONL",
                    help="print the decode grid's table from these bench.jsonl files, and run nothing")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.grid_table:
        return print(grid_table([json.loads(line) for f in args.grid_table for line in open(f) if line.strip()]))

    impls, workloads = args.impls.split(","), args.workloads.split(",")
    unknown = set(workloads) - {"decode", "prefill"}
    if unknown:
        raise SystemExit(f"unknown workload(s) {sorted(unknown)}: use decode, prefill or both")
    for impl in impls:
        if impl not in PLUGIN_IMPLS + ("intree",):
            raise SystemExit(f"unknown implementation {impl!r}: "
                             "use plugin, plugin-piecewise, plugin-jit-launch or intree")
    dtypes = args.ssm_dtype.split(",")
    if set(dtypes + [m.partition(":")[2] for m in args.models.split(",") if ":" in m]) - set(DTYPE_BYTES):
        raise SystemExit(f"unknown state dtype in {args.ssm_dtype!r} / {args.models!r}: use {', '.join(DTYPE_BYTES)}")
    os.makedirs(args.out, exist_ok=True)
    bw = copy_bandwidth()
    jsonl = os.path.join(args.out, "bench.jsonl")
    rows = []
    cmd = "python benchmarks/throughput.py " + " ".join(sys.argv[1:])
    # the decode batch sizes: the worker's too (it gets them in its job), and the cells --interleave sends
    batches = ([int(b) for b in args.batches.split(",")] if args.batches else
               (SMOKE_DECODE if args.smoke else DECODE)["batches"])
    profile_batch = [int(b) for b in args.profile_batch.split(",")] if args.profile_batch else None
    cells = engine_cells(batches, workloads,
                         args.prefill_repeats or (SMOKE_PREFILL if args.smoke else PREFILL)["repeats"])

    def record(line):
        r = json.loads(line[len("RESULT "):])
        if r["workload"] == "decode":
            sd = [DTYPE_BYTES.get(t.removeprefix("torch."), 2) for t in r["state_dtypes"] or ["auto"]]
            w, s_ = bytes_per_step(r["model"], r["batch"], (sd[0], sd[-1]))
            r["floor_step_s"] = (w + 2 * r["batch"] * s_) / bw
            r["floor_share"] = r["floor_step_s"] / r["decode_step_s"]
            r["bytes_per_step"] = w + 2 * r["batch"] * s_
            r["decode_step_ms"] = 1e3 * r["decode_step_s"]
            r.update(engine_step_stats(r, r["floor_step_s"]))
        rows.append(r)
        with open(jsonl, "a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps(r), flush=True)

    units = []  # [(model, dtype, mode), [jobs]]: the engines whose cells compare
    for spec in GRID if args.models == "grid" else args.models.split(","):
        model, _, only = spec.partition(":")
        model_dir = write_config(model, args.out)
        for dtype in [only] if only else dtypes:
            for mode in args.modes.split(","):
                # graph-mode variants of the plugin only in graph mode
                mode_impls = [i for i in impls if not (i in ("plugin-full", "plugin-piecewise") and mode != "graph")]
                jobs = []
                _, state = bytes_per_step(model, 1, (2, DTYPE_BYTES[dtype]))
                for impl in mode_impls:
                    tag = f"{model}-{impl}-{mode}" + (f"-{dtype}" if dtype != "auto" else "")
                    jobs.append(dict(
                        model=model, model_dir=model_dir, impl=impl, mode=mode, ssm_dtype=dtype, tag=tag,
                        out=os.path.abspath(args.out), max_num_batched_tokens=args.max_num_batched_tokens,
                        smoke=args.smoke, batches=batches if args.batches else None, workloads=workloads,
                        profile_batch=profile_batch, prefill_repeats=args.prefill_repeats,
                        jit_verbose=args.jit_verbose, interleave=args.interleave or args.pack,
                        engines=len(mode_impls) if args.interleave else 1,
                        kv_cache_memory_bytes=(max(batches) + PACK_SLOTS) * state if args.pack else None,
                        profile_dir=os.path.abspath(os.path.join(args.out, f"profile-{tag}")) if args.profile else None))
                units.append(((model, dtype, mode), jobs))

    def env_of(job):
        return dict(os.environ, VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
                    **ENV_OF_IMPL.get(job["impl"], {}))

    if args.pack:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--pack sizes engines by the GPU's free memory: run it on a GPU")
        capacity = int(PACK_FILL * torch.cuda.mem_get_info()[0])
        for group in pack_groups([j for _, jobs in units for j in jobs], capacity):
            print(f"group: {', '.join(j['tag'] for j in group)} "
                  f"({sum(map(engine_memory, group)) / 1024**3:.1f} of {capacity / 1024**3:.1f} GiB)", flush=True)
            started = [Worker(j, env_of(j)) for j in group]  # all at once: their start-ups overlap
            workers = [w for w in started if w.read(lambda line: None, until="READY")]
            for unit, _ in units:
                run_cells([w for w in workers if unit_of(w.job) == unit], cells, record)
            for w in workers:
                w.send(None)
                w.finish()
            if "prefill" in workloads:
                for unit in {unit_of(j) for j in group}:
                    add_paired_prefill(rows, unit)
    else:
        for unit, jobs in units:
            workers = []
            for job in jobs:
                w = Worker(job, env_of(job))
                if not args.interleave:
                    w.read(record)  # all its cells, to its end
                # Started one after the other (each engine sizes its state pools from the memory it sees free),
                # then kept alive together.
                elif w.read(lambda line: None, until="READY"):
                    workers.append(w)
            run_cells(workers, cells, record)
            for w in workers:
                w.send(None)
                w.finish()
            if workers and "prefill" in workloads:
                add_paired_prefill(rows, unit)
    table = markdown(rows, bw, cmd)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table)
    print(table)
    if args.md:
        with open(args.md, "a") as f:
            f.write("\n" + table)


if __name__ == "__main__":
    main()
