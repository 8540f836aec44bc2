"""benchmarks/prefill_layer.py's prefix-caching steps (``--block``): the block table it builds and the boundaries
the plugin's metadata builder reads from it; its ``--kernels stub`` mode (stub_kernels.py)."""

import collections
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import prefill_layer  # noqa: E402
import stub_kernels  # noqa: E402

from vllm_mamba2_plugin import compat  # noqa: E402
from vllm_mamba2_plugin.kernels.cuda import varlen_plan  # noqa: E402


def _layer():
    return prefill_layer.make_layer("tiny", torch.float32, torch.device("cpu"))


def test_a_prefix_caching_step_gives_each_request_a_block_per_block_size_tokens():
    layer = _layer()
    step = prefill_layer.make_step(layer, 0, [300, 600], [True, False], torch.float32, torch.device("cpu"),
                                   block=256, resume_context=100)
    table = step["table"]
    used = table[:, :3].reshape(-1)
    assert (used > 0).all() and used.unique().numel() == 6  # 400 and 600 tokens: 2 and 3 blocks, distinct slots
    assert step["slots"].tolist() == [int(table[0, 1]), int(table[1, 2])]  # the block of each last token
    assert step["pools"][1].shape[0] == 2 * 3 + 1
    holder = [None]
    run, _ = prefill_layer.plugin_runner(layer, step, torch.device("cpu"), holder)
    layer.kv_cache = prefill_layer.fresh_pools(step, torch.float32, torch.device("cpu"))
    with mock.patch.object(compat, "layer_metadata", lambda prefix: holder[0]), torch.no_grad():
        run()
    meta = holder[0]
    # Resumed after 100 tokens: the boundary at 256 is 156 tokens in; the fresh prompt crosses 256 and 512.
    assert meta.prefill.boundary_offsets == [[156], [256, 512]]
    assert meta.prefill.boundary_slots.tolist() == [int(table[0, 0]), int(table[1, 0]), int(table[1, 1])]


def test_without_blocks_each_request_owns_one_slot():
    layer = _layer()
    step = prefill_layer.make_step(layer, 2, [40], [False], torch.float32, torch.device("cpu"))
    assert step["block"] == 0 and step["slots"].tolist() == step["table"][:, 0].tolist()
    assert step["pools"][0].shape[0] == 2 * 3 + 1
    holder = [None]
    prefill_layer.plugin_runner(layer, step, torch.device("cpu"), holder)
    assert not layer.prefix_caching


def test_a_steps_first_layer_builds_its_metadata_afresh_and_computes_the_same_layer():
    """``run.first_layer`` (--host-profile's sync check): a new metadata build, then the layer; the same output as
    the layer on the runner's own metadata, from identical pools."""
    layer = _layer()
    step = prefill_layer.make_step(layer, 1, [300, 600], [True, False], torch.float32, torch.device("cpu"),
                                   block=256, resume_context=100)
    holder = [None]
    run, _ = prefill_layer.plugin_runner(layer, step, torch.device("cpu"), holder)
    outs, metas = [], []
    with mock.patch.object(compat, "layer_metadata", lambda prefix: holder[0]), torch.no_grad():
        for fn in (run, run.first_layer):
            layer.kv_cache = prefill_layer.fresh_pools(step, torch.float32, torch.device("cpu"))
            outs.append(fn().clone())
            metas.append(holder[0])
    assert metas[0] is not metas[1] and metas[1].prefill.boundary_offsets == metas[0].prefill.boundary_offsets
    assert torch.equal(outs[0], outs[1])


def test_a_layout_can_give_each_continued_prompt_its_computed_tokens():
    nd, lengths, resumed = prefill_layer.parse_layout("d2+r41@64+r16+32")
    assert (nd, lengths, resumed) == (2, [41, 16, 32], [64, True, False])
    step = prefill_layer.make_step(_layer(), nd, lengths, resumed, torch.float32, torch.device("cpu"),
                                   resume_context=7)
    assert step["context"].tolist() == [600, 600, 64, 7, 0]


def test_stub_kernels_run_the_cuda_path_and_count_its_torch_ops():
    """--kernels stub: a mixed step's layer goes through the CUDA wrappers (the builder's varlen plan, every upstream
    entry point it needs, once per layer) on the CPU, and measure() counts the torch ops the layer calls."""
    layer = _layer()
    layer.norm_in_op = True
    step = prefill_layer.make_step(layer, 2, [40, 300], [True, False], torch.float32, torch.device("cpu"))
    calls = collections.Counter()

    def counted(name):
        fn = getattr(stub_kernels.STUBS, name)
        return mock.patch.object(stub_kernels.STUBS, name, lambda *a, **k: calls.update([name]) or fn(*a, **k))

    holder = [None]
    with mock.patch.object(compat, "layer_metadata", lambda prefix: holder[0]), stub_kernels.installed(), \
            counted("ssd_fwd"), counted("conv_fwd"), counted("conv_update"), counted("selective_state_update"), \
            counted("layer_norm_fwd"), torch.no_grad():
        run, _ = prefill_layer.plugin_runner(layer, step, torch.device("cpu"), holder)
        layer.kv_cache = prefill_layer.fresh_pools(step, torch.float32, torch.device("cpu"))
        r = prefill_layer.measure(run, torch.device("cpu"), iters=2, rows=5)
    assert isinstance(holder[0].prefill.plan, varlen_plan.VarlenPlan)
    layers = 3 + 2 + 2  # measure(): warm-up, timed, profiled
    assert calls["conv_update"] == calls["selective_state_update"] == layers  # the decode rows
    assert calls["layer_norm_fwd"] == 2 * layers  # decode rows and prompts, each normed into its rows
    assert calls["ssd_fwd"] >= layers and calls["conv_fwd"] >= layers
    assert r["torch_ops"] > 20 and r["kernels"] == [] and r["host_ops"]
