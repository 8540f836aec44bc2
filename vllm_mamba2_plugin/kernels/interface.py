"""The kernel interface: what the mixer calls, and what ``kernels.reference`` and ``kernels.cuda`` both export.

Each member's contract (shapes, dtypes, padding rows, initial-state flags) is the reference implementation's
docstring; the CUDA module wraps the upstream kernels behind the same names and parameters (it may add keyword
parameters with defaults). ``tests/test_kernel_interface.py`` checks both modules against this Protocol.
The prefill ops take one ``PrefillBatch`` (built once per step) and return named results.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Protocol, Sequence, Tuple, Union

import torch


@dataclass(frozen=True)
class PrefillBatch:
    """One step's packed prefill block: S sequences, back to back, of T tokens in all. Built once per step (the
    metadata builder: ``PrefillBatch.build``), shared by every layer, and the one answer to "does sequence s
    resume a saved state" (the SSM's calls, the conv's layout and the state selection all read it).

    cu_seqlens_cpu: (S+1,) int64 host token bounds, non-decreasing (the conv needs them to start at 0)
    cu_seqlens:     (S+1,) int32, the same on the kernels' device
    resumes_cpu:    (S,) bool host: True where sequence s starts from its saved state (initial_states[s]); False
                    starts from zeros whatever its slot holds (vLLM never zeroes a slot)
    resumes:        (S,) bool, the same on the device
    chunk_size:     the SSD chunk length
    slots:          (S,) int64 device: each sequence's state slot (the mixer's; None in direct kernel calls)
    plan:           the implementation's index plan (``plan_prefill``: CUDA's ``varlen_plan.VarlenPlan``;
                    None for the reference, and where the CUDA ops are to build it themselves)
    boundary_offsets: prefix caching: per sequence, the token counts (of this step's tokens, 0 < o <= its
                    length, ascending) after which a block boundary's state is kept; None without (or none)
    boundary_slots: (M,) int64 device: the slots of those M states, in order (the mixer's; may be None)
    initial_slots:  (S,) int64 device: where each resuming sequence's saved state is, when not in its slot
                    (speculative decoding's state ring, spec_decode.py); None: in ``slots``
    """

    cu_seqlens_cpu: torch.Tensor
    cu_seqlens: torch.Tensor
    resumes_cpu: torch.Tensor
    resumes: torch.Tensor
    chunk_size: int
    slots: Optional[torch.Tensor] = None
    plan: object = None
    boundary_offsets: Optional[List[List[int]]] = None
    boundary_slots: Optional[torch.Tensor] = None
    initial_slots: Optional[torch.Tensor] = None

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens_cpu.numel() - 1

    @functools.cached_property
    def any_resumes(self) -> bool:
        """Whether any sequence reads a saved state (all-fresh prompts: the slots are not read); once per step."""
        return bool(self.resumes_cpu.any())

    @classmethod
    def build(cls, kernels: "Mamba2Kernels", cu_seqlens_cpu: torch.Tensor, resumes_cpu: torch.Tensor,
              num_tokens: int, chunk_size: int, conv_width: int, device: torch.device, *,
              cu_seqlens: Optional[torch.Tensor] = None, slots: Optional[torch.Tensor] = None,
              boundary_offsets: Optional[list] = None, boundary_slots: Optional[torch.Tensor] = None,
              initial_slots: Optional[torch.Tensor] = None) -> "PrefillBatch":
        """The batch with ``kernels``' plan (one upload for the plan's tensors and the resume mask). Host
        tensors in; cu_seqlens (the device bounds) is uploaded when not given."""
        cu_cpu, resumes_cpu = cu_seqlens_cpu.to(torch.int64), resumes_cpu.to(torch.bool)
        plan = kernels.plan_prefill(cu_cpu, resumes_cpu, num_tokens, chunk_size, conv_width, device,
                                    boundary_offsets=boundary_offsets)
        resumes = getattr(plan, "resume_mask", None)
        if resumes is None:
            resumes = upload(resumes_cpu, device)
        if cu_seqlens is None:
            cu_seqlens = upload(cu_cpu.to(torch.int32), device)
        return cls(cu_cpu, cu_seqlens, resumes_cpu, resumes, int(chunk_size), slots, plan, boundary_offsets,
                   boundary_slots, initial_slots)

    @classmethod
    def of(cls, cu_seqlens, resumes: Union[bool, Sequence[bool], torch.Tensor, None] = None, chunk_size: int = 256,
           *, device: Optional[torch.device] = None, kernels: Optional["Mamba2Kernels"] = None,
           conv_width: int = 4, num_tokens: Optional[int] = None, boundary_offsets: Optional[list] = None,
           ) -> "PrefillBatch":
        """A batch for a direct kernel call (tests, benchmarks, oracles): bounds and flags as anything
        tensor-like, on any device (read on the host: a sync for device tensors); resumes None or False: no
        sequence resumes, True: every one. With ``kernels``, their plan (num_tokens: default the last bound);
        without, none (the CUDA ops then plan the call themselves)."""
        cu_cpu = torch.as_tensor(cu_seqlens).detach().cpu().to(torch.int64)
        S = cu_cpu.numel() - 1
        if resumes is None or isinstance(resumes, bool):
            flags = torch.full((S,), bool(resumes), dtype=torch.bool)
        else:
            flags = torch.as_tensor(resumes).detach().cpu().to(torch.bool)
        if flags.numel() != S:
            raise ValueError(f"{flags.numel()} resume flags for {S} sequences")
        dev = torch.device(device) if device is not None else (
            cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else torch.device("cpu"))
        offsets = None if boundary_offsets is None else [list(o) for o in boundary_offsets]
        if kernels is not None:
            T = int(cu_cpu[-1]) if num_tokens is None else num_tokens
            return cls.build(kernels, cu_cpu, flags, T, chunk_size, conv_width, dev, boundary_offsets=offsets)
        return cls(cu_cpu, cu_cpu.to(device=dev, dtype=torch.int32), flags, flags.to(dev), int(chunk_size),
                   boundary_offsets=offsets)


class ScanResult(NamedTuple):
    """What ``ssd_chunk_scan`` returns."""

    y: torch.Tensor  # (T, H, P) in x's dtype
    final_states: torch.Tensor  # (S, H, P, N) in state_dtype
    boundary_states: Optional[torch.Tensor] = None  # (M, H, P, N) in state_dtype, with the batch's boundary offsets


class ConvResult(NamedTuple):
    """What ``causal_conv1d`` returns."""

    out: torch.Tensor  # (T, D) in x's dtype
    final_states: torch.Tensor  # (S, W-1, D) in x's dtype


def block_boundary_offsets(context: int, query: int, block_size: int) -> range:
    """Prefix caching: the token counts o (0 < o < query) after which a row of ``query`` tokens on top of
    ``context`` crosses a block boundary before its last token, (b + 1) * block_size - context for the blocks
    b = context // block_size, ... (the state after o tokens belongs to block (context + o) // block_size - 1)."""
    return range(context // block_size * block_size + block_size - context, query, block_size)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``, pinned and non-blocking on CUDA: a copy from pageable memory would make the
    host wait for the GPU work already queued (the previous step's)."""
    device = torch.device(device)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


class Mamba2Kernels(Protocol):
    # The integer type of the slot ids that ssm_state_update takes without a cast: the mixer passes the step's
    # slots in it (every layer would otherwise cast them again). Other integer types are cast.
    STATE_UPDATE_INDEX_DTYPE: torch.dtype

    def plan_prefill(self, cu_seqlens_cpu: torch.Tensor, has_initial_state_cpu: Optional[torch.Tensor],
                     num_tokens: int, chunk_size: int, conv_width: int, device: torch.device,
                     boundary_offsets: Optional[list] = None) -> object:
        """The step's prefill index plan, shared by every layer (None where the implementation needs none);
        with prefix caching's boundary offsets (per sequence) it plans their states too. ``PrefillBatch.build``
        calls it."""

    def ssd_chunk_scan(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       batch: PrefillBatch, initial_states: Optional[torch.Tensor] = None,
                       D: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
                       dt_limit: Tuple[float, float] = (0.0, float("inf")),
                       state_dtype: torch.dtype = torch.float32) -> ScanResult:
        """The chunked SSD scan of a packed prefill batch (with its boundary offsets: their states too)."""

    def causal_conv1d(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      batch: PrefillBatch, initial_states: Optional[torch.Tensor] = None,
                      activation: Optional[str] = "silu") -> ConvResult:
        """The depthwise causal conv of a packed prefill batch, and its final conv states."""

    def conv_states_at(self, x: torch.Tensor, width: int, batch: PrefillBatch,
                       initial_states: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The conv states at the batch's block boundaries (prefix caching)."""

    def conv_update(self, x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor,
                    bias: Optional[torch.Tensor], state_indices: torch.Tensor,
                    activation: Optional[str] = "silu") -> torch.Tensor:
        """One decode token per row (x (B, D)), or L per row one after another (x (B, L, D)), through the conv,
        the pool updated in place."""

    def ssm_state_update(self, ssm_states: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                         B: torch.Tensor, C: torch.Tensor, state_indices: torch.Tensor,
                         D: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
                         dt_softplus: bool = False, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One decode token per row through the SSM, the pool updated in place; y written into ``out`` (any
        strides) when given."""

    def process_dt(self, dt_raw: torch.Tensor, dt_bias: torch.Tensor,
                   dt_limit: Tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
        """softplus(dt + dt_bias), clamped to dt_limit, in float32."""

    def gated_rms_norm(self, x: torch.Tensor, z: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                       group_size: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The gated RMSNorm per group (norm_before_gate=False)."""

    def warm_up(self, layer, projected: torch.Tensor, decode_graphs: bool) -> None:
        """Compile every kernel launch a step can need, in the profile run (a no-op where nothing compiles)."""
