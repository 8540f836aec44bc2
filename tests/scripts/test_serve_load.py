"""scripts/serve_load.py on the CPU: the OpenAI server with the plugin under concurrent streaming clients (random
arrivals, disconnects, n = 2, one-token to multi-chunk prompts, chunked prefill), every token checked against the
float64 recurrence; then health, no request left, every state slot free, no memory growth; and the malformed
requests, each answered with a 4xx that names the problem, the next valid request answered exactly. With and
without a tokenizer."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def g4_model(tmp_path_factory):
    """The serving test shape: n_groups 4, head_dim 32, conv width 4, linear biases; a small chunk (16), so that
    prompts of up to 100 tokens span several chunks and a 64-token step budget cuts them."""
    from vllm_mamba2_plugin import tiny_model

    spec = tiny_model.TinyMamba2Spec(hidden_size=128, num_heads=8, head_dim=32, n_groups=4, chunk_size=16,
                                     use_bias=True, seed=7)
    return tiny_model.build(str(tmp_path_factory.mktemp("serve") / "g4"), spec)


def _run(model, tmp_path, harness_args, server_args):
    out = tmp_path / "report.json"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "serve_load.py"), "--model", model, "--out", str(out),
           "--log", str(tmp_path / "server.log"), *harness_args, "--", "--max-model-len", "512",
           "--max-num-seqs", "8", "--max-num-batched-tokens", "64", *server_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    server_log = (tmp_path / "server.log").read_text()[-3000:]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:] + server_log
    return json.loads(out.read_text())


@pytest.mark.slow
def test_server_under_load_without_tokenizer(g4_model, tmp_path):
    report = _run(g4_model, tmp_path, ["--requests", "160", "--concurrency", "16", "--warmup-requests", "16",
                                       "--tail-requests", "24", "--max-prompt", "100", "--bad-inputs"],
                  ["--skip-tokenizer-init"])
    assert report["exact"] == 160 and not report["wrong"] and not report["near_ties"]
    assert report["disconnected"] > 0  # the workload did hang up on some streams
    assert report["metrics_after"]["kv_cache_usage_perc"] == 0 and report["healthy_after"]
    assert len(report["bad_inputs"]) == 14 and all(400 <= b["status"] < 500 for b in report["bad_inputs"])


@pytest.mark.slow
def test_bad_inputs_with_a_tokenizer(g4_model, tmp_path):
    report = _run(g4_model, tmp_path, ["--requests", "24", "--concurrency", "8", "--max-prompt", "60",
                                       "--bad-inputs"], [])
    assert report["exact"] == 24
    assert all(b["names_problem"] and b["next_request_exact"] for b in report["bad_inputs"])


@pytest.mark.slow
def test_server_under_load_with_prefix_caching(g4_model, tmp_path):
    """The same load with --enable-prefix-caching: the prompts are prefixes of a few base sequences, so most
    requests start from a cached block-boundary state; every token still equals the oracle's."""
    report = _run(g4_model, tmp_path, ["--requests", "160", "--concurrency", "16", "--warmup-requests", "8",
                                       "--tail-requests", "16", "--max-prompt", "100"],
                  ["--skip-tokenizer-init", "--enable-prefix-caching"])
    assert report["exact"] == 160 and not report["wrong"] and not report["near_ties"]
    m = report["metrics_after"]
    assert m["prefix_cache_hits_total"] > 0.3 * m["prefix_cache_queries_total"], m
    assert m["kv_cache_usage_perc"] == 0 and report["healthy_after"]


@pytest.mark.slow
def test_a_mamba_ssm_checkpoint_under_load(g4_model, tmp_path):
    """The same weights in mamba_ssm's own format (state-spaces/mamba2-*: found by --config-format auto, no
    tokenizer), served under concurrent load; the oracle reads the HF copy."""
    from vllm_mamba2_plugin import tiny_model

    ms_dir = tiny_model.export_mamba_ssm(g4_model, str(tmp_path / "g4-mamba_ssm"))
    report = _run(ms_dir, tmp_path, ["--oracle-model", g4_model, "--requests", "60", "--concurrency", "8",
                                     "--max-prompt", "100"], ["--skip-tokenizer-init"])
    assert report["exact"] == 60 and not report["wrong"] and report["healthy_after"]


@pytest.mark.slow
def test_server_under_load_with_tensor_parallelism(g4_model, tmp_path):
    """The same load on two TP ranks (spawned workers, one core each): every token still equals the oracle's, and
    every state slot is free afterwards."""
    report = _run(g4_model, tmp_path, ["--requests", "64", "--concurrency", "8", "--warmup-requests", "8",
                                       "--max-prompt", "100", "--env", "VLLM_CPU_OMP_THREADS_BIND=0|1"],
                  ["--skip-tokenizer-init", "--tensor-parallel-size", "2"])
    assert "Worker_TP1" in (tmp_path / "server.log").read_text()  # the second rank served
    assert report["exact"] == 64 and not report["wrong"] and not report["near_ties"]
    assert report["metrics_after"]["kv_cache_usage_perc"] == 0 and report["healthy_after"]


def test_a_terminated_harness_stops_its_server(g4_model, tmp_path):
    """The server runs in its own session; a harness ended by SIGTERM (a `timeout`, a CI cancel) still stops it,
    rather than leaving an engine holding the GPU for the next run."""
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "serve_load.py"), "--model", g4_model, "--requests", "4",
           "--log", str(tmp_path / "server.log"), "--", "--max-model-len", "512", "--skip-tokenizer-init"]
    harness = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    line = harness.stderr.readline()
    while line and not line.startswith("server: pid "):  # the oracle's line comes first
        line = harness.stderr.readline()
    assert line.startswith("server: pid "), line
    pid = int(line.split()[2].rstrip(","))
    os.kill(pid, 0)  # running
    harness.send_signal(signal.SIGTERM)
    assert harness.wait(timeout=60) == 128 + signal.SIGTERM
    deadline = time.time() + 30
    while time.time() < deadline:
        state = _process_state(pid)
        if state is None or state.startswith("Z"):  # gone, or a zombie waiting for init to reap it: holds nothing
            return
        time.sleep(0.5)
    os.killpg(pid, signal.SIGKILL)
    pytest.fail(f"the server outlived the harness (state {state!r}); harness stderr: {harness.stderr.read()[-2000:]}")


def _process_state(pid: int):
    """The State line of /proc/<pid>/status ("S (sleeping)", "Z (zombie)", ...), or None when there is no such
    process."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("State:")), "")
    except FileNotFoundError:
        return None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["n32g4", "h64n128", "n16g8"])
def test_grid_model_under_load(name, grid_dirs, tmp_path):
    """Grid models (tiny_model.GRID: large step sizes; both dt limits, no limit; chunk 64 and 256; 4 and 8 groups)
    under the same kind of load, prompts up to a few chunks long, cut by the 64-token step budget. Every grid model
    goes through the engine in tests/test_grid_models.py; three here keep CI's time."""
    report = _run(grid_dirs[name], tmp_path, ["--requests", "40", "--concurrency", "12", "--max-prompt", "300"],
                  ["--skip-tokenizer-init"])
    assert report["exact"] == 40 and not report["wrong"] and not report["near_ties"]
    assert report["disconnected"] > 0 and report["healthy_after"]
    assert report["metrics_after"]["kv_cache_usage_perc"] == 0
