"""benchmarks/prefix_cache.py's harness on the CPU (``--smoke``): one engine with the plugin's prefix caching, its
report of hits against the ideal, the batch's steps and the Triton compiles during it."""

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "prefix_cache.py")


def test_the_smoke_workload_hits_every_shared_block_and_reports_its_steps(tmp_path):
    out = tmp_path / "prefix.jsonl"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([sys.executable, SCRIPT, "--model", "tiny", "--smoke", "--jobs", "plugin:on", "--out",
                           str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert "error" not in result, result["error"]
    assert result["mode"] == "on" and result["block"] == 8  # the smoke model's chunk
    assert result["ideal_hits"] == 8 * 40 // 8 * 8 and result["hit_share_of_ideal"] == 1.0, result
    assert result["prefill_steps"] >= 1 and result["steps"] > result["prefill_steps"], result
    assert result["compiles_in_batch"] in ([], None)  # no Triton kernels on the CPU path


def test_workloads_share_the_system_prompt_as_named():
    import torch

    sys.path.insert(0, os.path.dirname(SCRIPT))
    import prefix_cache

    spec = dict(requests=6, system=20, suffix_min=3, suffix_max=9)
    for workload, sharing in (("hits", [1] * 6), ("misses", [0] * 6), ("mixed", [0, 1] * 3)):
        system, lens, prompts = prefix_cache.workload_prompts(dict(spec, workload=workload), 500,
                                                              torch.Generator().manual_seed(0))
        assert [len(p) for p in prompts] == [20 + n for n in lens]
        assert [int(p[:20] == system) for p in prompts] == sharing
        assert prefix_cache.sharing_requests(workload, 6) == sum(sharing)
