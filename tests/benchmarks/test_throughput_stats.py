"""The throughput harness's paired prefill ratio (benchmarks/throughput.py), checked against hand-computed values."""

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

import throughput  # noqa: E402


def test_paired_ratio_is_the_geometric_mean_of_in_tree_over_plugin_per_pair():
    # Pair 1: in-tree took twice as long (2.0); pair 2: half as long (0.5): geometric mean 1.0, arithmetic 1.25.
    g, ratios = throughput.paired_prefill_ratio([1.0, 2.0], [2.0, 1.0])
    assert ratios == [2.0, 0.5]
    assert g == pytest.approx(1.0)
    # A slow host moment that hits both runs of a pair cancels: the plugin 10 % faster in every pair reads 1.1
    # whatever the host did between pairs, unlike a ratio of medians over differently slow runs.
    plugin = [1.0, 3.0, 1.5]
    g, _ = throughput.paired_prefill_ratio(plugin, [1.1 * p for p in plugin])
    assert g == pytest.approx(1.1)
    g, _ = throughput.paired_prefill_ratio([0.8, 1.25], [1.0, 1.0])
    assert g == pytest.approx(math.sqrt(1.25 * 0.8))


def test_paired_ratio_of_no_runs_is_none():
    assert throughput.paired_prefill_ratio([], []) == (None, [])


def test_engine_step_is_the_mean_full_batch_period_and_the_gap_explains_the_harness_step():
    # Long run: 224 more decode steps of 14 ms than the short run, and its other steps 0.56 s longer (host noise
    # in the mixed prefill steps). The harness's difference reads 14 + 560 / 224 = 16.5 ms per step.
    full = dict(mean_ms=14.0, outside_full_batch_ms=2950.0)
    mid = dict(mean_ms=14.0, outside_full_batch_ms=2390.0)
    r = dict(timeline=full, mid_timeline=mid, decode_step_s=(224 * 14.0 + 560.0) / 224 / 1e3)
    stats = throughput.engine_step_stats(r, floor_step_s=0.0112)
    assert stats["engine_step_ms"] == 14.0
    assert stats["floor_share_engine"] == pytest.approx(0.8)
    assert stats["outside_full_batch_gap_ms"] == pytest.approx(560.0)
    assert 1e3 * r["decode_step_s"] == pytest.approx(stats["engine_step_ms"] + stats["outside_full_batch_gap_ms"] / 224)
    assert throughput.engine_step_stats(dict(timeline=dict(steps=3)), 0.01) == {}


def test_markdown_row_carries_both_steps_and_the_engine_step_ratio():
    base = dict(model="130m", mode="graph", workload="decode", batch=256, state_dtypes=["torch.bfloat16"] * 2,
                out_tok_s=1000.0, total_tok_s=3000.0, decode_step_ms=16.0, floor_share=0.5,
                timeline=dict(median_ms=15.0))
    p = dict(base, impl="plugin", engine_step_ms=10.0, floor_share_engine=0.8)
    t = dict(base, impl="intree", engine_step_ms=12.0, floor_share_engine=2 / 3)
    row = throughput.markdown([p, t], 4.2e12, "cmd").splitlines()[-1]
    assert row.endswith("| 10.00 ms (80%) | 12.00 ms (67%) | 1.20 |"), row


def _job(model, dtype="auto", impl="plugin", batch=256):
    _, state = throughput.bytes_per_step(model, 1, (2, throughput.DTYPE_BYTES[dtype]))
    return dict(model=model, ssm_dtype=dtype, mode="graph", impl=impl, tag=f"{model}-{impl}-{dtype}",
                kv_cache_memory_bytes=(batch + throughput.PACK_SLOTS) * state)


def test_pack_keeps_pairs_together_splits_what_cannot_fit_and_never_exceeds_the_capacity():
    GiB = 1024**3
    jobs = [_job(m, d, i) for m, d in [("130m", "auto"), ("7b", "auto"), ("2048-48-p128-g8-n64", "float32"),
                                       ("2.7b", "float32")] for i in ("plugin", "intree")]
    capacity = 72 * GiB
    groups = throughput.pack_groups(jobs, capacity)
    assert sorted(j["tag"] for g in groups for j in g) == sorted(j["tag"] for j in jobs)
    for g in groups:
        assert sum(map(throughput.engine_memory, g)) <= capacity
    where = {j["tag"]: k for k, g in enumerate(groups) for j in g}
    # a pair that fits in one group starts in one group (its cells interleave)
    assert where["130m-plugin-auto"] == where["130m-intree-auto"]
    assert where["2048-48-p128-g8-n64-plugin-float32"] == where["2048-48-p128-g8-n64-intree-float32"]
    # a 7b pair at batch 256 (~50 GiB an engine) does not fit together: one engine per group
    assert throughput.engine_memory(_job("7b")) > 45 * GiB
    assert where["7b-plugin-auto"] != where["7b-intree-auto"]
    assert len(groups) < len(jobs)


def test_grid_table_pairs_the_implementations_and_takes_the_floor_share_of_engine_medians():
    def row(impl, median_ms, dtype="auto"):
        return dict(model="130m", ssm_cache_dtype=dtype, batch=256, impl=impl, workload="decode",
                    out_tok_s=1000.0 * 10 / median_ms, floor_step_s=0.004, timeline=dict(median_ms=median_ms))

    rows = [row("plugin", 5.0), row("intree", 8.0), row("plugin", 6.0, "float32")]  # fp32: no in-tree row
    lines = throughput.grid_table(rows).strip().splitlines()
    assert len(lines) == 3  # header, separator, the one complete pair
    assert lines[2] == "| 130m | bf16 | 256 | 2,000 / 1,250 (1.60) | 5.00 / 8.00 ms (1.60) | 4.00 ms | 80% / 50% |"
