"""The kernel interface: what the mixer calls, and what ``kernels.reference`` and ``kernels.cuda`` both export.

Each member's contract (shapes, dtypes, padding rows, initial-state flags) is the reference implementation's
docstring; the CUDA module wraps the upstream kernels behind the same names and parameters (it may add keyword
parameters with defaults). ``tests/test_kernel_interface.py`` checks both modules against this Protocol.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence, Tuple

import torch


class Mamba2Kernels(Protocol):
    def plan_prefill(self, cu_seqlens_cpu: torch.Tensor, has_initial_state_cpu: Optional[torch.Tensor],
                     num_tokens: int, chunk_size: int, conv_width: int, device: torch.device,
                     boundary_offsets: Optional[list] = None) -> object:
        """The step's prefill index plan, shared by every layer (None where the implementation needs none);
        with prefix caching's boundary offsets (per sequence) it plans their states too."""

    def ssd_chunk_scan(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       chunk_size: int, cu_seqlens: torch.Tensor, initial_states: Optional[torch.Tensor] = None,
                       has_initial_state: Optional[torch.Tensor] = None, D: Optional[torch.Tensor] = None,
                       plan: object = None, dt_bias: Optional[torch.Tensor] = None,
                       dt_limit: Tuple[float, float] = (0.0, float("inf")), state_dtype: torch.dtype = torch.float32,
                       boundary_offsets: Optional[Sequence[Sequence[int]]] = None) -> tuple:
        """(y, final states[, boundary states]) of a packed varlen prefill."""

    def causal_conv1d(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      cu_seqlens: torch.Tensor, initial_states: Optional[torch.Tensor] = None,
                      has_initial_state: Optional[torch.Tensor] = None, activation: Optional[str] = "silu",
                      plan: object = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """(conv outputs, final conv states) of a packed varlen prefill."""

    def conv_states_at(self, x: torch.Tensor, cu_seqlens: torch.Tensor, width: int,
                       boundary_offsets: Sequence[Sequence[int]], initial_states: Optional[torch.Tensor] = None,
                       has_initial_state: Optional[torch.Tensor] = None, plan: object = None) -> torch.Tensor:
        """The conv states at prefix caching's block boundaries."""

    def conv_update(self, x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor,
                    bias: Optional[torch.Tensor], state_indices: torch.Tensor,
                    activation: Optional[str] = "silu") -> torch.Tensor:
        """One decode token per row through the conv, the pool updated in place."""

    def ssm_state_update(self, ssm_states: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                         B: torch.Tensor, C: torch.Tensor, state_indices: torch.Tensor,
                         D: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
                         dt_softplus: bool = False) -> torch.Tensor:
        """One decode token per row through the SSM, the pool updated in place."""

    def process_dt(self, dt_raw: torch.Tensor, dt_bias: torch.Tensor,
                   dt_limit: Tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
        """softplus(dt + dt_bias), clamped to dt_limit, in float32."""

    def gated_rms_norm(self, x: torch.Tensor, z: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                       group_size: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The gated RMSNorm per group (norm_before_gate=False)."""

    def warm_up(self, layer, projected: torch.Tensor, decode_graphs: bool) -> None:
        """Compile every kernel launch a step can need, in the profile run (a no-op where nothing compiles)."""
