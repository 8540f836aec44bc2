"""The examples run as documented: offline generation, and the OpenAI-compatible server answering a real
client request (the `openai` package) with the tokens the recurrence oracle predicts."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from oracle import RecurrentMamba2

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    """The README's embedded default: the small model trained on the built-in paragraph."""
    from vllm_mamba2_plugin import tiny_model

    return tiny_model.build(str(tmp_path_factory.mktemp("default") / "m"), tiny_model.PRESETS["default"])


@pytest.mark.slow
def test_offline_example_prints_text_and_throughput(default_model):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "offline_generate.py"), "--model", default_model,
         "--max-tokens", "12", "--num-prompts", "4"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model class: vllm_mamba2_plugin.model.Mamba2PluginForCausalLM" in proc.stdout
    assert "output tok/s" in proc.stdout and proc.stdout.count("--- ") == 4
    # The trained default model continues its training text: served through vLLM + plugin, it must.
    assert "jumps over the lazy dog" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_openai_server_answers_a_client_request(model_dirs, tmp_path):
    from transformers import AutoTokenizer

    model = model_dirs["g2_tied"]
    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
         "--max-model-len", "512", "--host", "127.0.0.1", "--port", str(port), "--enforce-eager"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, open(tmp_path / "server.log").read()[-3000:]
            assert time.time() < deadline, "server did not become healthy in 300 s"
            time.sleep(1)
        prompt = "The rain in Spain"
        proc = subprocess.run(
            [sys.executable, os.path.join(ROOT, "examples", "openai_client.py"), "--base-url",
             f"http://127.0.0.1:{port}/v1", "--prompt", prompt, "--max-tokens", "12", "--json"],
            capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    prompt_ids = AutoTokenizer.from_pretrained(model)(prompt)["input_ids"]
    want = RecurrentMamba2(model).generate(prompt_ids, 12)[0]
    assert answer["token_ids"] == want
    assert answer["text"]
