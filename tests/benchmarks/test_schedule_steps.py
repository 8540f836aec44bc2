"""benchmarks/schedule_steps.py: vLLM's scheduler with the plugin's state manager. With prefix caching and nothing
shared, each step continues at most one prompt, in the packed call (a prompt's last chunk runs to its end:
patches.py, 4), as without caching; vLLM's own cut, which also stops at each prompt's last block boundary, splits
the prompts and continues several per step. Shared prefixes are taken from the cache."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import schedule_steps  # noqa: E402

TINY = ["--model", "tiny", "--chunk-size", "16", "--requests", "12", "--system", "96", "--suffix-min", "8",
        "--suffix-max", "40", "--new", "4", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
        "--num-blocks", "256"]


def _measure(*extra):
    return schedule_steps.measure(schedule_steps.parser().parse_args(TINY + list(extra)))


def test_misses_with_caching_take_one_ssd_call_per_layer_as_without():
    off, on = _measure("--workload", "misses")
    assert not off["caching"] and on["caching"] and not on["vllm_cut"]
    assert on["prefill_tokens"] == off["prefill_tokens"] and on["prefill_steps"] > 4
    for result in (off, on):
        assert set(result["paths"]) <= {"none", "native"} and result["ssd_calls_per_layer"] == 1.0, result
        assert result["second_pass_steps"] == 0
    (cut,) = _measure("--workload", "misses", "--caching", "on", "--vllm-cut")
    assert cut["prefill_seqs_per_step"] > on["prefill_seqs_per_step"] and "rows" in cut["paths"], cut


def test_hits_skip_the_shared_blocks():
    off, on = _measure("--workload", "hits")
    # every request but the ones of the first step takes the 96 shared tokens (6 blocks) from the cache
    assert off["prefill_tokens"] - on["prefill_tokens"] == pytest.approx(12 * 96, rel=0.25), (off, on)


def test_a_mixed_workloads_continued_prompts_lead_the_cache_hits():
    """Every other request shares the system prompt: a prompt continued from the previous step shares steps with
    cache hits. It takes the packed call's own state (``VarlenPlan.first_native``), the hits go as row groups, and
    no step needs a second pass for its boundary states."""
    (on,) = _measure("--workload", "mixed", "--caching", "on")
    assert on["first_native_with_groups"] > 0 and on["second_pass_steps"] == 0, on


def test_prefill_steps_come_as_prefill_layer_layouts():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import prefill_layer

    (on,) = _measure("--workload", "mixed", "--caching", "on", "--layouts", "3")
    assert len(on["layouts"]) == 3 and on["prefill_steps"] >= 3, on
    for layout in on["layouts"]:
        nd, lengths, resumed = prefill_layer.parse_layout(layout)
        assert lengths and all(r is False or r > 0 for r in resumed), layout
    assert any("@" in layout for layout in on["layouts"])  # the mixed workload continues prompts
