"""benchmarks/trace_steps.py on a synthetic engine-core trace: steps, kernels attributed through their launches,
and the decode bandwidth by kernel family."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import throughput  # noqa: E402
import trace_steps  # noqa: E402


def _trace(batch, kernels, tokens=None):
    """One decode step of ``batch`` requests (0..1000 µs; ``tokens`` tokens, default one each) launching
    ``kernels`` ((name, µs), one after the other)."""
    name = f"execute_context_0(0)_generation_{batch}({tokens or batch})"
    events = [dict(ph="X", cat="user_annotation", name=name, ts=0.0, dur=1000.0, tid=1)]
    t = 2000.0
    for i, (name, dur) in enumerate(kernels):
        events.append(dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=10.0 + i, dur=1.0, tid=1,
                           args=dict(correlation=i)))
        events.append(dict(ph="X", cat="kernel", name=name, ts=t, dur=dur, args=dict(correlation=i)))
        t += dur
    return events


def test_decode_bandwidth_by_kernel_family():
    kernels = [("_selective_scan_update_kernel", 4000.0),
               ("void causal_conv1d_update_kernel<Ktraits>(Params)", 800.0),
               ("_layer_norm_fwd_1pass_kernel", 400.0), ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", 1500.0),
               ("triton_red_fused_add_rms_norm_0", 300.0)]
    want = throughput.decode_bytes_by_kernel("2.7b", 256, (2, 2))
    out = trace_steps.analyse(_trace(256, kernels), 10,
                              lambda b: throughput.decode_bytes_by_kernel("2.7b", b, (2, 2)))
    rows = {line.split()[0]: line for line in out.splitlines() if "GB/s" in line and "µs" in line}
    assert float(rows["state"].split()[2]) == 4000.0
    assert float(rows["state"].split()[-2]) == pytest.approx(want["state update"] / 4000.0 / 1e3, abs=1)
    assert float(rows["GEMM"].split()[-2]) == pytest.approx(want["GEMM"] / 1500.0 / 1e3, abs=1)
    assert float(rows["other"].split()[1]) == 300.0 and rows["other"].split()[-2] == "-"
    # 2.7b at batch 256: 64 layers x 256 x (80 x 64 x 128 x 2 bytes), read and written: 42.9 GB, + activations
    assert 42.9e9 < want["state update"] < 43.5e9
    assert "by kernel family" not in trace_steps.analyse(_trace(256, kernels), 10)  # only with --model


def test_verification_steps_are_a_class_of_their_own_without_bandwidth_lines():
    """Under speculative decoding a step of 16 requests and 64 tokens is "decode b16 t64", not plain decoding."""
    out = trace_steps.analyse(_trace(16, [("_selective_scan_update_kernel", 40.0)], tokens=64), 10,
                              lambda b: throughput.decode_bytes_by_kernel("2.7b", b, (2, 2)))
    assert out.splitlines()[0].startswith("== decode b16 t64: 1 steps, 64 tokens/step")
    assert "GB/s" not in out


def test_an_ops_host_cost_counts_its_direct_children_and_launches():
    """--op: a mixed step calling the op twice; nested ops count once (as their parent), launches by name."""
    step = dict(ph="X", cat="user_annotation", name="execute_context_2(600)_generation_8(8)", ts=0.0, dur=1000.0,
                tid=1)

    def op(name, ts, dur, cat="cpu_op"):
        return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, tid=1)

    events = [step,
              op("vllm::mixer", 10, 100), op("aten::empty", 12, 5), op("aten::index_select", 20, 30),
              op("aten::empty", 22, 5),  # inside index_select: not a direct child
              op("cuLaunchKernelEx", 60, 5, "cuda_driver"), op("cudaLaunchKernel", 70, 5, "cuda_runtime"),
              op("vllm::mixer", 200, 300), op("aten::view", 210, 5), op("aten::view", 220, 5),
              op("aten::view", 600, 5)]  # after the op: not its child
    calls = trace_steps.op_calls(events[1:], "vllm::mixer")
    assert calls == [(100, 4, 2), (300, 2, 0)]
    out = trace_steps.analyse(events, 5, op="vllm::mixer")
    assert "vllm::mixer: 2.0 calls per step; per call (median) 200 µs, 3 host ops, 1 launches" in out
    assert "not called" in trace_steps.analyse(events, 5, op="vllm::other")
