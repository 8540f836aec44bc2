"""benchmarks/serve_grid.py on the CPU: one grid model under two servers at once through the script (a JSON line
each, every request exact, every bad input a 4xx), and a run past its time limit stops its server."""

import json
import os
import subprocess
import sys
import time

import psutil

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "serve_grid.py")


def serve_grid(tmp_path, *extra, modes="eager", timeout=600):
    out = tmp_path / "serve_grid.jsonl"
    out.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, SCRIPT, "--models", "h128n64", "--modes", modes, "--requests", "8",
                           "--concurrency", "4", "--model-dir", str(tmp_path / "models"),
                           "--answers-dir", str(tmp_path / "answers"), "--log-dir", str(tmp_path / "logs"),
                           "--out", str(out), *extra],
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def servers_of(model_dir: str) -> list:
    return [p for p in psutil.process_iter(["cmdline"]) if model_dir in " ".join(p.info["cmdline"] or [])]


def test_one_model_under_two_servers_at_once(tmp_path):
    rows = serve_grid(tmp_path, "--parallel", "2", modes="eager,piecewise")
    assert sorted(row["mode"] for row in rows) == ["eager", "piecewise"], rows
    for row in rows:
        assert row["verdict"] == "PASS" and row["rc"] == 0, row
        assert row["exact"] == 8 and not row["wrong"] and row["errors"] == 0, row
        assert row["bad_inputs"] > 0 and row["bad_inputs_ok"] == row["bad_inputs"], row


def test_a_run_past_its_limit_stops_its_server(tmp_path):
    serve_grid(tmp_path, "--answers-only")  # so that the limit falls in the server's start-up
    [row] = serve_grid(tmp_path, "--timeout", "8", "--no-bad-inputs")
    assert row["rc"] != 0 and "timed out after 8 s" in row["verdict"], row
    time.sleep(2)
    assert not servers_of(str(tmp_path / "models")), "the server outlived its run"


def test_no_server_starts_once_the_budget_is_spent(tmp_path):
    rows = serve_grid(tmp_path, "--budget", "100", "--min-run", "150", modes="eager,full", timeout=120)
    assert sorted(row["mode"] for row in rows) == ["eager", "full"], rows
    assert all(row["rc"] is None and row["verdict"].startswith("not started") for row in rows), rows
    assert not os.path.exists(tmp_path / "logs" / "plugin-h128n64-eager.log")
