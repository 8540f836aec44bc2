"""Kernel selection: one interface, two implementations.

``reference`` (plain torch) runs anywhere and is the oracle; ``cuda`` wraps mamba-ssm's Triton SSD kernels and
causal-conv1d's CUDA kernels, imported only when a CUDA tensor asks for it (importing mamba_ssm touches CUDA
state and loads extensions, which must never happen at plugin import or in ``register()``).
Both modules export the same functions with the same signatures (``interface.Mamba2Kernels``): see
``reference.py`` for the contracts.
"""

import torch

from .. import envs
from . import reference
from .interface import Mamba2Kernels


def get_kernels(device: torch.device) -> Mamba2Kernels:
    if device.type == "cuda" and envs.kernel_choice() == "auto":
        from . import cuda  # lazy: CUDA path only

        return cuda
    return reference
