"""Kernel selection: one interface, three implementations.

``reference`` (plain torch) runs anywhere and is the oracle; ``cuda`` wraps mamba-ssm's Triton SSD kernels and
causal-conv1d's CUDA kernels, imported only when a CUDA tensor asks for it (importing mamba_ssm touches CUDA
state and loads extensions, which must never happen at plugin import or in ``register()``); ``cpu`` runs vLLM's
own CPU decode ops where the installed vLLM has them, and the reference for the rest.
Both modules export the same functions with the same signatures (``interface.Mamba2Kernels``): see
``reference.py`` for the contracts.
"""

import torch

from .. import envs
from . import reference
from .interface import Mamba2Kernels


def get_kernels(device: torch.device) -> Mamba2Kernels:
    if envs.kernel_choice() != "auto":
        return reference
    if device.type == "cuda":
        from . import cuda  # lazy: CUDA path only

        return cuda
    if device.type == "cpu":
        from . import cpu

        if cpu.available():
            return cpu
    return reference
