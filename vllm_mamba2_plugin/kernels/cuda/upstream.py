"""The upstream kernels' entry points, imported once on first use, and the checks shared by the wrappers.

``kernels()`` imports mamba_ssm / causal_conv1d lazily: importing mamba_ssm loads the Mamba1 extension and sets a
global Triton allocator, which must never happen at plugin import or in ``register()``. The entry points are
the functions below the upstream's Python wrappers (autograd Functions, custom ops): inference needs no saved
tensors, and prefill steps are host-bound, so every wrapper layer skipped counts (each op module says which).
Tests replace ``_KERNELS`` with plain-torch stand-ins (tests/kernels/cuda/fakes.py).
"""

from __future__ import annotations

import functools
import logging
import os
from types import SimpleNamespace
from typing import Optional

import torch

from ... import envs
from . import triton_launch

logger = logging.getLogger(__name__)

_KERNELS: Optional[SimpleNamespace] = None
_INSTALL_HINT = (
    "vllm_mamba2_plugin's CUDA path needs the mamba-ssm and causal-conv1d packages: "
    "pip install mamba-ssm causal-conv1d (or: pip install 'vllm-mamba2-plugin[cuda]'); "
    "or set VLLM_MAMBA2_PLUGIN_KERNELS=reference to use the plain-torch kernels"
)


def kernels() -> SimpleNamespace:
    """The upstream kernel entry points, imported once, on first use (never at module import)."""
    global _KERNELS
    if _KERNELS is None:
        try:
            import causal_conv1d
            import causal_conv1d_cuda
            import mamba_ssm
            from mamba_ssm.ops.triton.layernorm_gated import _layer_norm_fwd
            from mamba_ssm.ops.triton.selective_state_update import (
                _selective_scan_update_kernel,
                selective_state_update,
            )
            from mamba_ssm.ops.triton.ssd_chunk_state import chunk_state_varlen
            from mamba_ssm.ops.triton.ssd_combined import _mamba_chunk_scan_combined_fwd
        except ImportError as e:
            raise ImportError(f"{_INSTALL_HINT} (import failed: {e})") from e
        check_upstream_versions({"mamba-ssm": mamba_ssm.__version__, "causal-conv1d": causal_conv1d.__version__})
        placed = _install_launch_path()
        _KERNELS = SimpleNamespace(
            ssd_fwd=fp32_products_in_ieee(_mamba_chunk_scan_combined_fwd),
            chunk_state_varlen=fp32_products_in_ieee(chunk_state_varlen),
            selective_state_update=selective_state_update,
            ssu_kernel=placed.get("_selective_scan_update_kernel", _selective_scan_update_kernel),
            layer_norm_fwd=_layer_norm_fwd,
            conv_fwd=causal_conv1d_cuda.causal_conv1d_fwd,
            conv_update=causal_conv1d_cuda.causal_conv1d_update,
        )
    return _KERNELS


_warned: set = set()  # what has been logged once (fallback reasons, unverified releases)

# The upstream releases the CUDA path is verified with: [lowest, first unverified); the "cuda" extra in
# pyproject.toml pins the same ranges.
VERIFIED_UPSTREAM = {"mamba-ssm": ("2.3", "2.4"), "causal-conv1d": ("1.7", "1.8")}


def check_upstream_versions(found: dict) -> None:
    """Refuse an upstream release older than the verified ones; warn once about a newer one. Older releases
    differ in what the plugin relies on: before mamba-ssm 2.2.6.post3 and causal-conv1d 1.5.3.post1 the decode
    kernels write padding rows (slot -1) one slot before the pool instead of skipping them."""
    from packaging.version import Version

    for dist, version in found.items():
        lowest, unverified = VERIFIED_UPSTREAM[dist]
        if Version(version) < Version(lowest):
            raise ImportError(
                f"vllm_mamba2_plugin's CUDA path needs {dist} >= {lowest} (verified: {lowest}.x; found {version}): "
                f"pip install '{dist}>={lowest},<{unverified}' (or: pip install 'vllm-mamba2-plugin[cuda]'); "
                "or set VLLM_MAMBA2_PLUGIN_KERNELS=reference to use the plain-torch kernels")
        if Version(version) >= Version(unverified) and dist not in _warned:
            _warned.add(dist)
            logger.warning("vllm_mamba2_plugin: %s %s is newer than the verified releases (%s.x); the CUDA path "
                           "may misbehave with it", dist, version, lowest)


# Triton's default precision for tl.dot of float32 operands (TRITON_F32_DEFAULT: read when a kernel is compiled,
# and part of Triton's cache key). Unset, it is TF32 on NVIDIA GPUs.
F32_DOT_PRECISION_ENV = "TRITON_F32_DEFAULT"
FP32_DOT_PRECISION = "ieee"  # benchmarks/ssd_precision.py measures the choices


def fp32_products_in_ieee(fn):
    """``fn`` (an SSD entry point; its first argument holds the activations) with its kernels compiled and run
    with IEEE float32 products when the activations are float32.

    mamba-ssm's SSD kernels multiply with ``tl.dot`` at Triton's default precision, TF32 for float32 operands
    (a 10-bit mantissa). With large step sizes that error changes greedy tokens of fp32 models (the model grid,
    benchmarks/RESULTS.md "Exactness"). torch keeps float32 matmuls in float32 by default; so do these kernels.
    16-bit activations are untouched: their products are 16-bit either way. Only the plugin calls these
    kernels, always through here, so every compile of their float32 specialisations happens inside this scope
    (Triton's in-process kernel cache is not keyed on the variable)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if args[0].dtype != torch.float32:
            return fn(*args, **kwargs)
        before = os.environ.get(F32_DOT_PRECISION_ENV)
        os.environ[F32_DOT_PRECISION_ENV] = FP32_DOT_PRECISION
        try:
            return fn(*args, **kwargs)
        finally:
            if before is None:
                del os.environ[F32_DOT_PRECISION_ENV]
            else:
                os.environ[F32_DOT_PRECISION_ENV] = before

    return call


def _install_launch_path() -> dict:
    """``triton_launch.install`` before the first launch, so the autotuners' first tuning already sees the
    extended config lists. A Triton or mamba-ssm whose internals differ keeps their own launch path (warned)."""
    fast, extended = envs.fast_launch(), envs.ssd_configs() == "extended"
    try:
        return triton_launch.install(fast_launch=fast, extra_configs=extended, direct_launch=envs.direct_launch())
    except Exception as e:
        if fast or extended:
            logger.warning("vllm_mamba2_plugin: could not install the fast Triton launch path / extended SSD "
                           "configs (%r); launching mamba-ssm's kernels through Triton as they come. "
                           "VLLM_MAMBA2_PLUGIN_FAST_LAUNCH=0 VLLM_MAMBA2_PLUGIN_SSD_CONFIGS=upstream "
                           "silence this.", e)
        return {}


def fallback(reason: str) -> None:
    """Log, once per reason, that a call goes to the plain-torch reference kernel instead."""
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("vllm_mamba2_plugin: %s; using the plain-torch reference kernel for it", reason)


CONV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # causal_conv1d.cpp:160-161, 477-478


def conv_unsupported(width: int, x_dtype, w_dtype) -> Optional[str]:
    """Why causal-conv1d cannot run this conv (None: it can)."""
    if not 2 <= width <= 4:  # causal_conv1d.cpp:182, 496
        return f"causal-conv1d supports conv widths 2..4, not {width}"
    if x_dtype not in CONV_DTYPES or w_dtype not in CONV_DTYPES:
        return f"causal-conv1d does not support dtypes {x_dtype}/{w_dtype}"
    return None


def unit_stride(idx: torch.Tensor) -> torch.Tensor:
    """A 1-D index tensor with stride 1. ``.contiguous()`` is not enough: it keeps any stride of a one-element
    tensor (a one-row step's slot, sliced from a block-table column, has the table's row stride), and
    causal-conv1d's update checks ``conv_state_indices.stride(0) == 1`` (causal_conv1d.cpp:521)."""
    return idx if idx.stride(0) == 1 else idx.clone(memory_format=torch.contiguous_format)
