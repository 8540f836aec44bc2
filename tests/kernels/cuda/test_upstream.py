"""kernels/cuda/upstream.py: lazy import, one clear error without the packages, the launch path's fallback."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from vllm_mamba2_plugin.kernels import cuda as ck
from vllm_mamba2_plugin.kernels.cuda import upstream


def test_importing_cuda_module_does_not_import_kernels():
    code = ("import sys, vllm_mamba2_plugin.kernels.cuda; "
            "assert 'mamba_ssm' not in sys.modules and 'causal_conv1d' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))


@pytest.mark.skipif(importlib.util.find_spec("mamba_ssm") is not None, reason="mamba_ssm is installed")
def test_missing_packages_give_one_clear_error(monkeypatch):
    monkeypatch.setattr(upstream, "_KERNELS", None)
    with pytest.raises(ImportError, match="pip install mamba-ssm causal-conv1d"):
        ck.gated_rms_norm(torch.ones(2, 8), None, torch.ones(8), 1e-5, 8)


def test_launch_path_install_failure_falls_back_with_a_warning(monkeypatch, caplog):
    """If installing the fast launch path fails (a Triton or mamba-ssm whose internals differ), the kernels are
    still usable through Triton's own launch path, and the log says so once, naming the switches."""
    import types

    from vllm_mamba2_plugin.kernels.cuda import triton_launch

    fake = {name: types.ModuleType(name) for name in (
        "causal_conv1d_cuda", "mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton",
        "mamba_ssm.ops.triton.layernorm_gated", "mamba_ssm.ops.triton.selective_state_update",
        "mamba_ssm.ops.triton.ssd_chunk_state", "mamba_ssm.ops.triton.ssd_combined")}
    fake["causal_conv1d_cuda"].causal_conv1d_fwd = fake["causal_conv1d_cuda"].causal_conv1d_update = object()
    fake["mamba_ssm.ops.triton.layernorm_gated"]._layer_norm_fwd = object()
    ssu = fake["mamba_ssm.ops.triton.selective_state_update"]
    ssu._selective_scan_update_kernel, ssu.selective_state_update = object(), object()
    fake["mamba_ssm.ops.triton.ssd_chunk_state"].chunk_state_varlen = object()
    fake["mamba_ssm.ops.triton.ssd_combined"]._mamba_chunk_scan_combined_fwd = object()
    for name, mod in fake.items():
        monkeypatch.setitem(sys.modules, name, mod)

    def broken(**kw):
        raise AttributeError("'Autotuner' object has no attribute 'cache'")

    monkeypatch.setattr(triton_launch, "install", broken)
    monkeypatch.setattr(upstream, "_KERNELS", None)
    with caplog.at_level("WARNING"):
        k = upstream.kernels()
    assert k.ssu_kernel is ssu._selective_scan_update_kernel  # Triton's own object at the plugin's call site
    assert [r for r in caplog.records if "could not install the fast Triton launch path" in r.getMessage()
            and "VLLM_MAMBA2_PLUGIN_FAST_LAUNCH=0" in r.getMessage() and "no attribute 'cache'" in r.getMessage()]
