"""The plugin's SSM "attention" backend: metadata per step for the Mamba2 mixer layers.

vLLM builds one metadata object per step for each KV-cache group; every mixer layer of the group reads it
from the forward context under its own prefix. The builder turns the runner's CommonAttentionMetadata into
what the mixer needs:

    decodes first   rows [0, num_decodes): one token each, resuming a request that already has state;
                    they go through the one-step conv/SSM updates, batched by state slot.
    prefills after  rows [num_decodes, num_reqs): everything else, packed varlen, each with its state slot and
                    a resume flag (a resumed chunk, or a 1-token row that the runner sorted among prefills,
                    starts from the state saved in its slot): one ``kernels.interface.PrefillBatch``.

The V1 runner puts rows with query_len <= reorder_batch_threshold (= 1) first, but a fresh 1-token prompt
can sit among them and the V2 runner sorts by its own key. So the decode block is the *leading run* of rows
that are one token and have state; whatever follows is handled by the prefill path, which is correct for any
row (it honours has-initial-state), only less specialised.

Speculative decoding (spec_decode.py): decode rows are those of 1 to 1 + k tokens on top of state, run position by
position (``verify``), and every state goes to its column of the request's ring of 1 + k blocks (with prefix
caching, a ring that moves along the row with the blocks; prefill rows then take their boundaries from it too).

Slots: with mamba_cache_mode "none" each request owns one block, ``block_table_tensor[:, 0]``. Mamba state
is never zeroed on allocation, so has-initial-state is what keeps a new request from seeing an old one's state.

CUDA graphs: mixed steps replay piecewise graphs (the mixer op is a split point and runs eagerly). By default
(VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS=1) the builder also supports FULL graphs of decode-only steps
(UNIFORM_SINGLE_TOKEN_DECODE, as vLLM's in-tree Mamba2): the runner pads such a batch to a captured size with
rows of zero tokens whose block-table entry is the null block. The runner picks a FULL graph from the batch's
shape alone (every row one token, fresh one-token prompts included), so every batch of that shape gets the graph
metadata: every row a decode, the slots in the persistent buffers of ``decode_graph.DecodeGraphSlots``, padding
rows on PAD_SLOT, fresh rows' slots zeroed first (the invariants are in decode_graph.py). Under speculative decoding
(unless VLLM_MAMBA2_PLUGIN_SPEC_FULL_GRAPHS=0) the same holds for batches of 1 + k tokens per row (UNIFORM_BATCH).
"""

from dataclasses import dataclass
from typing import Optional

import torch

from . import compat, envs
from .decode_graph import DecodeGraphSlots
from .kernels import get_kernels
from .kernels.interface import PrefillBatch, block_boundary_offsets, upload
from .spec_decode import PrefillRing, UniformVerify, VerifyPosition, prefill_ring, ring_column, verify_positions


class Mamba2PluginBackend(compat.AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "MAMBA2_PLUGIN"

    @staticmethod
    def get_builder_cls() -> type["Mamba2PluginMetadataBuilder"]:
        return Mamba2PluginMetadataBuilder

    @classmethod
    def is_ssm(cls) -> bool:
        return True

    # An SSM backend has no attention implementation and no paged KV layout; vLLM never asks for them
    # on an is_ssm() backend, but older releases declare them abstract.
    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("Mamba2PluginBackend has no attention implementation")

    @staticmethod
    def get_kv_cache_shape(*args, **kwargs):
        raise NotImplementedError("Mamba2 state shapes come from Mamba2StateSpec, not a KV-cache shape")


@dataclass
class Mamba2PluginMetadata:
    """What one engine step tells the Mamba2 mixer layers (shared by every layer of the group)."""

    num_decodes: int
    num_decode_tokens: int  # == num_decodes (one token each), up to (1 + k) x that under speculative decoding
    num_prefills: int
    num_prefill_tokens: int
    chunk_size: int
    state_indices_d: torch.Tensor  # (num_decodes,) int64, state slot of each decode row
    state_indices_d_i32: torch.Tensor  # the same, int32 (the conv kernel's index type)
    # The prefill rows (bounds relative to the prefill block, slots, resume flags, the kernels' plan, prefix
    # caching's boundaries); None in a decode-only step.
    prefill: Optional[PrefillBatch] = None
    # Speculative decoding (spec_decode.py): the decode rows position by position, each token's state in its ring
    # column; state_indices_d is then empty.
    verify: Optional[tuple[VerifyPosition, ...]] = None
    # Every decode row has 1 + k tokens (the FULL-graph plan; verify is then None).
    uniform_verify: Optional[UniformVerify] = None

    @property
    def num_actual_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens


def split_decodes_first(query_lens: torch.Tensor, context_lens: torch.Tensor, max_query: int = 1) -> int:
    """Length of the leading run of decode rows: 1 to max_query new tokens (1 + the speculative tokens) on top of
    existing state."""
    is_decode = (query_lens >= 1) & (query_lens <= max_query) & (context_lens > 0)
    if bool(is_decode.all()):
        return int(is_decode.numel())
    return int(torch.argmin(is_decode.to(torch.int8)).item())


class Mamba2PluginMetadataBuilder(compat.AttentionMetadataBuilder):
    # With FULL decode graphs switched off: piecewise only, the mixer op runs eagerly between captured pieces.
    _cudagraph_support = compat.AttentionCGSupport.NEVER
    # Ask the runner to move one-token rows to the front of the batch.
    reorder_batch_threshold: int = 1

    @staticmethod
    def uses_full_decode_graphs(vllm_config) -> bool:
        """FULL decode graphs: the switch, and under speculative decoding its own (envs.spec_full_graphs says why
        off). Batches a FULL graph may replay then get their metadata in the graphs' persistent buffers, whether
        or not a graph replays them (the CPU runs them eagerly)."""
        return envs.full_decode_graphs() and (vllm_config.speculative_config is None or envs.spec_full_graphs())

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        if not cls.uses_full_decode_graphs(vllm_config):
            return cls._cudagraph_support
        if vllm_config.speculative_config is None:
            return compat.AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return compat.AttentionCGSupport.UNIFORM_BATCH  # every request 1 + k tokens

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)  # stores the four arguments
        hf = vllm_config.model_config.hf_config
        self.chunk_size = int(hf.chunk_size)
        self.conv_width = int(hf.conv_kernel)
        self.kernels = get_kernels(torch.device(device))  # module import only: no CUDA work here
        # Speculative decoding: a ring of 1 + k state slots per request (spec_decode.py), and the runner puts rows
        # of up to 1 + k tokens first.
        self.ring = 1 + compat.num_speculative_tokens(vllm_config)
        if self.ring > 1:
            self.reorder_batch_threshold = self.ring
        # FULL decode graphs: persistent slot buffers, as large as the largest captured decode batch.
        self.full_decode_graphs = self.uses_full_decode_graphs(vllm_config)
        # Prefix caching (mamba_cache_mode "align", docs/prefix-caching.md): a request's running state is in the
        # block of its last token; the blocks of the boundaries a prefill step crosses keep their states.
        self.prefix_caching = getattr(kv_cache_spec, "mamba_cache_mode", "none") == "align"
        self.block_size = int(kv_cache_spec.block_size) if self.prefix_caching else 0
        self.graph_slots = None
        if self.full_decode_graphs:
            max_bs = vllm_config.scheduler_config.max_num_seqs
            cap = getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", None)
            self.graph_slots = DecodeGraphSlots(min(max_bs, cap) if cap else max_bs, device, self._state_pools,
                                                self.ring, self.prefix_caching)

    def build_for_cudagraph_capture(self, common_attn_metadata):
        """Metadata for capturing a FULL decode graph: every row is a decode of one token (of 1 + k under
        speculative decoding; the runner's dummy rows carry no context, so the usual rule would call them fresh
        prompts)."""
        self.graph_slots.check_batch(common_attn_metadata.num_reqs)
        return self.build(0, common_attn_metadata, _force_decode=True)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False, _force_decode=False,
              **kwargs):
        num_reqs = common_attn_metadata.num_reqs
        qsl_cpu = common_attn_metadata.query_start_loc_cpu[: num_reqs + 1].to(torch.int64)
        seq_lens_cpu = compat.seq_lens_cpu(common_attn_metadata)[:num_reqs].to(torch.int64)
        query_lens = qsl_cpu[1:] - qsl_cpu[:-1]
        context_lens = seq_lens_cpu - query_lens

        if self.full_decode_graphs:
            build_graph = self._build_graph_decode if self.ring == 1 else self._build_graph_verify
            graph_meta = build_graph(common_attn_metadata, query_lens, context_lens, capture=_force_decode)
            if graph_meta is not None:
                return graph_meta
        num_decodes = split_decodes_first(query_lens, context_lens, self.ring)
        num_decode_tokens = int(qsl_cpu[num_decodes])
        num_prefills = num_reqs - num_decodes
        num_prefill_tokens = int(qsl_cpu[num_reqs]) - num_decode_tokens

        verify, ring_p = None, None
        if self.ring > 1:
            table = common_attn_metadata.block_table_tensor[:num_reqs]
            if num_decodes:
                verify = verify_positions(table[:num_decodes], qsl_cpu[: num_decodes + 1], context_lens[:num_decodes],
                                          self.ring, self.block_size)
            slots_d = table.new_empty(0, dtype=torch.int64)
            if num_prefills:
                ring_p = prefill_ring(table[num_decodes:], context_lens[num_decodes:], query_lens[num_decodes:],
                                      self.ring, self.block_size)
            slots_p = None if ring_p is None else ring_p.slots
        else:
            slots = self._running_slots(common_attn_metadata, num_reqs)
            slots_d, slots_p = slots[:num_decodes], slots[num_decodes:]
        prefill = None
        if num_prefills:
            prefill = self._prefill_batch(common_attn_metadata, qsl_cpu, context_lens, seq_lens_cpu,
                                          slots_p, num_decodes, num_prefill_tokens, ring_p)
        return Mamba2PluginMetadata(
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            chunk_size=self.chunk_size,
            state_indices_d=slots_d,
            state_indices_d_i32=slots_d.to(torch.int32),
            prefill=prefill,
            verify=verify,
        )

    def _prefill_batch(self, common_attn_metadata, qsl_cpu, context_lens, seq_lens_cpu, slots_p,
                       num_decodes: int, num_prefill_tokens: int,
                       ring: Optional[PrefillRing] = None) -> PrefillBatch:
        """The prefill rows' batch (rows num_decodes.. of the step). Which rows resume a saved state: the host
        flags, the one source for the kernels' plan (built from the host copies, uploaded once, shared by every
        layer: no host sync in the prefill path) and for the device mask the layers read (the plan's upload of the
        same flags)."""
        num_reqs, num_decode_tokens = qsl_cpu.numel() - 1, int(qsl_cpu[num_decodes])
        # The device bounds are derived from the runner's device tensors rather than copied from the host copies:
        # a host-to-device copy from pageable memory synchronises the stream, which would stall the CPU on the
        # previous step's GPU work at every step.
        qsl = common_attn_metadata.query_start_loc[num_decodes: num_reqs + 1]
        offsets, boundary_slots, initial_slots = None, None, None
        if ring is not None:  # speculative decoding: the state ring's columns (prefix caching's boundaries included)
            offsets, boundary_slots, initial_slots = ring.boundary_offsets, ring.boundary_slots, ring.initial_slots
        elif self.prefix_caching:
            offsets, boundary_slots = self._boundaries(common_attn_metadata, num_decodes, context_lens, seq_lens_cpu)
        return PrefillBatch.build(
            self.kernels, qsl_cpu[num_decodes:] - num_decode_tokens, context_lens[num_decodes:] > 0,
            num_prefill_tokens, self.chunk_size, self.conv_width, self.device,
            cu_seqlens=(qsl - num_decode_tokens).to(torch.int32), slots=slots_p,
            boundary_offsets=offsets if boundary_slots is not None else None, boundary_slots=boundary_slots,
            initial_slots=initial_slots,
        )

    def _running_slots(self, common_attn_metadata, num_rows: int) -> torch.Tensor:
        """(num_rows,) int64: the slot holding each row's running state. Without prefix caching a request owns
        one block; with it, the block of its last token (the runner copied the state there)."""
        table = common_attn_metadata.block_table_tensor[:num_rows]
        if not self.prefix_caching:
            return table[:, 0].to(torch.int64)
        col = ((common_attn_metadata.seq_lens[:num_rows].to(torch.int64) - 1) // self.block_size).clamp(min=0)
        return table.gather(1, col[:, None]).view(-1).to(torch.int64)

    def _boundaries(self, common_attn_metadata, num_decodes: int, context_lens, seq_lens_cpu):
        """Per prefill row, the offsets (tokens of this step) of the block boundaries it crosses before its last
        block, and the slots of those blocks (each keeps the state after (b + 1) * block_size tokens)."""
        bs, offsets, rows, cols = self.block_size, [], [], []
        for r in range(num_decodes, int(seq_lens_cpu.numel())):
            c, e = int(context_lens[r]), int(seq_lens_cpu[r])
            offsets.append(list(block_boundary_offsets(c, e - c, bs)))
            rows += [r] * len(offsets[-1])
            cols += [(c + o) // bs - 1 for o in offsets[-1]]
        if not rows:
            return offsets, None
        table = common_attn_metadata.block_table_tensor
        idx = upload(torch.tensor([rows, cols], dtype=torch.int64), table.device)
        return offsets, table[idx[0], idx[1]].to(torch.int64)

    def _build_graph_decode(self, common_attn_metadata, query_lens, context_lens, capture: bool):
        """Metadata for a batch that a FULL decode graph may replay: every real row one token, then only the
        runner's padding rows of zero tokens. Returns None for any other batch (the general path handles it).
        capture: the runner's dummy rows for a graph capture (no request, no state to reset)."""
        num_reqs = common_attn_metadata.num_reqs
        if num_reqs == 0 or num_reqs > self.graph_slots.max_batch:
            return None
        num_real = int((query_lens > 0).sum())
        if bool((query_lens[:num_real] != 1).any()) or bool(query_lens[num_real:].any()):
            return None  # a longer row, or zero-token rows not all at the end: not a uniform decode batch
        fresh_rows = torch.nonzero(context_lens[:num_real] == 0).view(-1)
        if not capture and fresh_rows.numel():  # a fresh row's only token is in block 0
            table = common_attn_metadata.block_table_tensor
            self.graph_slots.zero(table[:, 0].index_select(0, upload(fresh_rows, table.device)).to(torch.int64))
        slots, slots_i32 = self.graph_slots.write(self._running_slots(common_attn_metadata, num_real), num_reqs)
        return Mamba2PluginMetadata(
            num_decodes=num_reqs,
            num_decode_tokens=num_reqs,  # padded rows are tokens of the padded batch too
            num_prefills=0,
            num_prefill_tokens=0,
            chunk_size=self.chunk_size,
            state_indices_d=slots,
            state_indices_d_i32=slots_i32,
        )

    def _build_graph_verify(self, common_attn_metadata, query_lens, context_lens, capture: bool):
        """Speculative decoding: metadata for a batch that a FULL graph may replay, every real row 1 + k tokens
        (then the runner's padding rows of none), in the persistent buffers (decode_graph.py). Returns None for
        any other batch. A fresh row starts from its zeroed source slot."""
        num_reqs, m = common_attn_metadata.num_reqs, self.ring
        if num_reqs == 0 or num_reqs > self.graph_slots.max_batch:
            return None
        num_real = int((query_lens > 0).sum())
        if bool((query_lens[:num_real] != m).any()) or bool(query_lens[num_real:].any()):
            return None
        table = common_attn_metadata.block_table_tensor[:num_real]
        context = context_lens[:num_real]
        cols = upload(ring_column(context[:, None] - 1 + torch.arange(m + 1), m, self.block_size), table.device)
        slots = table.gather(1, cols).to(torch.int64)  # (rows, m + 1): the state before token 0, after each
        fresh_rows = torch.nonzero(context == 0).view(-1)
        if not capture and fresh_rows.numel():
            self.graph_slots.zero(slots[:, 0].index_select(0, upload(fresh_rows, table.device)))
        empty = table.new_empty(0, dtype=torch.int64)
        return Mamba2PluginMetadata(
            num_decodes=num_reqs,
            num_decode_tokens=num_reqs * m,  # the padded batch's tokens, padding rows' included
            num_prefills=0,
            num_prefill_tokens=0,
            chunk_size=self.chunk_size,
            state_indices_d=empty,
            state_indices_d_i32=empty.to(torch.int32),
            uniform_verify=self.graph_slots.write_verify(slots, num_reqs),
        )

    def _state_pools(self):
        """Every state pool (conv and SSM) of this group's layers."""
        layers = self.vllm_config.compilation_config.static_forward_context
        for name in self.layer_names:
            yield from compat.layer_states(layers[name])
