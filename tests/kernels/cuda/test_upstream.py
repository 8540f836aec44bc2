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


@pytest.mark.parametrize("versions, refused", [(("2.2.6.post3", "1.7.0"), "mamba-ssm >= 2.3"),
                                               (("2.3.2.post1", "1.5.3.post1"), "causal-conv1d >= 1.7")])
def test_upstream_releases_older_than_the_verified_ones_are_refused(monkeypatch, versions, refused):
    """One clear error naming the package, the version found and the fix, before any kernel is handed out."""
    from vllm_mamba2_plugin.kernels.cuda import triton_launch

    _fake_upstream(monkeypatch, object(), object(), versions)
    monkeypatch.setattr(triton_launch, "install", lambda **kw: {})
    monkeypatch.setattr(upstream, "_KERNELS", None)
    with pytest.raises(ImportError, match=refused) as e:
        upstream.kernels()
    assert "found" in str(e.value) and "pip install" in str(e.value) and "VLLM_MAMBA2_PLUGIN_KERNELS" in str(e.value)
    assert upstream._KERNELS is None


def test_a_newer_upstream_release_is_used_with_one_warning(monkeypatch, caplog):
    from vllm_mamba2_plugin.kernels.cuda import triton_launch

    _fake_upstream(monkeypatch, object(), object(), ("2.4.0", "1.7.0"))
    monkeypatch.setattr(triton_launch, "install", lambda **kw: {})
    monkeypatch.setattr(upstream, "_warned", set())
    for _ in range(2):
        monkeypatch.setattr(upstream, "_KERNELS", None)
        with caplog.at_level("WARNING"):
            assert upstream.kernels() is not None
    assert len([r for r in caplog.records if "mamba-ssm 2.4.0 is newer" in r.getMessage()]) == 1


def test_launch_path_install_failure_falls_back_with_a_warning(monkeypatch, caplog):
    """If installing the fast launch path fails (a Triton or mamba-ssm whose internals differ), the kernels are
    still usable through Triton's own launch path, and the log says so once, naming the switches."""
    from vllm_mamba2_plugin.kernels.cuda import triton_launch

    ssu = _fake_upstream(monkeypatch, object(), object())["mamba_ssm.ops.triton.selective_state_update"]

    def broken(**kw):
        raise AttributeError("'Autotuner' object has no attribute 'cache'")

    monkeypatch.setattr(triton_launch, "install", broken)
    monkeypatch.setattr(upstream, "_KERNELS", None)
    with caplog.at_level("WARNING"):
        k = upstream.kernels()
    assert k.ssu_kernel is ssu._selective_scan_update_kernel  # Triton's own object at the plugin's call site
    assert [r for r in caplog.records if "could not install the fast Triton launch path" in r.getMessage()
            and "VLLM_MAMBA2_PLUGIN_FAST_LAUNCH=0" in r.getMessage() and "no attribute 'cache'" in r.getMessage()]


@pytest.mark.parametrize("dtype, before, want", [(torch.float32, None, "ieee"), (torch.float32, "tf32", "ieee"),
                                                 (torch.bfloat16, None, None), (torch.float16, "tf32", "tf32")])
def test_fp32_ssd_products_are_ieee(monkeypatch, dtype, before, want):
    """mamba-ssm's SSD kernels compile and run with IEEE float32 products for float32 activations (Triton's
    default for tl.dot of float32 operands is TF32 on NVIDIA GPUs, whose error changes greedy tokens of fp32
    models); 16-bit activations keep whatever the process set. The variable is restored after the call."""
    seen = []

    def entry(x, *args, **kwargs):
        seen.append(os.environ.get(upstream.F32_DOT_PRECISION_ENV))
        return "result"

    if before is None:
        monkeypatch.delenv(upstream.F32_DOT_PRECISION_ENV, raising=False)
    else:
        monkeypatch.setenv(upstream.F32_DOT_PRECISION_ENV, before)
    assert upstream.fp32_products_in_ieee(entry)(torch.zeros(2, 3, dtype=dtype), 1, k=2) == "result"
    assert seen == [want]
    assert os.environ.get(upstream.F32_DOT_PRECISION_ENV) == before


def test_the_ssd_entry_points_are_the_ieee_ones(monkeypatch):
    """kernels() hands out the SSD forward and chunk_state_varlen inside fp32_products_in_ieee."""
    from vllm_mamba2_plugin.kernels.cuda import triton_launch

    seen = []
    _fake_upstream(monkeypatch,
                   lambda *a, **k: seen.append(("fwd", os.environ.get(upstream.F32_DOT_PRECISION_ENV))),
                   lambda *a: seen.append(("varlen", os.environ.get(upstream.F32_DOT_PRECISION_ENV))))
    monkeypatch.setattr(triton_launch, "install", lambda **kw: {})
    monkeypatch.setattr(upstream, "_KERNELS", None)
    monkeypatch.delenv(upstream.F32_DOT_PRECISION_ENV, raising=False)
    k = upstream.kernels()
    x = torch.zeros(4, 2, 8)
    k.ssd_fwd(x, x, x)
    k.chunk_state_varlen(x, x)
    assert seen == [("fwd", "ieee"), ("varlen", "ieee")]


def _fake_upstream(monkeypatch, ssd_fwd, chunk_state_varlen, versions=("2.3.2.post1", "1.7.0")) -> dict:
    """Stand-in modules for what ``upstream.kernels()`` imports, with these SSD entry points and (mamba-ssm,
    causal-conv1d) versions; returns them."""
    import types

    fake = {name: types.ModuleType(name) for name in (
        "causal_conv1d", "causal_conv1d_cuda", "mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton",
        "mamba_ssm.ops.triton.layernorm_gated", "mamba_ssm.ops.triton.selective_state_update",
        "mamba_ssm.ops.triton.ssd_chunk_state", "mamba_ssm.ops.triton.ssd_combined")}
    fake["mamba_ssm"].__version__, fake["causal_conv1d"].__version__ = versions
    fake["causal_conv1d_cuda"].causal_conv1d_fwd = fake["causal_conv1d_cuda"].causal_conv1d_update = object()
    fake["mamba_ssm.ops.triton.layernorm_gated"]._layer_norm_fwd = object()
    ssu = fake["mamba_ssm.ops.triton.selective_state_update"]
    ssu._selective_scan_update_kernel, ssu.selective_state_update = object(), object()
    fake["mamba_ssm.ops.triton.ssd_chunk_state"].chunk_state_varlen = chunk_state_varlen
    fake["mamba_ssm.ops.triton.ssd_combined"]._mamba_chunk_scan_combined_fwd = ssd_fwd
    for name, mod in fake.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return fake
