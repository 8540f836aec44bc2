"""benchmarks/grid_exactness.py on the CPU: one grid model per implementation through the script, one JSON line
each, the plugin's model class serving the plugin run and vLLM's in-tree class the other."""

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "grid_exactness.py")


def test_one_model_per_implementation(tmp_path):
    out = tmp_path / "grid.jsonl"
    for impl in ("plugin", "intree"):
        proc = subprocess.run([sys.executable, SCRIPT, "--impl", impl, "--mode", "eager", "--models", "h128n64",
                               "--prompts", "4", "--max-prompt", "40", "--max-tokens", "4", "--model-dir",
                               str(tmp_path / "models"), "--out", str(out)],
                              env=dict(os.environ), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    plugin, intree = [json.loads(line) for line in out.read_text().splitlines()]
    assert "error" not in plugin and "error" not in intree, (plugin.get("error"), intree.get("error"))
    assert plugin["model_class"] == "Mamba2PluginForCausalLM" and intree["model_class"] == "Mamba2ForCausalLM"
    # 4 prompts twice, one request with n = 2; h128n64 sets no dt limit, so in-tree agrees too.
    assert plugin["completions"] == intree["completions"] == 9
    assert plugin["exact"] == 9 and not plugin["wrong"], plugin
