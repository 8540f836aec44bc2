"""The vLLM releases the plugin serves on, and what ``register()`` does on any other.

The code supports vLLM 0.26 through 0.32 (``compat.py`` bridges that range; 0.26 ran on the GPU, 0.32 on the
CPU). On another release -- newer ones move internals the plugin relies on (the runner, the KV-cache planning) --
``register()`` leaves vLLM's in-tree Mamba2 in charge of ``Mamba2ForCausalLM`` and logs one warning; asking for
the plugin's own architecture there fails at start-up with the same words. ``VLLM_MAMBA2_PLUGIN_UNVERIFIED_VLLM=1``
registers the plugin anyway. This module imports nothing of vLLM but its version: on an unsupported release the
plugin's other modules may not even import.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

SUPPORTED = ((0, 26), (0, 32))  # the first and last supported (major, minor) releases
FORCE_ENV = "VLLM_MAMBA2_PLUGIN_UNVERIFIED_VLLM"


def vllm_release() -> str:
    from vllm import __version__

    return __version__


def is_supported(version: str) -> bool:
    from packaging.version import Version

    return SUPPORTED[0] <= Version(version).release[:2] <= SUPPORTED[1]


def unsupported_message(version: str) -> str:
    (a, b), (c, d) = SUPPORTED
    return (f"vllm-mamba2-plugin supports vLLM {a}.{b} - {c}.{d} (verified: {a}.{b} on CUDA, {c}.{d} on the CPU), "
            f"not vLLM {version}: vLLM's in-tree Mamba2 serves Mamba2ForCausalLM instead. Install a supported vLLM "
            f"(pip install 'vllm>={a}.{b},<{c}.{d + 1}'), or set {FORCE_ENV}=1 to run the plugin on this release "
            "unverified.")


class RefuseUnsupportedVllm:
    """MODELS_CONFIG_MAP's entry for the plugin's own architecture on an unsupported release: start-up fails with
    the gate's message (vLLM calls the model-config hook first, the full-config hook later)."""

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        raise ValueError(unsupported_message(vllm_release()))

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        raise ValueError(unsupported_message(vllm_release()))


class UnsupportedVllmModel(torch.nn.Module):
    """The class registered under the plugin's own architecture on an unsupported release: inspectable by vLLM's
    registry like any generation model (no vLLM imports), and refusing to be built."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        raise ValueError(unsupported_message(vllm_release()))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError
