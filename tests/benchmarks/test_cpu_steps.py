"""benchmarks/cpu_steps.py's summary: medians per engine and the median of the paired ratios, on made-up timings
(the engines themselves run in the benchmark, not here)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import cpu_steps  # noqa: E402


def test_the_ratio_is_the_median_of_the_pairs_not_of_the_medians():
    # A drifting host: each pair ran at its own speed; in-tree takes 10 % more in every pair but the first.
    times = {"plugin": [1.0, 2.0, 3.0, 4.0, 5.0], "intree": [0.5, 2.2, 3.3, 4.4, 5.5]}
    row = cpu_steps.summary("m", {"decode": {"times": times, "same_tokens": True},
                                  "prefill": {"times": times, "same_tokens": False}})
    d = row["decode"]
    assert (d["plugin_s"], d["intree_s"], d["ratio"], d["reps"]) == (3.0, 3.3, 1.1, 5)
    table = cpu_steps.table([row])
    assert "| m | decode | 3.000 | 3.300 | 1.100 | yes | 5 |" in table
    assert "| m | prefill | 3.000 | 3.300 | 1.100 | NO | 5 |" in table
