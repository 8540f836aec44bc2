"""version_gate.py: on a vLLM release outside the supported ones, register() leaves vLLM's in-tree Mamba2 in
charge with one warning, asking for the plugin's architecture fails at start-up saying why, and
VLLM_MAMBA2_PLUGIN_UNVERIFIED_VLLM=1 registers the plugin anyway. The release is faked by setting
vllm.__version__ before the engine loads the plugin."""

import os
import subprocess
import sys

import pytest

from vllm_mamba2_plugin import tiny_model, version_gate

RUN = r"""
import sys, vllm
vllm.__version__ = sys.argv[2]
from vllm import LLM
kw = dict(model=sys.argv[1], dtype="float32", max_num_seqs=2, max_model_len=128, enforce_eager=True)
print("CLASS", LLM(**kw).apply_model(lambda m: type(m).__name__)[0], flush=True)
try:
    LLM(**kw, hf_overrides={"architectures": ["Mamba2PluginForCausalLM"]})
    print("EXPLICIT built", flush=True)
except Exception as e:
    print("EXPLICIT refused:", " ".join(str(e).split()), flush=True)
"""


@pytest.mark.parametrize("version, supported", [("0.26.0", True), ("0.32.0", True), ("0.32.1+cpu", True),
                                                ("0.29.2", True), ("0.25.3", False), ("0.33.0", False),
                                                ("0.34.0rc1", False), ("0.33.0.dev12+gabc", False),
                                                ("1.0.0", False)])
def test_supported_releases(version, supported):
    assert version_gate.is_supported(version) is supported


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model.build(str(tmp_path_factory.mktemp("gate") / "m"), tiny_model.PRESETS["test"])


def _engines(model_dir, version, **env):
    proc = subprocess.run([sys.executable, "-c", RUN, model_dir, version], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                            "VLLM_CPU_KVCACHE_SPACE": "1", **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, proc.stderr


def test_an_unsupported_release_keeps_the_in_tree_model_and_refuses_the_plugin(model_dir):
    out, err = _engines(model_dir, "0.34.0")
    assert "CLASS Mamba2ForCausalLM" in out  # vLLM's in-tree class
    refused = [line for line in out.splitlines() if line.startswith("EXPLICIT")]
    assert refused and "EXPLICIT refused:" in refused[0], out
    for text in (refused[0], err):  # the start-up error and the warning say the same
        assert "vLLM 0.34.0" in text and "0.26 - 0.32" in text and "VLLM_MAMBA2_PLUGIN_UNVERIFIED_VLLM=1" in text


def test_the_switch_registers_the_plugin_on_an_unsupported_release(model_dir):
    out, err = _engines(model_dir, "0.34.0", VLLM_MAMBA2_PLUGIN_UNVERIFIED_VLLM="1")
    assert "CLASS Mamba2PluginForCausalLM" in out and "EXPLICIT built" in out
    assert "VLLM_MAMBA2_PLUGIN_UNVERIFIED_VLLM=1" not in err
