"""The decode grid of benchmarks/throughput.py (--models grid): every shape is a Mamba2 config the plugin serves,
the grid spans what it promises, and the HBM floor of the shape the grid was made for is the one measured."""

import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

import throughput  # noqa: E402

from vllm_mamba2_plugin.validation import check_hf_config  # noqa: E402


def test_every_grid_shape_is_a_served_mamba2_config(tmp_path):
    for name in throughput.GRID:
        with open(os.path.join(throughput.write_config(name, str(tmp_path)), "config.json")) as f:
            check_hf_config(SimpleNamespace(**json.load(f)))
    shapes = [throughput.MODELS[n] for n in throughput.GRID]
    assert {m["head_dim"] for m in shapes} == {64, 128} and {m["state_size"] for m in shapes} == {64, 128}
    assert {m["n_groups"] for m in shapes} == {1, 4, 8} and len(shapes) >= 6
    assert {"130m", "2.7b", "7b"} <= set(throughput.GRID)
    assert min(m["num_hidden_layers"] for m in shapes) >= 24 and max(m["num_hidden_layers"] for m in shapes) <= 64


def test_floor_of_the_unbenchmarked_shape():
    """hidden 3072, 48 layers, 48 heads of 128, 4 groups, d_state 128, vocabulary 65 536, bf16: 6.2 GB of weights
    and 77.6 MB of state per request; ~10.7 ms per batch-256 step at 4.3 TB/s."""
    weights, state = throughput.bytes_per_step("3072-48-p128-g4-n128", 256, (2, 2))
    assert round(weights / 1e9, 1) == 6.2 and round(state / 1e6, 1) == 77.6
    assert abs((weights + 2 * 256 * state) / 4.3e12 - 10.7e-3) < 0.1e-3
