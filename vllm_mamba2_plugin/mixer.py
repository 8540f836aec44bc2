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
"""

import torch
from torch import nn

from . import compat, envs
from .backend import Mamba2PluginBackend, Mamba2PluginMetadata
from .kernels import get_kernels, reference
from .kernels.reference import row_range
from .spec import Mamba2StateSpec

OP_NAME = "mamba2_plugin_mixer"


def state_shapes(conv_kernel, conv_dim, num_heads, head_dim, state_size):
    """(conv state, ssm state) shapes of one slot: ((W-1, conv_dim), (H, P, N))."""
    return (conv_kernel - 1, conv_dim), (num_heads, head_dim, state_size)


class Mamba2Mixer(compat.MambaBase, nn.Module):
    # Decode-kernel signatures already compiled in this process (see _warm_decode_kernels). Keyed by what the
    # Triton kernels specialise on, not one flag per process: two engines of different shapes or state dtypes
    # in one process (tests, notebooks) each need their own compile before their captures.
    _warm_decode_signatures: set = set()
    _warm_prefill_signatures: set = set()

    def __init__(self, config, model_config, cache_config, prefix: str):
        super().__init__()
        self.prefix = prefix
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.n_groups = config.n_groups
        self.state_size = config.state_size
        self.conv_kernel = config.conv_kernel
        self.d_inner = self.num_heads * self.head_dim
        self.conv_dim = self.d_inner + 2 * self.n_groups * self.state_size
        self.norm_eps = config.layer_norm_epsilon
        self.norm_group_size = self.d_inner // self.n_groups
        self.chunk_size = int(config.chunk_size)
        limit = tuple(getattr(config, "time_step_limit", None) or (0.0, float("inf")))
        self.dt_limit = (float(limit[0]), float(limit[1]))
        # softplus(dt) > 0, so a limit of (<= 0, inf) clamps nothing: the decode step then lets the state-update
        # kernel apply softplus(dt + dt_bias) itself.
        self.dt_limit_is_noop = self.dt_limit[0] <= 0.0 and self.dt_limit[1] == float("inf")
        self.model_config = model_config
        self.cache_config = cache_config

        # Parameter names follow the HF checkpoint (in_proj, conv1d, dt_bias, A_log -> A, D, norm, out_proj).
        self.in_proj = nn.Linear(
            self.hidden_size, self.d_inner + self.conv_dim + self.num_heads, bias=config.use_bias
        )
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.conv_kernel, groups=self.conv_dim, bias=config.use_conv_bias
        )
        # A, D and dt_bias stay float32 whatever the model dtype: they enter exp() and softplus().
        self.A = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(self.d_inner), requires_grad=False)
        self.out_proj = nn.Linear(self.d_inner, self.hidden_size, bias=config.use_bias)

        # vLLM finds its attention-like layers (to bind state and build metadata) through this dict.
        static_ctx = compat.static_forward_context()
        if prefix in static_ctx:
            raise ValueError(f"Duplicate layer name: {prefix}")
        static_ctx[prefix] = self
        self.kv_cache = compat.empty_layer_states()

    # ---- MambaBase: what state this layer needs ------------------------------------------------------
    def get_state_shape(self):
        return state_shapes(self.conv_kernel, self.conv_dim, self.num_heads, self.head_dim, self.state_size)

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
        projected = self.in_proj(hidden_states)
        out = torch.empty(
            (hidden_states.shape[0], self.d_inner), dtype=hidden_states.dtype, device=hidden_states.device
        )
        torch.ops.vllm.mamba2_plugin_mixer(projected, out, self.prefix)
        return self.out_proj(out)

    def conv_ssm_forward(self, projected: torch.Tensor, out: torch.Tensor) -> None:
        meta = compat.layer_metadata(self.prefix)
        if meta is None:
            # Profile / dummy run: no requests, no state. Only the output shape matters. On CUDA the first
            # profile run also compiles and autotunes the kernels, before the state pools take the memory
            # (not with VLLM_MAMBA2_PLUGIN_KERNELS=reference: nothing to compile).
            if projected.is_cuda and get_kernels(projected.device) is not reference:
                self._warm_prefill_kernels(projected)
                if envs.full_decode_graphs():
                    self._warm_decode_kernels(projected)
            out.zero_()
            return
        assert isinstance(meta, Mamba2PluginMetadata), type(meta)
        k = get_kernels(projected.device)
        conv_state, ssm_state = compat.layer_states(self)
        nd, n_tok = meta.num_decode_tokens, meta.num_actual_tokens
        z, xBC, dt = self._split_projection(row_range(projected, 0, n_tok))

        if meta.num_prefills == 0:  # decode-only step (every FULL-graph step)
            y = self._decode_step(k, xBC, dt, conv_state, ssm_state, meta.state_indices_d,
                                  meta.state_indices_d_i32)
            self._gated_norm(k, y, z, out=row_range(out, 0, n_tok))
        else:
            # Decode rows and prefill rows are normed separately, each straight into its rows of out: one more
            # norm launch instead of concatenating the two outputs (a copy of every token's d_inner outputs per
            # layer; 2.6 ms of a 2.7b mixed step on the H200, benchmarks/RESULTS.md). The norm is per row.
            if nd > 0:
                y_d = self._decode_step(k, xBC[:nd], dt[:nd], conv_state, ssm_state, meta.state_indices_d,
                                        meta.state_indices_d_i32)
                self._gated_norm(k, y_d, z[:nd], out=out[:nd])
            y_p = self._prefill_step(k, row_range(xBC, nd, n_tok), row_range(dt, nd, n_tok), conv_state, ssm_state,
                                     meta.state_indices_p, meta.query_start_loc_p, meta.has_initial_state_p,
                                     meta.any_initial_state_p, meta.prefill_plan)
            self._gated_norm(k, y_p, row_range(z, nd, n_tok), out=row_range(out, nd, n_tok))
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

    def _decode_step(self, k, xBC, dt, conv_state, ssm_state, slots, slots_i32):
        """One token per row on top of the state in each row's slot: conv update, then SSM update.
        slots / slots_i32: the same slot ids as int64 (SSM kernel: 64-bit pool offsets) and int32 (conv
        kernel's type), both made once per step by the builder rather than cast here in every layer."""
        xBC = k.conv_update(xBC, conv_state, self._conv_weight(), self.conv1d.bias, slots_i32, activation="silu")
        x, B, C = self._split_xbc(xBC)
        if self.dt_limit_is_noop:
            return k.ssm_state_update(ssm_state, x, dt, self.A, B, C, slots, D=self.D, dt_bias=self.dt_bias,
                                      dt_softplus=True)
        dt = k.process_dt(dt, self.dt_bias, self.dt_limit)
        return k.ssm_state_update(ssm_state, x, dt, self.A, B, C, slots, D=self.D)

    def _prefill_step(self, k, xBC, dt, conv_state, ssm_state, slots, qsl, has_init, any_init, plan):
        """Packed varlen prefill rows (bounds qsl, relative to xBC): conv, then the chunked SSD scan, each
        sequence starting from its slot's state where has_init says so; final states written back by slot.
        any_init: host copy of has_init.any() (all-fresh prompts: the slots are not read)."""
        xBC_p, conv_final = k.causal_conv1d(
            xBC, self._conv_weight(), self.conv1d.bias, qsl,
            initial_states=conv_state.index_select(0, slots) if any_init else None,
            has_initial_state=has_init if any_init else None,
            activation="silu", plan=plan,
        )
        # index_copy_ / index_select rather than advanced indexing: same kernels' work, a fraction of the host
        # time (prefill steps are host-bound: benchmarks/prefill_layer.py).
        conv_state.index_copy_(0, slots, conv_final.to(conv_state.dtype))
        x_p, B_p, C_p = self._split_xbc(xBC_p)
        # Raw dt: the scan applies softplus(dt + dt_bias) and the limit itself (fused into its first pass),
        # and returns the final states in the pool's dtype.
        y_p, ssm_final = k.ssd_chunk_scan(
            x_p, dt, self.A, B_p, C_p, self.chunk_size, qsl,
            initial_states=ssm_state.index_select(0, slots) if any_init else None,
            has_initial_state=has_init if any_init else None, D=self.D,
            plan=plan, dt_bias=self.dt_bias, dt_limit=self.dt_limit, state_dtype=ssm_state.dtype,
        )
        ssm_state.index_copy_(0, slots, ssm_final)
        return y_p

    def _gated_norm(self, k, y, z, out=None):
        return k.gated_rms_norm(y.view(y.shape[0], self.d_inner), z, self.norm.weight, self.norm_eps,
                                self.norm_group_size, out=out)

    def _scratch_pools(self, num_slots: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed (conv, ssm) state pools of ``num_slots`` slots, shaped and typed as vLLM allocates this layer's,
        for the kernel warm-ups."""
        return tuple(torch.zeros((num_slots, *shape), dtype=dtype, device=dev)
                     for shape, dtype in zip(self.get_state_shape(), self.get_state_dtype()))

    def _warm_prefill_layouts(self, max_rerun: int, tokens: int = 0):
        """(sequence lengths, resumes-a-state flags) of the packed batches ``_warm_prefill_kernels`` runs.

        First, when ``tokens`` (the profile run's token budget, i.e. the largest step) exceeds two chunks: three
        layouts filling it, one per call signature of the SSD kernels. mamba-ssm's SSD kernels are autotuned once
        per key of head, state and chunk sizes -- not length -- and tensor dtypes (an argument given or None
        counts), on the arguments of that signature's first call, and that choice then serves every step;
        tuned on two chunks, ``_chunk_state_fwd`` takes a tile that costs 1.3x on the 32-chunk steps where the
        GPU time is (H200, 2.7b: 111 vs 86 us per layer). So: two fresh prompts (the
        packed call), a resumed first sequence ending inside chunk 0 (state passing with an initial state; the
        varlen final-state kernel) and a resumed second sequence (its rerun: the kernels without seq_idx). The
        H200's autotuning files showed the rerun signatures tuned on small layouts taking tiles 1.1-1.4x slower
        on a full step. Their intermediates are allocated inside the profile
        run that sizes the state pools, as a real step of that size allocates them.

        Then every compile a step can need. Triton compiles a kernel per specialisation of its integer arguments
        (== 1, a multiple of 16, other) and pointer alignments. In the SSD kernels the integers that change from
        step to step are the packed length T, the chunk count and strides that are multiples of T (T * heads,
        T * projection width, ...), so the specialisation of a step is fixed by (chunk count: 1 / 16k / other)
        x (T mod 16: 0 / 8 / 4 / 2 / 1 decide which multiples of T are divisible by 16) x (path: one fresh
        prompt (final states from state passing), fresh prompts with a boundary inside a chunk (the varlen
        final-state kernel), a resumed first sequence ending inside chunk 0 or on a chunk boundary (the packed
        call's own initial state)). The chunk count reaches 16 only in steps of more than 15 chunks, so that
        class is warmed only when the budget allows such steps (T = 15 chunks + 16..24 tokens). (On the H200 the
        JIT monitor saw ``_state_passing_fwd_kernel`` compile at the first requests of 2.7b runs: steps of
        8 159-8 190 tokens, 32 chunks, against warm-up layouts of at most two chunks.)

        Last, the other paths of the wrappers: a sequence shorter than W-1 (conv through the extended buffer),
        up to ``SEPARATE_RESUMED_MAX`` resumed sequences (each rerun alone: lengths 37, 48 and 1), more (the
        batched correction)."""
        cs, reruns, many = self.chunk_size, [37, 48, 1][:max_rerun], max_rerun + 1
        layouts = [
            ([tokens // 2, tokens - tokens // 2], [False, False]),  # the packed call (seq_idx, no initial state)
            ([17, tokens - 17], [True, False]),  # + state passing with an initial state, the varlen final states
            ([1, tokens - 1], [False, True]),  # a rerun: the kernels without seq_idx, with an initial state
        ] if tokens > 2 * cs else []
        for chunks in [1, 2] + ([16] if tokens >= 15 * cs + 32 else []):
            for residue in (0, 8, 4, 2, 1):
                T = (chunks - 1) * cs + 16 + residue  # chunk_size is a multiple of 16 (64, 128, 256 in practice)
                cut = T // 2 if (T // 2) % cs else T // 2 - 1  # a boundary inside a chunk
                first = min(37, T - 1)
                layouts += [([T], [False]), ([cut, T - cut], [False, False]), ([first, T - first], [True, False])]
                if chunks > 1:
                    layouts.append(([cs, T - cs], [True, False]))  # resumed first sequence ending on a chunk
        return layouts + [
            ([1], [False]),
            ([1], [True]),
            ([cs + 5, 2], [False, False]),
            (reruns + [cs], [True] * len(reruns) + [False]),
            ([20] * many, [True] * many),
        ]

    def _warm_prefill_kernels(self, projected: torch.Tensor) -> None:
        """Compile and autotune the prefill kernels in the profile run, as vLLM's in-tree Mamba2 does (its
        ``_warmup_ssd_kernels``). mamba-ssm's SSD kernels are autotuned per (chunk size, head dim, state size,
        tensor dtypes, which optional tensors are given): without this the first real prefill of a process pays
        for it -- on the H200 the first mixed step of a 7b-shape run took 29.6 s (benchmarks/RESULTS.md) -- and the
        autotuner's trial runs would need memory the state pools have taken by then. Runs once per process and
        layer signature, on scratch pools, through the same ``_prefill_step`` as real steps."""
        conv_dtype, ssm_dtype = self.get_state_dtype()
        sig = (str(projected.device), projected.dtype, projected.shape[-1], conv_dtype, ssm_dtype, self.num_heads,
               self.head_dim, self.n_groups, self.state_size, self.conv_kernel, self.chunk_size,
               self.conv1d.bias is not None, self.dt_limit)
        if sig in Mamba2Mixer._warm_prefill_signatures:
            return
        k = get_kernels(projected.device)
        dev = projected.device
        layouts = self._warm_prefill_layouts(k.SEPARATE_RESUMED_MAX, projected.shape[0])
        num_slots = 1 + max(len(lengths) for lengths, _ in layouts)
        conv_pool, ssm_pool = self._scratch_pools(num_slots, dev)
        for lengths, resumed in layouts:
            self._run_prefill_layout(k, projected.new_zeros(sum(lengths), projected.shape[-1]), lengths, resumed,
                                     conv_pool, ssm_pool)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        Mamba2Mixer._warm_prefill_signatures.add(sig)

    def _run_prefill_layout(self, k, rows, lengths, resumed, conv_pool, ssm_pool, first_slot: int = 1):
        """One packed prefill block through the real prefill path and its gated norm: ``rows`` (sum(lengths),
        projection width) of projection outputs, sequences of ``lengths`` in slots first_slot, first_slot + 1, ...,
        each resuming its slot's state where ``resumed`` says so. Returns the normed output (sum(lengths),
        d_inner); the warm-ups throw it away."""
        cu = torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)  # host bounds, as the builder's
        T, flags, dev = int(cu[-1]), torch.tensor(resumed), rows.device
        z, xBC, dt = self._split_projection(rows)
        plan = k.plan_prefill(cu, flags, T, self.chunk_size, self.conv_kernel, dev)
        slots = torch.arange(first_slot, first_slot + len(lengths), device=dev)
        y = self._prefill_step(k, xBC, dt, conv_pool, ssm_pool, slots, cu.to(dev), flags.to(dev),
                               bool(flags.any()), plan)
        return self._gated_norm(k, y, z, out=rows.new_empty(T, self.d_inner))

    def _warm_decode_kernels(self, projected: torch.Tensor) -> None:
        """Compile the decode-path kernels before vLLM captures FULL decode graphs (a Triton JIT compile
        must not happen inside a capture) or serves its first steps. Runs once per process and layer signature,
        in the profile run, on scratch state laid out like the real inputs (slices of a projection). The batch
        sizes (``cuda.ssu_warm_batches``) cover Triton's integer specialisations (== 1, other, multiple of 16)
        under every state-update launch that ``cuda.ssu_launch_config`` can pick for this layer; rows share the
        16 scratch slots (what they compute is thrown away)."""
        sig = (str(projected.device), projected.dtype, projected.shape[-1], *self.get_state_dtype(),
               self.num_heads, self.head_dim, self.n_groups, self.state_size, self.conv_kernel,
               self.conv1d.bias is not None, self.dt_limit_is_noop)
        if sig in Mamba2Mixer._warm_decode_signatures:
            return
        k = get_kernels(projected.device)
        dev = projected.device
        num_slots = 17  # slot 0 stays untouched, rows cycle through 1..16
        conv_pool, ssm_pool = self._scratch_pools(num_slots, dev)
        for bs in k.ssu_warm_batches(self.num_heads, self.head_dim, self.state_size, self.get_state_dtype()[1]):
            z, xBC, dt = self._split_projection(projected.new_zeros(bs, projected.shape[-1]))
            slots = torch.arange(bs, device=dev) % (num_slots - 1) + 1
            y = self._decode_step(k, xBC, dt, conv_pool, ssm_pool, slots, slots.to(torch.int32))
            self._gated_norm(k, y, z, out=projected.new_empty(bs, self.d_inner))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        Mamba2Mixer._warm_decode_signatures.add(sig)


def mamba2_plugin_mixer(projected_states: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    layer = compat.forward_context_layer(layer_name)
    layer.conv_ssm_forward(projected_states, output)


def _fake(projected_states: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    return None


compat.register_custom_op(OP_NAME, mamba2_plugin_mixer, mutates_args=["output"], fake_impl=_fake)
