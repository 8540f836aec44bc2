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
