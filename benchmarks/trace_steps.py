"""Per-step host / device tables from a vLLM engine-core torch-profiler trace (``throughput.py --profile``).

    python benchmarks/trace_steps.py out/profile-2.7b-plugin-graph [out/profile-2.7b-intree-graph ...]

vLLM's worker wraps every engine step in a ``execute_context_<reqs>(<tokens>)_generation_<reqs>(<tokens>)``
annotation. Each step is classified as decode (no context tokens; "decode b16 t64": 16 requests of 64 tokens, a
verification step), prefill (no generation tokens) or mixed, and
for each class the script prints, averaged over its steps:
  host     the annotation's duration (CPU time of the step's model execution call)
  period   start of this step to start of the next (the engine's real cadence: scheduling, sampling, output
           processing included); the last step of a run has none
  kernels  the summed duration of the GPU kernels launched inside the step (CUDA-graph replays included: the
           profiler attributes graph kernels to their cudaGraphLaunch)
  span     first kernel start to last kernel end of those kernels
plus the top kernels (device µs per step) and the top CPU ops by self time (µs per step) of that class.
Kernel names are shortened; decode steps of different batch sizes are kept apart by their request count, and
prefill steps by their prompt count.

With ``--model NAME`` (a shape of benchmarks/throughput.py) decode steps also get the achieved bandwidth of each
kernel family (``FAMILIES``): the bytes a step of that batch must move through it
(``throughput.decode_bytes_by_kernel``: states read and written, weights read once) over its device time per step.
``--state-bytes 2,2`` gives the conv and SSM state element sizes (bf16; ``2,4`` for fp32 SSM states).

    python benchmarks/trace_steps.py out/profile-3072-48-p128-g4-n128-plugin-graph --model 3072-48-p128-g4-n128

With ``--op NAME`` (e.g. ``vllm::mamba2_plugin_mixer``, in-tree's ``vllm::mamba_mixer2``) each class also gets
that op's host cost: its calls per step, and per call the median duration, direct child ops and kernel launches
(an eager or piecewise step's mixer; a FULL-graph replay calls none).

    python benchmarks/trace_steps.py out/profile-2048-48-p128-g8-n64-plugin-graph --op vllm::mamba2_plugin_mixer
"""

import argparse
import bisect
import collections
import glob
import gzip
import json
import os
import re
import statistics

STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
# Kernel families of a decode step, by kernel name: mamba-ssm's state update (plugin and in-tree's copy), the conv
# update (causal-conv1d's CUDA kernel, vLLM's Triton one), mamba-ssm's gated norm (in-tree's is Inductor-fused:
# "other"), cuBLAS / CUTLASS GEMMs.
FAMILIES = [
    ("state update", re.compile(r"selective_scan_update|selective_state_update")),
    ("conv update", re.compile(r"causal_conv1d_update")),
    ("gated norm", re.compile(r"_layer_norm_fwd_1pass_kernel")),
    ("GEMM", re.compile(r"gemm|nvjet|xmma|cutlass|splitKreduce", re.IGNORECASE)),
]


def load(path: str) -> list:
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*.trace.json*")))
        if not files:
            raise SystemExit(f"no *.trace.json[.gz] under {path}")
        path = files[-1]
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def short(name: str, n: int = 70) -> str:
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= n else name[: n - 3] + "..."


def self_times(ops: list) -> dict:
    """Exclusive time per op name for X events of one thread (nested by time)."""
    out = collections.Counter()
    stack = []  # [end, name, duration, time of its children]

    def close():
        _, name, dur, child = stack.pop()
        out[name] += dur - child
        if stack:
            stack[-1][3] += dur

    for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        while stack and stack[-1][0] <= e["ts"]:
            close()
        stack.append([e["ts"] + e["dur"], e["name"], e["dur"], 0.0])
    while stack:
        close()
    return out


LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")


def op_calls(ops: list, name: str) -> list:
    """Each call of the op ``name`` among one thread's X events: (µs, direct children, of them kernel launches)."""
    ops = sorted(ops, key=lambda e: (e["ts"], -e["dur"]))
    out = []
    for i, call in enumerate(ops):
        if call["name"] != name:
            continue
        end, child_end, children, launches = call["ts"] + call["dur"], call["ts"], 0, 0
        for e in ops[i + 1:]:
            if e["ts"] >= end:
                break
            if e["ts"] >= child_end:  # not inside the previous direct child
                children += 1
                launches += e["name"] in LAUNCHES
                child_end = e["ts"] + e["dur"]
        out.append((call["dur"], children, launches))
    return out


def op_line(calls: list, n_steps: int, name: str) -> str:
    if not calls:
        return f"   {name}: not called"
    med = [statistics.median(c[k] for c in calls) for k in range(3)]
    return (f"   {name}: {len(calls) / n_steps:.1f} calls per step; per call (median) {med[0]:.0f} µs, "
            f"{med[1]:.0f} host ops, {med[2]:.0f} launches")


def family_of(kernel: str) -> str:
    return next((name for name, rx in FAMILIES if rx.search(kernel)), "other")


def bandwidth_lines(kernel_us: dict, n_steps: int, step_bytes: dict) -> list:
    """Per family: device µs per step, the bytes a step moves through it, GB/s achieved; kernel_us: summed device
    µs per kernel name over n_steps steps."""
    per = collections.Counter()
    for kernel, us in kernel_us.items():
        per[family_of(kernel)] += us / n_steps
    lines = ["   by kernel family (µs per step, bytes per step, achieved GB/s):"]
    for fam in [f for f, _ in FAMILIES] + ["other"]:
        us, b = per.get(fam, 0.0), step_bytes.get(fam)
        rate = f"{b / us / 1e3:8.0f}" if b and us else "       -"
        size = f"{b / 1e6:10.1f} MB" if b else "           -"
        lines.append(f"     {fam:13s} {us:9.1f} µs {size} {rate} GB/s")
    return lines


def analyse(events: list, top: int, step_bytes=None, op=None) -> str:
    """step_bytes: None, or a function of the decode batch giving {family: bytes per step}; op: None, or an op
    name whose calls get a host-cost line per class."""
    steps = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "user_annotation":
            m = STEP.fullmatch(e["name"])
            if m:
                ctx_r, ctx_t, gen_r, gen_t = map(int, m.groups())
                if ctx_t == 0 and gen_t == 0:
                    continue  # empty step (run end)
                kind = "decode" if ctx_t == 0 else "prefill" if gen_t == 0 else "mixed"
                # Decode steps by batch (and under speculative decoding by their token count), prefill steps by
                # prompt count (a 1 x 512 first step and the 2 x 4 096 steps of the prefill-heavy run are different
                # animals).
                key = (f"decode b{gen_r}" + (f" t{gen_t}" if gen_t != gen_r else "") if kind == "decode"
                       else f"prefill r{ctx_r}" if kind == "prefill" else kind)
                steps.append(dict(key=key, ts=e["ts"], dur=e["dur"], end=e["ts"] + e["dur"], tid=e.get("tid"),
                                  tokens=ctx_t + gen_t))
    steps.sort(key=lambda s: s["ts"])
    for a, b in zip(steps, steps[1:]):
        a["period"] = b["ts"] - a["ts"] if b["ts"] - a["ts"] < 20 * max(a["dur"], 1) else None
    launch_ts = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launch_ts[e["args"]["correlation"]] = e["ts"]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    cpu_ops = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime",
                                                                           "cuda_driver", "python_function")]
    starts = [s["ts"] for s in steps]

    def step_of(ts):
        i = bisect.bisect_right(starts, ts) - 1
        return i if i >= 0 and ts <= steps[i]["end"] else None

    per_step_k = collections.defaultdict(list)
    for k in kernels:
        lt = launch_ts.get(k.get("args", {}).get("correlation"))
        i = step_of(lt) if lt is not None else None
        if i is not None:
            per_step_k[i].append(k)
    per_step_ops = collections.defaultdict(list)
    for o in cpu_ops:
        i = step_of(o["ts"])
        if i is not None and o.get("tid") == steps[i]["tid"]:
            per_step_ops[i].append(o)

    groups = collections.defaultdict(list)
    for i, s in enumerate(steps):
        groups[s["key"]].append(i)
    lines = []
    for key, idx in sorted(groups.items()):
        n = len(idx)
        host = sum(steps[i]["dur"] for i in idx) / n
        periods = [steps[i]["period"] for i in idx if steps[i].get("period")]
        ksum = sum(sum(k["dur"] for k in per_step_k[i]) for i in idx) / n
        spans = [max(k["ts"] + k["dur"] for k in per_step_k[i]) - min(k["ts"] for k in per_step_k[i])
                 for i in idx if per_step_k[i]]
        toks = sum(steps[i]["tokens"] for i in idx) / n
        lines.append(f"== {key}: {n} steps, {toks:.0f} tokens/step | host {host:.0f} µs | period "
                     f"{(sum(periods) / len(periods)) if periods else float('nan'):.0f} µs | kernels {ksum:.0f} µs | "
                     f"span {(sum(spans) / len(spans)) if spans else float('nan'):.0f} µs")
        kt = collections.Counter()
        kc = collections.Counter()
        full = collections.Counter()  # by full name: a family is matched on the whole name
        for i in idx:
            for k in per_step_k[i]:
                kt[short(k["name"])] += k["dur"]
                kc[short(k["name"])] += 1
                full[k["name"]] += k["dur"]
        lines.append(f"   top kernels (µs per step, launches per step):")
        for name, t in kt.most_common(top):
            lines.append(f"     {t / n:9.1f}  {kc[name] / n:6.1f}  {name}")
        if step_bytes is not None and key.startswith("decode b") and " t" not in key:
            lines += bandwidth_lines(full, n, step_bytes(int(key[len("decode b"):])))
        st = collections.Counter()
        for i in idx:
            st.update(self_times(per_step_ops[i]))
        lines.append(f"   top CPU ops by self time (µs per step):")
        for name, t in st.most_common(top):
            lines.append(f"     {t / n:9.1f}  {short(name)}")
        if op:
            lines.append(op_line([c for i in idx for c in op_calls(per_step_ops[i], op)], n, op))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", help="trace files or profile directories")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--model", default=None, help="a shape of benchmarks/throughput.py: decode bandwidth by family")
    ap.add_argument("--state-bytes", default="2,2", help="conv, SSM state element sizes in bytes")
    ap.add_argument("--op", default=None, help="an op name: its calls per step, duration, child ops and launches")
    args = ap.parse_args()
    step_bytes = None
    if args.model:
        from throughput import decode_bytes_by_kernel

        sizes = tuple(int(v) for v in args.state_bytes.split(","))
        step_bytes = lambda batch: decode_bytes_by_kernel(args.model, batch, sizes)  # noqa: E731
    for t in args.traces:
        print(f"##### {t}")
        print(analyse(load(t), args.top, step_bytes, args.op))


if __name__ == "__main__":
    main()
