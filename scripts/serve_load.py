"""Serving load harness: the OpenAI server under concurrent streaming clients, every answer checked exactly.

Starts ``python -m vllm.entrypoints.openai.api_server`` as a subprocess on 127.0.0.1 and sends it a bounded
workload: ``--requests`` streaming completions from ``--concurrency`` clients, each waiting a random
(exponential) time before its next request; prompts of 1 token to several SSD chunks (prefixes of a few random
base sequences, so that the oracle can share their prompt passes); greedy, ``ignore_eos``, a random
``max_tokens``; some with ``n > 1``; some clients disconnect mid-stream. Every received token is compared with
the float64 recurrence (tests/oracle.py); at the first divergence the oracle's top-1 / top-2 logit margin is
reported (a near-tie below ~1e-3 is numerics; a margin of 0.4 is a bug). Afterwards: the server is healthy,
no request is left running or waiting, every state slot is free (vLLM's cache usage is 0) and memory did not
grow after the warm-up. ``--bad-inputs`` sends malformed requests, each of which must get a 4xx naming the
problem and be followed by a valid request answered exactly.

    python scripts/serve_load.py --model DIR --requests 1000 --concurrency 64 --out result.json \
        -- --max-num-seqs 64 --max-num-batched-tokens 512 --skip-tokenizer-init

Arguments after ``--`` go to the server (``--dtype float32`` is always passed). The model must be fp32-exact
comparable: a float32 checkpoint served in float32. Exit status 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import aiohttp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from grid import TIE_MARGIN  # noqa: E402
from oracle import RecurrentMamba2  # noqa: E402


# ---- the oracle: greedy continuations of prompts that are prefixes of a few base sequences ---------------------
class Answers:
    """Greedy tokens and top-1 / top-2 logit margins of the recurrence for (base, prompt length) pairs.
    ``cache``: a JSON file of earlier answers for the same model and workload (read if present, else written)."""

    def __init__(self, model_dir: str, bases: list, wanted: dict, max_tokens: int, cache: str | None = None):
        self.tokens, self.margins, self.cached = {}, {}, False
        import hashlib

        with open(os.path.join(model_dir, "model.safetensors"), "rb") as f:
            weights = hashlib.sha1(f.read()).hexdigest()
        key = json.dumps([weights, bases, sorted((b, sorted(v)) for b, v in wanted.items()),
                          max_tokens])
        if cache and os.path.exists(cache):
            with open(cache) as f:
                saved = json.load(f)
            if saved["key"] == key:
                for k, toks, margins in saved["answers"]:
                    self.tokens[tuple(k)], self.margins[tuple(k)] = toks, margins
                self.cached = True
                return
        self._compute(model_dir, bases, wanted, max_tokens)
        if cache:
            with open(cache, "w") as f:
                json.dump(dict(key=key, answers=[[list(k), self.tokens[k], self.margins[k]] for k in self.tokens]), f)

    def _compute(self, model_dir, bases, wanted, max_tokens):
        oracle = RecurrentMamba2(model_dir)
        for b, lengths in wanted.items():
            state, logits, done = oracle.new_state(), None, 0
            for L in sorted(lengths):
                for t in bases[b][done:L]:
                    logits = oracle.step(t, state)
                done = L
                self._continue(oracle, (b, L), [(c.clone(), s.clone()) for c, s in state], logits, max_tokens)

    def _continue(self, oracle, key, state, logits, n):
        toks, margins = [], []
        for _ in range(n):
            top = logits.topk(2)
            toks.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            logits = oracle.step(toks[-1], state)
        self.tokens[key], self.margins[key] = toks, margins


def make_workload(args, vocab: int):
    rng = random.Random(args.seed)
    bases = [[rng.randrange(3, vocab) for _ in range(args.max_prompt)] for _ in range(args.bases)]
    short = [1, 1, 2, 3, 4, args.chunk - 1, args.chunk, args.chunk + 1]
    reqs = []
    for i in range(args.requests):
        L = rng.choice(short) if rng.random() < 0.4 else rng.randint(1, args.max_prompt)
        reqs.append(dict(id=i, base=rng.randrange(args.bases), length=min(L, args.max_prompt),
                         max_tokens=rng.randint(1, args.max_tokens), n=2 if rng.random() < args.n_frac else 1,
                         disconnect_after=rng.randint(1, 3) if rng.random() < args.disconnect_frac else None))
    # The tail: one-token prompts joining a few long decodes, one by one. Such batches are all one-token rows,
    # which a CUDA-graph engine replays as FULL decode graphs with the newcomer among them.
    for r in reqs[len(reqs) - args.tail_requests:] if args.tail_requests else []:
        r.update(length=1, max_tokens=args.max_tokens, n=1, disconnect_after=None)
    return bases, reqs


# ---- the server -------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, server_args: list, log_path: str, env: dict):
        self.port, self.args = free_port(), list(server_args)
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", "float32", *server_args]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                     start_new_session=True)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} (see {self.log.name})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"the server was not healthy within {timeout:.0f} s (see {self.log.name})")

    def _processes(self) -> list:
        """The server's process and its children (the engine core), as psutil processes."""
        import psutil

        p = psutil.Process(self.proc.pid)
        return [p] + p.children(recursive=True)

    def rss_mb(self) -> float:
        """Resident memory of the server and its children, MB."""
        import psutil

        try:
            return sum(q.memory_info().rss for q in self._processes() if q.is_running()) / 2**20
        except psutil.Error:
            return float("nan")

    def pids(self) -> set:
        """The process ids of the server and its children."""
        import psutil

        try:
            return {q.pid for q in self._processes()}
        except psutil.Error:
            return set()

    def stop(self) -> None:
        """Stop the server and wait for every process of its group (the engine core exits after the API server:
        a next server started meanwhile would share the CPU with its shutdown). A SIGTERM meanwhile (the caller's
        time limit, falling in a stop that a failed start began) is ignored: cut short, the stop would leave the
        server running."""
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) if in_main else None
        try:
            self._stop()
        finally:
            if in_main:
                signal.signal(signal.SIGTERM, previous)

    def _stop(self) -> None:
        import psutil

        group = self._group()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        _, alive = psutil.wait_procs(group, timeout=30)
        # A process forked while the group was signalled (the engine core of a server stopped during its
        # start-up) missed the signal: it keeps the group id, so a second look finds it.
        for p in alive + self._group():
            try:
                p.kill()
            except psutil.Error:  # gone meanwhile
                pass
        self.log.close()

    def _group(self) -> list:
        """Every live process of the server's process group (its session: start_new_session)."""
        import psutil

        return [p for p in psutil.process_iter() if _pgid(p.pid) == self.proc.pid]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def gpu_used_mb(pids: set | None = None) -> float | None:
    """GPU memory in use, MB: the device's, or with ``pids`` that of those processes (None where nvidia-smi
    shows none of them, as inside a container that hides the host's process ids)."""
    query = ["--query-gpu=memory.used"] if pids is None else ["--query-compute-apps=pid,used_memory"]
    try:
        out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        if pids is None:
            return float(out.split()[0])
        used = [float(mb) for pid, mb in (line.split(",") for line in out.splitlines() if line.strip())
                if int(pid) in pids]
        return sum(used) if used else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


# ---- clients ----------------------------------------------------------------------------------------------------
async def stream_completion(http, url, model, prompt, max_tokens, n, disconnect_after):
    """One streaming completion: {choice index: [token ids]}, whether the client hung up, the HTTP status."""
    # vLLM refuses n > 1 with greedy sampling; top_k = 1 samples the argmax all the same.
    sampling = dict(temperature=0.0) if n == 1 else dict(temperature=1.0, top_k=1)
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, n=n, stream=True, ignore_eos=True,
                return_token_ids=True, **sampling)
    got, chunks = {i: [] for i in range(n)}, 0
    async with http.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return got, False, resp.status, (await resp.text())[:500]
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            data = json.loads(line[5:])
            if "error" in data:
                return got, False, 500, json.dumps(data["error"])[:500]
            for ch in data["choices"]:
                got[ch["index"]] += ch.get("token_ids") or []
            chunks += 1
            if disconnect_after is not None and chunks >= disconnect_after:
                resp.close()  # the client goes away mid-stream: the server must abort the request
                return got, True, 200, ""
    return got, False, 200, ""


def check(req, got, hung_up, answers) -> list:
    """Divergences of one request's choices from the oracle: [(choice, position, got, want, margin)]."""
    want = answers.tokens[(req["base"], req["length"])][: req["max_tokens"]]
    margins = answers.margins[(req["base"], req["length"])]
    bad = []
    for i, toks in got.items():
        if not hung_up and len(toks) != len(want):
            bad.append((i, min(len(toks), len(want)), f"{len(toks)} tokens", f"{len(want)} tokens", None))
            continue
        for pos, (g, w) in enumerate(zip(toks, want)):
            if g != w:
                bad.append((i, pos, g, w, margins[pos]))
                break
    return bad


def http_session(total_s: float) -> aiohttp.ClientSession:
    """A client session that opens a connection per request. Reusing an idle keep-alive connection races the server
    closing it (uvicorn's keep-alive timeout): on a loaded machine clients read "Server disconnected" for requests
    sent on connections the server had closed, with the server healthy throughout."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=total_s),
                                 connector=aiohttp.TCPConnector(force_close=True))


async def run_load(args, server, model, bases, reqs, answers, report, concurrency):
    queue = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)
    rng = random.Random(args.seed + 1)

    async def client():
        async with http_session(args.request_timeout) as http:
            while not queue.empty():
                r = queue.get_nowait()
                await asyncio.sleep(rng.expovariate(1.0 / args.mean_gap))
                prompt = bases[r["base"]][: r["length"]]
                try:
                    got, hung_up, status, err = await stream_completion(
                        http, server.url, model, prompt, r["max_tokens"], r["n"], r["disconnect_after"])
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    got, hung_up, status, err = {}, False, -1, repr(e)
                if status != 200:
                    report["errors"].append(dict(id=r["id"], status=status, error=err))
                    continue
                bad = check(r, got, hung_up, answers)
                key = "disconnected" if hung_up else "completed"
                report[key] += 1
                entry = dict(id=r["id"], prompt_len=r["length"], n=r["n"], divergences=bad)
                if not bad:
                    report["exact"] += 1
                elif all(m is not None and m < args.tie_margin for *_, m in bad):
                    report["near_ties"].append(entry)
                else:
                    report["wrong"].append(entry)

    await asyncio.gather(*(client() for _ in range(concurrency)))


# ---- after the load: health, idle engine, free slots, memory ---------------------------------------------------
def metrics(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "gpu_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total"):
        vals = [float(v) for v in re.findall(rf"^vllm:{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)]
        if vals:
            out[name] = sum(vals)
    return out


def settle(url: str, timeout: float = 60.0) -> dict:
    """Metrics once no request is running or waiting (or the last reading after ``timeout``)."""
    deadline = time.time() + timeout
    while True:
        m = metrics(url)
        idle = m.get("num_requests_running", 1) == 0 and m.get("num_requests_waiting", 1) == 0
        if idle or time.time() > deadline:
            return m
        time.sleep(0.5)


# ---- bad requests -----------------------------------------------------------------------------------------------
def bad_requests(model: str, vocab: int, max_model_len: int, speculative: bool = False) -> list:
    """(name, body or raw bytes, words one of which the error message must contain)."""
    ok = dict(model=model, prompt=[5, 6, 7], max_tokens=4)
    # Under speculative decoding the plugin verifies greedily only (patches.py, 5): the other bad requests ask for
    # temperature 0 (the API's default is 1), so that their own problem is the one refused.
    if speculative:
        ok["temperature"] = 0.0
    sampling = [("sampling under speculative decoding", {**ok, "temperature": 0.8}, ["temperature"])]
    return (sampling if speculative else []) + [
        ("token id = vocab size", {**ok, "prompt": [5, vocab]}, ["vocabulary"]),
        ("token id 1e6", {**ok, "prompt": [5, 1_000_000]}, ["vocabulary"]),
        ("negative token id", {**ok, "prompt": [-1, 5]}, ["vocabulary", "greater than or equal"]),
        ("bad id in a batch", {**ok, "prompt": [[5, 6], [7, 1_000_000]]}, ["vocabulary"]),
        ("empty token prompt", {**ok, "prompt": []}, ["empty", "prompt"]),
        ("empty text prompt", {**ok, "prompt": ""}, ["empty", "prompt", "tokenizer"]),
        ("prompt over max_model_len", {**ok, "prompt": [5] * (max_model_len + 1)}, ["context length", "longer"]),
        ("max_tokens over the context", {**ok, "max_tokens": max_model_len + 10}, ["context length", "max_tokens"]),
        ("negative max_tokens", {**ok, "max_tokens": -1}, ["max_tokens"]),
        ("negative temperature", {**ok, "temperature": -1.0}, ["temperature"]),
        ("top_p over 1", {**ok, "top_p": 1.5}, ["top_p"]),
        ("n = 0", {**ok, "n": 0}, ["n"]),
        ("malformed JSON", b'{"model": "x", "prompt": [1, 2', ["json", "decode", "expecting"]),
        ("unknown model", {**ok, "model": "no-such-model"}, ["model"]),
    ]


async def run_bad_inputs(server, model, vocab, max_model_len, bases, answers, probe, report) -> None:
    """Each bad request must get a 4xx whose message names the problem; the next valid one is answered exactly."""
    async with http_session(120) as http:
        speculative = "--speculative-config" in server.args
        for name, body, words in bad_requests(model, vocab, max_model_len, speculative):
            kw = dict(data=body, headers={"Content-Type": "application/json"}) if isinstance(body, bytes) else \
                dict(json=body)
            async with http.post(server.url + "/v1/completions", **kw) as resp:
                status, text = resp.status, await resp.text()
            named = any(w.lower() in text.lower() for w in words)
            prompt = bases[probe["base"]][: probe["length"]]
            got, _, ok_status, _ = await stream_completion(http, server.url, model, prompt, probe["max_tokens"],
                                                           1, None)
            after_ok = ok_status == 200 and not check(probe, got, False, answers)
            report["bad_inputs"].append(dict(name=name, status=status, message=text[:300], names_problem=named,
                                             next_request_exact=after_ok))


# ---- main -------------------------------------------------------------------------------------------------------
def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a float32 HF Mamba2 checkpoint (config.json + model.safetensors)")
    ap.add_argument("--oracle-model", default=None,
                    help="the HF-format copy of the served weights that the oracle reads (default: --model), e.g. "
                         "for a checkpoint in mamba_ssm's format")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--warmup-requests", type=int, default=0, help="run first; memory is measured after them")
    ap.add_argument("--max-tokens", type=int, default=24, help="each request asks for 1..this many tokens")
    ap.add_argument("--tail-requests", type=int, default=0,
                    help="the last this many requests: one-token prompts sent by --tail-concurrency clients")
    ap.add_argument("--tail-concurrency", type=int, default=4)
    ap.add_argument("--max-prompt", type=int, default=400)
    ap.add_argument("--chunk", type=int, default=0, help="the model's SSD chunk (default: from config.json)")
    ap.add_argument("--bases", type=int, default=8, help="base sequences the prompts are prefixes of")
    ap.add_argument("--n-frac", type=float, default=0.1, help="share of requests with n = 2")
    ap.add_argument("--disconnect-frac", type=float, default=0.2, help="share of requests the client abandons")
    ap.add_argument("--mean-gap", type=float, default=0.05, help="mean seconds a client waits between requests")
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--bad-inputs", action="store_true", help="also send the malformed requests")
    ap.add_argument("--max-rss-growth-mb", type=float, default=256)
    ap.add_argument("--max-gpu-growth-mb", type=float, default=64)
    ap.add_argument("--gpu-memory-of", choices=("device", "server"), default="device",
                    help="whose GPU memory the growth check reads: the device's, or the server's processes' "
                         "(for servers sharing the GPU; skipped where nvidia-smi shows no process of the server)")
    ap.add_argument("--tie-margin", type=float, default=TIE_MARGIN,
                    help="a divergence where the oracle's top-1 / top-2 logit margin is below this is a near-tie "
                         "(reported, not failed): fp32 kernels against a float64 oracle")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server's environment")
    ap.add_argument("--answers", default=None, help="cache of the oracle's answers (JSON; reused when it matches)")
    ap.add_argument("--answers-only", action="store_true", help="compute the --answers cache, start no server")
    ap.add_argument("--log", default="serve_load_server.log")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    if "--" in argv:
        i = argv.index("--")
        return ap.parse_args(argv[:i]), argv[i + 1:]
    return ap.parse_args(argv), []


def main(argv=None) -> int:
    args, server_args = parse_args(sys.argv[1:] if argv is None else argv)
    if "--speculative-config" in server_args:
        args.n_frac = 0.0  # n > 1 samples, which the plugin refuses under speculative decoding (a bad input below)
        # vLLM's ngram proposer JIT-compiles its numba kernels on its first proposals (one-time host memory).
        args.warmup_requests = args.warmup_requests or min(8, args.requests // 4)
    oracle_dir = args.oracle_model or args.model
    with open(os.path.join(oracle_dir, "config.json")) as f:
        cfg = json.load(f)
    vocab = cfg["vocab_size"]
    args.chunk = args.chunk or cfg["chunk_size"]
    bases, reqs = make_workload(args, vocab)
    probe = dict(id=-1, base=0, length=min(5, args.max_prompt), max_tokens=8, n=1, disconnect_after=None)
    wanted = {}
    for r in reqs + [probe]:
        wanted.setdefault(r["base"], set()).add(r["length"])
    t0 = time.time()
    answers = Answers(oracle_dir, bases, wanted, max(args.max_tokens, probe["max_tokens"]), args.answers)
    # Visible in a caller's log: a cache that does not match these weights costs minutes of float64 before the server.
    print(f"oracle answers: {'read from' if answers.cached else 'computed for'} {args.answers or 'this run'} in "
          f"{time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    if args.answers_only:
        return 0
    report = dict(requests=args.requests, concurrency=args.concurrency, server_args=server_args, env=args.env,
                  oracle_s=round(time.time() - t0, 1), exact=0, completed=0, disconnected=0, wrong=[],
                  near_ties=[], errors=[], bad_inputs=[])
    # The server runs in its own session (a Ctrl-C at the terminal is the harness's to handle), so a harness ended
    # by SIGTERM (a `timeout`, a CI cancel) must stop it itself: Python's default SIGTERM action skips `finally`.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    server = Server(args.model, server_args, args.log, dict(e.split("=", 1) for e in args.env))
    try:  # the pid line inside: a SIGTERM right after it (a caller that waits for it) still stops the server
        print(f"server: pid {server.proc.pid}, log {args.log}", file=sys.stderr, flush=True)
        serve_and_check(args, server, server_args, cfg, bases, reqs, probe, answers, report)
    finally:
        server.stop()
    verdict = summarize(args, report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k not in ("wrong", "near_ties", "errors", "bad_inputs")}))
    for w in report["wrong"][:20]:
        print("WRONG", json.dumps(w))
    for w in report["near_ties"][:20]:
        print("NEAR-TIE", json.dumps(w))
    for e in report["errors"][:20]:
        print("ERROR", json.dumps(e))
    for b in report["bad_inputs"]:
        print("BAD-INPUT", json.dumps(b))
    print("VERDICT", "PASS" if not verdict else "FAIL: " + "; ".join(verdict))
    return 0 if not verdict else 1


def serve_and_check(args, server, server_args, cfg, bases, reqs, probe, answers, report) -> None:
    """The warm-up, the load and its tail, the checks after them and the bad requests, into ``report``."""
    t0 = time.time()
    server.wait_healthy(args.start_timeout)
    report["start_s"] = round(time.time() - t0, 1)
    with urllib.request.urlopen(server.url + "/v1/models", timeout=10) as r:
        model = json.loads(r.read())["data"][0]["id"]
    tail = len(reqs) - args.tail_requests
    warm, main_reqs, tail_reqs = reqs[: args.warmup_requests], reqs[args.warmup_requests: tail], reqs[tail:]
    if warm:
        asyncio.run(run_load(args, server, model, bases, warm, answers, report, args.concurrency))
        settle(server.url)
    gpu_pids = server.pids() if args.gpu_memory_of == "server" else None
    report["rss_mb_before"], report["gpu_mb_before"] = server.rss_mb(), gpu_used_mb(gpu_pids)
    t0 = time.time()
    asyncio.run(run_load(args, server, model, bases, main_reqs, answers, report, args.concurrency))
    asyncio.run(run_load(args, server, model, bases, tail_reqs, answers, report, args.tail_concurrency))
    report["load_s"] = round(time.time() - t0, 1)
    report["metrics_after"] = settle(server.url)
    report["rss_mb_after"], report["gpu_mb_after"] = server.rss_mb(), gpu_used_mb(gpu_pids)
    if args.bad_inputs:
        max_model_len = (int(server_args[server_args.index("--max-model-len") + 1])
                         if "--max-model-len" in server_args else cfg.get("max_position_embeddings") or 2048)
        asyncio.run(run_bad_inputs(server, model, cfg["vocab_size"], max_model_len, bases, answers, probe, report))
        report["metrics_after_bad"] = settle(server.url)
    report["healthy_after"] = server.proc.poll() is None and _healthy(server.url)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            return r.status == 200
    except OSError:
        return False


def summarize(args, report) -> list:
    """What failed, in words (empty: everything passed)."""
    fails = []
    if report["wrong"]:
        fails.append(f"{len(report['wrong'])} requests diverged from the oracle")
    if report["errors"]:
        fails.append(f"{len(report['errors'])} valid requests failed")
    if report["exact"] + len(report["wrong"]) + len(report["near_ties"]) + len(report["errors"]) != args.requests:
        fails.append("not every request was accounted for")
    if not report.get("healthy_after"):
        fails.append("the server was not healthy afterwards")
    if "--enable-prefix-caching" in report["server_args"]:
        # The prompts are prefixes of a few base sequences: a prefix cache that never hits is broken.
        m = report.get("metrics_after") or {}
        if not m.get("prefix_cache_hits_total"):
            fails.append(f"prefix caching is on but nothing hit the cache ({m})")
    if "--speculative-config" in report["server_args"]:
        m = report.get("metrics_after") or {}
        if not m.get("spec_decode_num_draft_tokens_total"):  # a verification step that never ran proves nothing
            fails.append(f"speculative decoding is on but no draft was proposed ({m})")
    for key in ("metrics_after", "metrics_after_bad"):
        m = report.get(key)
        if m is None:
            continue
        if m.get("num_requests_running") or m.get("num_requests_waiting"):
            fails.append(f"requests left running or waiting ({key}: {m})")
        usage = m.get("kv_cache_usage_perc", m.get("gpu_cache_usage_perc"))
        if usage is None or usage > 0:
            fails.append(f"state slots still in use ({key}: {m})")
    growth = report["rss_mb_after"] - report["rss_mb_before"]
    report["rss_growth_mb"] = round(growth, 1)
    if growth > args.max_rss_growth_mb:
        fails.append(f"host memory grew by {growth:.0f} MB")
    if report["gpu_mb_before"] is not None and report["gpu_mb_after"] is not None:
        report["gpu_growth_mb"] = report["gpu_mb_after"] - report["gpu_mb_before"]
        if report["gpu_growth_mb"] > args.max_gpu_growth_mb:
            fails.append(f"GPU memory grew by {report['gpu_growth_mb']:.0f} MB")
    for b in report["bad_inputs"]:
        if not (400 <= b["status"] < 500 and b["names_problem"] and b["next_request_exact"]):
            fails.append(f"bad input {b['name']!r}: status {b['status']}, names the problem {b['names_problem']}, "
                         f"next request exact {b['next_request_exact']}")
    return fails


if __name__ == "__main__":
    sys.exit(main())
