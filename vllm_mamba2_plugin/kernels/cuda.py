"""CUDA kernels: thin wrappers over mamba-ssm (Triton SSD, state update, gated RMSNorm) and causal-conv1d.

Same functions, signatures and semantics as ``reference.py`` (read it for the contract and the notation:
T tokens, S sequences, H heads, P head dim, G groups, N state size, W conv width, K = W-1, D channels).
mamba_ssm / causal_conv1d are imported lazily, on the first call (``_kernels()``): importing mamba_ssm loads
the Mamba1 extension and sets a global Triton allocator, which must never happen at plugin import.

What each wrapper does, and why (line numbers: mamba-ssm 2.3.2.post1, causal-conv1d 1.7.0):

* ``ssd_chunk_scan``: ONE packed call of ``_mamba_chunk_scan_combined_fwd`` (the forward that
  ``mamba_chunk_scan_combined`` runs inside its autograd Function; inference needs no saved tensors) for all
  sequences, with seq_idx, with cu_seqlens for per-sequence final states (``chunk_state_varlen``: one more
  autotuned launch) unless every sequence but the last ends on a chunk boundary, as one sequence always does (then
  they are states that state passing already handed from chunk to chunk), and with NO initial states; initial
  states are then added exactly in torch. The kernel cannot take a per-sequence initial state in a packed batch:
  ``initial_states`` is per batch row (ssd_combined.py:369) and, with seq_idx, only reaches the row's FIRST
  sequence (state passing starts from it and resets whenever seq_idx changes, ssd_state_passing.py:64-80;
  chunk scan applies the previous state only to tokens whose seq_idx equals the previous token's,
  ssd_chunk_scan.py:98-113), while varlen final states require batch == 1 (ssd_combined.py:390). One call per
  continuing sequence would work but costs 5 Triton launches per sequence (vLLM's V2 runner can send many
  1-token rows that carry state). SSD is linear in h0, so the exact fix is
      y_t   += C_t · (exp(sum_{k=start..t} dt_k A) h0)        final += exp(sum_{k in seq} dt_k A) h0,
  computed in float32 for the continuing sequences only, batched over fixed-size token blocks (see
  ``_add_initial_state``), from the step sizes the kernel itself computed. When at most
  ``SEPARATE_RESUMED_MAX`` sequences resume (the usual chunked-prefill step: one), each is instead rerun alone
  as one batch row with its initial state (which the kernel takes natively) and its rows overwritten: fewer
  host launches than the correction, and prefill steps are host-bound. And when the ONLY resumed sequence is
  the batch's first (vLLM's runner orders a step's rows decode, short extend, long extend, fresh prompt:
  the chunk that continues a cut prompt opens the prefill block), its state is simply the packed call's
  ``initial_states``: no second call. One upstream gap is patched then: ``chunk_state_varlen`` adds the state
  entering a sequence's last chunk only if the sequence started before that chunk (ssd_chunk_state.py:700-706),
  so a first sequence that ends in chunk 0 gets a final state without its h0 term; the wrapper adds
  exp(dA_cumsum[its last token]) h0 (the kernel's own in-chunk cumsum). Its final state then comes, like every
  fresh sequence's, from the kernel's varlen states, which are stored in C's dtype (a rerun's came in float32):
  with bf16 activations and an fp32 state pool, a prompt prefilled over several steps takes one bf16 rounding
  of its state per step instead of one in all. With dt_bias the kernel's first
  pass applies softplus(dt + dt_bias) and the limit (ssd_chunk_state.py:72-81), so no separate dt kernels.
  Rows flagged has_initial_state False never read initial_states.
  Host sync: sizes (cu_seqlens, has_initial_state) are needed on the host. The mixer passes the step's
  ``plan_prefill`` (built by the metadata builder from host bounds, uploaded once): no sync. Without a plan,
  one is built here (one .tolist() of device bounds).
* ``causal_conv1d``: ONE call of causal-conv1d's channel-last forward extension (``causal_conv1d_cuda``,
  what ``causal_conv1d_fn`` reaches through an autograd Function and a custom op) with seq_idx. Fresh prompts
  are read in place from the projection; otherwise through an extended buffer [init_0, seq_0, init_1, seq_1,
  ...] where each sequence's K initial-state rows carry that sequence's seq_idx, so the kernel convolves
  through them; the kernel's own ``initial_states`` would again only serve the first sequence
  (causal_conv1d_fwd.cu:237, 306: initial_states only for the first L-chunk, tagged with seq_idx[0]). Final
  states are a torch gather of each sequence's last K input rows, since final states are refused with seq_idx
  (causal_conv1d_interface.py:27-30). No host sync.
  Why the direct calls: a prefill step is host-bound (benchmarks/prefill_layer.py on the H200: ~1.9 ms of
  host time per layer against ~0.65 ms of GPU time before this), so every wrapper layer and glue op counts.
* ``conv_update``: ONE call of causal-conv1d's update extension (what ``causal_conv1d_update`` reaches through
  a custom op) with int32 conv_state_indices on the pool's transposed view
  (slots, D, K) (strides (slot, 1, D)); the C++ checks only shapes/dtypes, strides are free
  (causal_conv1d.cpp:479-531, causal_conv1d_update.cu:55-57).
* ``ssm_state_update``: ONE ``selective_state_update(..., state_batch_indices=int64)`` in the multi-head
  form with dt/A/dt_bias/D broadcast by stride-0 ``expand`` (takes the kernel's TIE_HDIM scalar path).
* ``gated_rms_norm``: ``_layer_norm_fwd(group_size=..., norm_before_gate=False, is_rms_norm=True)`` (what
  ``rmsnorm_fn`` runs, without its autograd wrapper, writing into the caller's buffer).
* ``process_dt``: plain torch (reference's); the mixer's prefill path lets the SSD kernel do it instead.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Optional, Tuple

import torch

from .. import envs
from . import reference, triton_launch
from .reference import _select_initial, process_dt, row_range  # noqa: F401  (process_dt is part of the interface)
from .varlen_plan import InitCorrectionPlan, VarlenPlan, build_plan, conv_plan

__all__ = [
    "plan_prefill",
    "ssd_chunk_scan",
    "causal_conv1d",
    "conv_update",
    "ssm_state_update",
    "process_dt",
    "gated_rms_norm",
]

logger = logging.getLogger(__name__)

_KERNELS: Optional[SimpleNamespace] = None
_INSTALL_HINT = (
    "vllm_mamba2_plugin's CUDA path needs the mamba-ssm and causal-conv1d packages: "
    "pip install mamba-ssm causal-conv1d (or: pip install 'vllm-mamba2-plugin[cuda]'); "
    "or set VLLM_MAMBA2_PLUGIN_KERNELS=reference to use the plain-torch kernels"
)


def _kernels() -> SimpleNamespace:
    """The upstream kernel entry points, imported once, on first use (never at module import)."""
    global _KERNELS
    if _KERNELS is None:
        try:
            import causal_conv1d_cuda
            from mamba_ssm.ops.triton.layernorm_gated import _layer_norm_fwd
            from mamba_ssm.ops.triton.selective_state_update import (
                _selective_scan_update_kernel,
                selective_state_update,
            )
            from mamba_ssm.ops.triton.ssd_combined import _mamba_chunk_scan_combined_fwd
        except ImportError as e:
            raise ImportError(f"{_INSTALL_HINT} (import failed: {e})") from e
        # Before the first launch, so the autotuners' first tuning already sees the extended config lists.
        fast, extended = envs.fast_launch(), envs.ssd_configs() == "extended"
        try:
            placed = triton_launch.install(fast_launch=fast, extra_configs=extended,
                                           direct_launch=envs.direct_launch())
        except Exception as e:  # a Triton or mamba-ssm whose internals differ: their own launch path still works
            placed = {}
            if fast or extended:
                logger.warning("vllm_mamba2_plugin: could not install the fast Triton launch path / extended SSD "
                               "configs (%r); launching mamba-ssm's kernels through Triton as they come. "
                               "VLLM_MAMBA2_PLUGIN_FAST_LAUNCH=0 VLLM_MAMBA2_PLUGIN_SSD_CONFIGS=upstream "
                               "silence this.", e)
        _KERNELS = SimpleNamespace(
            ssd_fwd=_mamba_chunk_scan_combined_fwd,
            selective_state_update=selective_state_update,
            ssu_kernel=placed.get("_selective_scan_update_kernel", _selective_scan_update_kernel),
            layer_norm_fwd=_layer_norm_fwd,
            conv_fwd=causal_conv1d_cuda.causal_conv1d_fwd,
            conv_update=causal_conv1d_cuda.causal_conv1d_update,
        )
    return _KERNELS


_warned: set = set()


def _fallback(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("vllm_mamba2_plugin: %s; using the plain-torch reference kernel for it", reason)


_CONV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # causal_conv1d.cpp:160-161, 477-478


def _conv_unsupported(dim: int, width: int, x_dtype, w_dtype) -> Optional[str]:
    if not 2 <= width <= 4:  # causal_conv1d.cpp:182, 496
        return f"causal-conv1d supports conv widths 2..4, not {width}"
    if x_dtype not in _CONV_DTYPES or w_dtype not in _CONV_DTYPES:
        return f"causal-conv1d does not support dtypes {x_dtype}/{w_dtype}"
    return None


# --------------------------------------------------------------------------------------------------------
# SSD chunked scan (prefill)
# --------------------------------------------------------------------------------------------------------


# At most this many resumed sequences in a step are rerun one by one (``ssd_chunk_scan``); more take the batched
# initial-state correction. One rerun is ~6 kernel launches of host time, the correction ~40 small ones. (A lone
# resumed sequence that opens the batch needs neither: ``_native_first``.)
SEPARATE_RESUMED_MAX = 3


def _native_first(plan: VarlenPlan, initial_states: Optional[torch.Tensor]) -> bool:
    """The only sequence that resumes a state is the first non-empty one of the packed batch: the kernels' own
    initial state (per batch row, which with seq_idx reaches exactly the row's first sequence) serves it."""
    return initial_states is not None and plan.resumed == plan.nonempty[:1] != []


def plan_prefill(
    cu_seqlens_cpu: torch.Tensor,
    has_initial_state_cpu: Optional[torch.Tensor],
    num_tokens: int,
    chunk_size: int,
    conv_width: int,
    device: torch.device,
) -> VarlenPlan:
    """The index plan of one step's prefill block, shared by every layer (see ``varlen_plan``): pass host
    tensors; the result lives on ``device`` after one non-blocking copy. The reference kernels need none."""
    return build_plan(cu_seqlens_cpu, has_initial_state_cpu, True, num_tokens, chunk_size, (conv_width,), device)


def _add_initial_state(
    y: torch.Tensor,
    fin: torch.Tensor,
    dt_ht: torch.Tensor,
    A: torch.Tensor,
    C: torch.Tensor,
    ip: InitCorrectionPlan,
    h0: torch.Tensor,
) -> torch.Tensor:
    """Add the initial states' contribution to a zero-initial-state SSD result (exact: SSD is linear in h0).

    y: (Tu, H, P) outputs of the kernel (any float dtype); fin: (S', H, P, N) float32 final states, updated
    in place; dt_ht: (H, Tu) float32 processed step sizes (the kernel's own, head-major); A: (H,);
    C: (Tu, G, N); ip: the plan's blocks for the I sequences that carry a state; h0: (I, H, P, N) float32
    their initial states. Returns y + correction (new float32 tensor).

    With a(t) = exp(sum_{k=start..t} dt_k A) (inclusive: h_t includes step t's decay):
        y_t += a(t) · (C_t · h0)     final += a(end-1) · h0.
    The C_t · h0 contraction needs h0 per token; gathering it per token would cost T·H·P·N memory, so tokens
    are grouped in blocks of <= ``ip.block`` tokens of one sequence (last block padded with a dummy token) and
    each block is one small matmul against its sequence's h0: memory ~ (T_init/block + S_init)·H·P·N, the
    same order as the kernel's own per-chunk state tensor.
    """
    Tu, H, P = y.shape
    G, N = C.shape[-2], C.shape[-1]
    R = H // G
    I = h0.shape[0]

    # Log-decays summed in float64 over the packed batch, then differenced at sequence starts: float32
    # cumsums over thousands of tokens would lose ~1e-3 absolute in the exponent. Head-major (H, Tu), so
    # the scan runs along the contiguous dim: a (Tu, H) scan over dim 0 took 1.5 ms per layer on an H200
    # (torch's outer-dim scan kernel in float64), this one takes microseconds.
    dA = dt_ht.to(torch.float64) * A.to(torch.float64)[:, None]  # (H, Tu)
    csum = torch.cat([dA.new_zeros(H, 1), dA.cumsum(1)], dim=1)  # csum[:, i] = sum_{k<i}
    decay_tok = torch.exp(csum[:, 1:] - csum[:, ip.tok_start]).to(torch.float32).t()  # (Tu, H) a(t)

    total = torch.exp(csum[:, ip.end] - csum[:, ip.start]).to(torch.float32).t()  # (I, H)
    fin[ip.pos] += total[:, :, None, None] * h0

    tok, blk = ip.tok, ip.block
    nb = tok.shape[0]
    Cb = torch.cat([C.to(torch.float32), C.new_zeros(1, G, N, dtype=torch.float32)])[tok]  # (nb, blk, G, N)
    ab = torch.cat([decay_tok, decay_tok.new_zeros(1, H)])[tok]  # (nb, blk, H)
    hb = h0.reshape(I, G, R * P, N)[ip.b_seq]  # (nb, G, R*P, N)
    corr = torch.matmul(Cb.permute(0, 2, 1, 3), hb.transpose(-1, -2))  # (nb, G, blk, R*P)
    corr = corr.view(nb, G, blk, R, P).permute(0, 2, 1, 3, 4).reshape(nb, blk, H, P) * ab[..., None]

    out = torch.cat([y.to(torch.float32), y.new_zeros(1, H, P, dtype=torch.float32)])
    out.index_add_(0, tok.reshape(-1), corr.reshape(nb * blk, H, P))  # each real token appears once
    return out[:Tu]


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    cu_seqlens: torch.Tensor,
    initial_states: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
    D: Optional[torch.Tensor] = None,
    plan: Optional[VarlenPlan] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_limit: Tuple[float, float] = (0.0, float("inf")),
    state_dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan over a packed varlen batch (contract: reference.ssd_chunk_scan).

    x: (T, H, P)  dt: (T, H) processed, or raw with dt_bias (H,) (the kernel then computes
    softplus(dt + dt_bias) clamped to dt_limit: ``process_dt`` fused into its first pass)  A: (H,)
    B, C: (T, G, N)  cu_seqlens: (S+1,) (CPU or device)
    initial_states: (S, H, P, N) or None  has_initial_state: (S,) bool or None (CPU or device)  D: (H,)|(H, P)
    plan: ``plan_prefill`` of the same bounds (the mixer's path: no host sync); None builds one here, which
    costs a sync for device bounds. A plan's flags take the place of has_initial_state's values for the
    correction; has_initial_state still selects the returned states of empty sequences.
    returns y: (T, H, P) in x.dtype, final_states: (S, H, P, N) in state_dtype (the caller's pool dtype: the
    kernel's states come in C's dtype, so a bf16 pool takes them without a round trip through float32).
    """
    k = _kernels()
    T, H, P = x.shape
    G, N = B.shape[-2], B.shape[-1]
    reference._groups(H, G)
    dev = x.device
    if plan is None:
        plan = build_plan(cu_seqlens, has_initial_state, initial_states is not None, T, chunk_size, (), dev)
    elif plan.T != T:
        raise ValueError(f"the VarlenPlan was built for {plan.T} tokens, x has {T}")
    S = plan.S
    if not plan.nonempty:
        return x.new_zeros(T, H, P), _initial_or_zeros(initial_states, has_initial_state, (S, H, P, N),
                                                       state_dtype, dev)

    # Only non-empty sequences go to the kernel: chunk_state_varlen would compute (end-1)//chunk for an
    # empty sequence at position 0 (ssd_chunk_state.py:661-675), and an empty one needs no work anyway.
    # The forward function itself, not the autograd Function around it (mamba_chunk_scan_combined): inference
    # needs no saved tensors, and the wrapper's host time counts here (prefill steps are host-bound).
    lo, hi = plan.cu[0], plan.cu[-1]
    raw = dt_bias is not None

    def fwd(a: int, b: int, **kw):
        """The forward over tokens [a, b) as one batch row (1, b-a, ...); dt raw (softplus + limit inside) or
        processed. Returns (out, out_x, dt, dA_cumsum, states, final_states[, varlen_states])
        (ssd_combined.py:343-393)."""
        def rows(t):  # t[a:b] as one batch row
            return row_range(t, a, b).unsqueeze(0)

        return k.ssd_fwd(rows(x), rows(dt), A, rows(B), rows(C),
                         int(chunk_size), D=D, dt_bias=dt_bias, dt_softplus=raw,
                         dt_limit=dt_limit if raw else (0.0, float("inf")), **kw)

    # seq_idx: int32 0..S'-1, the kernels only compare ids (ssd_bmm.py:84-88)
    native = _native_first(plan, initial_states)
    first = plan.nonempty[0]
    aligned = plan.final_chunks is not None
    res = fwd(lo, hi, seq_idx=plan.seq_idx_row, **({} if aligned else {"cu_seqlens": plan.cu_k}),
              **({"initial_states": initial_states[first: first + 1]} if native else {}))
    out, dt_k = res[0][0], res[2]  # (Tu, H, P) x.dtype; (1, H, chunks, chunk) f32
    if aligned:
        # Every sequence but the last ends where a chunk ends (always so for one sequence): its final state is the
        # state that state passing hands to the next chunk (ssd_state_passing.py:82; the next chunk's sequence
        # then resets it, :77-79), and the last one's is the row's final state (float32, :84). No
        # chunk_state_varlen launch: one autotuned launch less per layer (host time: prefill steps are
        # host-bound), and no chunk-0 gap to patch (that is chunk_state_varlen's).
        fin_k = res[5]  # (1, H, P, N)
        if plan.final_chunks.numel():
            cat = torch.promote_types(res[4].dtype, state_dtype)  # passed states are in C's dtype
            fin_k = torch.cat([res[4][0].index_select(0, plan.final_chunks).to(cat), fin_k.to(cat)])
    else:
        fin_k = res[-1]  # (S', H, P, N) in C's dtype (chunk_state_varlen)

    if native:
        end = plan.cu[first + 1] - lo
        # Ends in chunk 0: chunk_state_varlen left its h0 term out (module doc). (Aligned: no chunk_state_varlen;
        # the row's own state passing carried h0.)
        if end <= chunk_size and not aligned:
            decay = torch.exp(res[3][0, :, 0, end - 1])  # (H,): exp(sum of dt*A over its tokens), the kernel's own
            # Only its row changes: fixed alone in float32 (casting all S' states to float32 and back cost two
            # full-size copies per layer of every chunked-prefill step: benchmarks/RESULTS.md).
            row0 = fin_k[0].to(torch.float32) + decay[:, None, None] * initial_states[first].to(torch.float32)
            fin_k = fin_k.to(state_dtype)
            fin_k[0] = row0
    elif plan.init is not None and initial_states is not None:
        fin_k = fin_k.to(torch.float32)
        if len(plan.resumed) <= SEPARATE_RESUMED_MAX:
            # Few resumed sequences (chunked prefill resumes about one per step): rerun each alone, as one batch
            # row whose initial state the kernel takes natively, and overwrite its rows and final state. Costs
            # one more forward (6 launches) per sequence instead of the correction's ~40 small torch launches.
            for s in plan.resumed:
                a, b = plan.cu[s], plan.cu[s + 1]
                r = fwd(a, b, initial_states=initial_states[s: s + 1])
                out[a - lo: b - lo] = r[0][0]
                fin_k[plan.nonempty.index(s)] = r[5][0]  # float32 (ssd_state_passing.py:208)
        else:
            dt_ht = dt_k[0].reshape(H, -1)[:, : hi - lo]  # (H, Tu): the kernel's processed step sizes
            out = _add_initial_state(out, fin_k, dt_ht, A, C[lo:hi], plan.init,
                                     initial_states[plan.init.rows].to(torch.float32)).to(x.dtype)
    if lo == 0 and hi == T:  # every token covered (the mixer's case): the kernel's output is the result
        y = out
    else:
        y = x.new_zeros(T, H, P)
        y[lo:hi] = out
    fin_k = fin_k.to(state_dtype)
    if len(plan.nonempty) == S:
        return y, fin_k
    h0 = _initial_or_zeros(initial_states, has_initial_state, (S, H, P, N), state_dtype, dev)
    h0[plan.nonempty_dev] = fin_k  # empty sequences keep their (selected) initial state
    return y, h0


def _initial_or_zeros(initial_states, has_initial_state, shape, dtype, dev) -> torch.Tensor:
    """``_select_initial`` as a fresh tensor (never the caller's initial_states: callers write into it)."""
    h0 = _select_initial(initial_states, has_initial_state, shape, dtype, dev)
    if initial_states is not None and h0.data_ptr() == initial_states.data_ptr():
        h0 = h0.clone()
    return h0


# --------------------------------------------------------------------------------------------------------
# causal conv1d (prefill)
# --------------------------------------------------------------------------------------------------------


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    cu_seqlens: torch.Tensor,
    initial_states: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
    plan: Optional[VarlenPlan] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over a packed varlen batch (contract: reference.causal_conv1d).

    x: (T, D)  weight: (D, W)  bias: (D,) or None  cu_seqlens: (S+1,) starting at 0
    initial_states: (S, W-1, D) or None ("SD" layout)  has_initial_state: (S,) bool or None
    returns out: (T, D) in x.dtype, final_states: (S, W-1, D) in x.dtype.

    Two layouts, both ONE causal-conv1d launch with seq_idx (channel-last kernel):
    * every sequence >= W-1 tokens, no padding, x's rows 16-byte aligned with a row stride that is a multiple
      of 8, at most ``SEPARATE_RESUMED_MAX`` sequences resuming a state: x itself, read in place through its
      channel-last view (1, D, T); the kernel zero-pads each sequence's start where seq_idx changes, and each
      resumed sequence's first W-1 outputs are then recomputed from its state (one small launch each). Final
      states are the last W-1 input rows of each sequence (one gather).
    * otherwise an extended buffer, E = T + S*K rows, every row exactly once:
        row(init_s[j]) = cu[s] + s*K + j          row(token t of seq s) = t + (s+1)*K
        tokens t >= cu[S] (padding)  -> t + S*K, with seq_idx -1 (the kernel writes 0 for seq_idx < 0),
      where each sequence's K initial-state rows carry its seq_idx, so the kernel convolves through them.
    The row indices come from ``plan`` (``plan_prefill``, built once per step: no host sync); None builds
    one here from cu_seqlens and has_initial_state (a sync for device tensors). (Unlike the reference, a
    cu_seqlens not starting at 0 is not detected here.)
    """
    T, Dm = x.shape
    W = weight.shape[-1]
    K = W - 1
    reason = _conv_unsupported(Dm, W, x.dtype, weight.dtype)
    if reason is None and Dm % 8 != 0:
        # seq_idx needs the channel-last kernel (causal_conv1d.cpp:193), which needs dim % 8 == 0 (:179).
        reason = f"causal-conv1d's channel-last (varlen) kernel needs conv_dim % 8 == 0, got {Dm}"
    if reason is not None:
        _fallback(reason)
        return reference.causal_conv1d(x, weight, bias, cu_seqlens, initial_states, has_initial_state,
                                       activation)
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    k = _kernels()
    dev = x.device
    if plan is None:
        plan = build_plan(cu_seqlens, has_initial_state, initial_states is not None, T, 1, (W,), dev)
    elif plan.T != T:
        raise ValueError(f"the VarlenPlan was built for {plan.T} tokens, x has {T}")
    S = plan.S
    if S <= 0:
        return x.new_zeros(T, Dm), x.new_zeros(0, K, Dm)
    cp = conv_plan(plan, K)
    if bias is not None and bias.dtype != weight.dtype:
        bias = bias.to(weight.dtype)  # causal_conv1d.cpp:186: bias dtype must equal weight dtype
    silu = activation is not None

    resumed = [] if initial_states is None else plan.resumed
    rows_ok = cp.in_place and x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
    if rows_ok and len(resumed) <= SEPARATE_RESUMED_MAX:
        # Channel-last view (1, D, T), strides (D, 1, row stride): the kernel reads 8-channel vectors
        # (16 bytes) at row starts, hence the alignment checks (causal_conv1d.cpp:175-181 checks the strides).
        # A lone resumed sequence that opens the batch (sequence 0: in place, every sequence is non-empty) takes
        # the kernel's initial_states, which it gives the K positions before the row, tagged with seq_idx[0]
        # (causal_conv1d_fwd.cu:237, 304-312): no rerun.
        native = _native_first(plan, initial_states)
        init0 = initial_states[0].to(x.dtype).t().unsqueeze(0) if native else None  # (1, D, K), unit channel stride
        out = _conv_fwd(k, x.t().unsqueeze(0), weight, bias, plan.seq_idx_row, silu, init0)
        y = out[0].t()
        for s in [] if native else resumed:
            # Only a resumed sequence's first K outputs read its saved state (every sequence has >= K tokens
            # here): recompute those K rows from the state, through the kernel's initial_states (one sequence,
            # no seq_idx: the form the kernel supports, causal_conv1d.cpp:211-223).
            a = plan.cu[s]
            init_s = initial_states[s].to(x.dtype).t().unsqueeze(0)  # (1, D, K), unit channel stride
            y[a: a + K] = _conv_fwd(k, x[a: a + K].t().unsqueeze(0), weight, bias, None, silu, init_s)[0].t()
        # Final states: each sequence's last K inputs (>= K tokens each, so never the saved state).
        return y, x.index_select(0, cp.last_row).view(S, K, Dm)

    cp = conv_plan(plan, K, extended=True)
    # (S, K, D) in x.dtype, zeros where not flagged (garbage-safe); only read below.
    init = _select_initial(initial_states, has_initial_state, (S, K, Dm), x.dtype, dev)
    ext = torch.empty(cp.E, Dm, dtype=x.dtype, device=dev)  # fresh, contiguous: 16-byte aligned rows
    ext[cp.tok_row] = x
    ext[cp.state_row] = init.reshape(S * K, Dm)
    out = _conv_fwd(k, ext.t().unsqueeze(0), weight, bias, cp.seq_idx.unsqueeze(0), silu)
    y = out[0].t()[cp.tok_row]  # (T, D); padding tokens are 0
    final = ext[cp.final_row].view(S, K, Dm)
    return y, final


def _conv_fwd(k, xv: torch.Tensor, weight, bias, seq_idx: Optional[torch.Tensor], silu: bool,
              initial_states: Optional[torch.Tensor] = None) -> torch.Tensor:
    """causal-conv1d's forward extension called directly, as its ``causal_conv1d_fn`` would (no autograd
    Function, no custom-op dispatch: host time per layer matters in prefill). xv: (1, D, L) channel-last view;
    seq_idx: (1, L) int32 contiguous (causal_conv1d.cpp:195-198) or None; initial_states: (1, D, K) with unit
    channel stride, xv's dtype, or None. The output is allocated channel-last, (1, D, L) with strides
    (L*D, 1, D): the channel-last kernel writes channels at unit stride (causal_conv1d_fwd.cu:233)."""
    L, Dm = xv.shape[2], xv.shape[1]
    out = torch.empty(1, L, Dm, dtype=xv.dtype, device=xv.device).transpose(1, 2)
    k.conv_fwd(xv, weight, bias, seq_idx, initial_states, out, None, silu)
    return out


# --------------------------------------------------------------------------------------------------------
# decode: one-step updates of the state pools
# --------------------------------------------------------------------------------------------------------


def conv_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    state_indices: torch.Tensor,
    activation: Optional[str] = "silu",
) -> torch.Tensor:
    """One decode step, updating the pool in place (contract: reference.conv_update).

    x: (B, D)  conv_states: (num_slots, W-1, D) pool (any slot stride, inner dims contiguous)
    weight: (D, W)  bias: (D,) or None  state_indices: (B,) int  returns (B, D) in x.dtype.
    """
    Bsz, Dm = x.shape
    W = weight.shape[-1]
    reason = _conv_unsupported(Dm, W, x.dtype, weight.dtype)
    if reason is None and conv_states.dtype not in _CONV_DTYPES:
        reason = f"causal-conv1d does not support conv state dtype {conv_states.dtype}"
    # The kernel offsets the pool by slot * stride(0) in 32-bit unsigned arithmetic (ConvParamsBase strides
    # are uint32_t, causal_conv1d.h:10-27; causal_conv1d_update.cu:55-57): a pool spanning >= 2^32 elements
    # would wrap around.
    if reason is None and conv_states.shape[0] * conv_states.stride(0) >= 2**32:
        reason = "the conv state pool spans >= 2^32 elements (causal-conv1d uses 32-bit offsets)"
    if reason is not None:
        _fallback(reason)
        return reference.conv_update(x, conv_states, weight, bias, state_indices, activation)
    if Bsz == 0:
        return x.new_empty(0, Dm)
    k = _kernels()
    # int32, stride 1 (causal_conv1d.cpp:519-522); negative entries would be skipped (update.cu:47-54).
    idx = _unit_stride(state_indices.to(device=conv_states.device, dtype=torch.int32))
    if bias is not None and bias.dtype != weight.dtype:
        bias = bias.to(weight.dtype)  # causal_conv1d.cpp:500
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    # conv_state dtype must equal x dtype (causal_conv1d.cpp:479): store x in the pool's dtype.
    xs = (x if x.dtype == conv_states.dtype else x.to(conv_states.dtype)).unsqueeze(-1)  # (B, D, 1)
    out = torch.empty_like(xs)
    # The extension itself, as causal_conv1d_update's custom op (cpp_functions.py:71-91) calls it: the
    # torch.library custom-op dispatch in between costs ~30 us of host time per call, i.e. per layer of every
    # step that runs the mixer eagerly (mixed steps; every step in eager mode). Pool view (slots, D, W-1); the
    # kernel shifts it left by one and appends x, in place.
    k.conv_update(xs, conv_states.transpose(-1, -2), weight, bias, out, activation is not None, None, idx)
    out = out.squeeze(-1)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def ssm_state_update(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state_indices: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    launch: Optional[Tuple[int, int]] = None,
) -> torch.Tensor:
    """One decode step of the SSM recurrence, updating the pool in place (contract: reference.ssm_state_update).

    ssm_states: (num_slots, H, P, N) pool (any slot stride)  x: (B, H, P)  dt: (B, H) processed, or raw with
    dt_bias (H,) and dt_softplus=True (the kernel then computes softplus(dt + dt_bias))  A: (H,)
    B, C: (B, G, N)  state_indices: (B,) int  D: (H,) | (H, P) | None  returns y: (B, H, P) in x.dtype.
    launch: (BLOCK_SIZE_M, num_warps) for the kernel; None: ``ssu_launch_config`` (the upstream launch when it
    has no entry).
    """
    Bsz, H, P = x.shape
    N = ssm_states.shape[-1]
    reference._groups(H, B.shape[-2])
    if Bsz == 0:
        return x.new_empty(0, H, P)
    k = _kernels()
    dev = x.device
    # int64 indices: the Triton kernel offsets the pool by index * slot stride (selective_state_update.py:60-65)
    # and an int64 index keeps that product 64-bit for large pools. The kernel reads index pid_b at
    # ptr + pid_b, so the tensor must be contiguous. (No copy when the caller already passes int64.)
    idx = _unit_stride(state_indices.to(device=dev, dtype=torch.int64))
    # Multi-head form: dt (B, H, P), A (H, P, N), dt_bias (H, P), D (H, P), broadcast with stride 0 (as vLLM
    # does). With A, dt and dt_bias all stride-0 in the head dim the kernel takes its TIE_HDIM path
    # (selective_state_update.py:199): one scalar dt and exp(dt*A) per head. The kernel loads dt in any float
    # dtype and computes in float32, so dt is passed as it comes (no cast launch).
    # dt_bias and D must NOT be None here: the call site unpacks `*(t.stride(0), t.stride(1)) if t is not None
    # else 0`, i.e. `*0` -> TypeError for None (selective_state_update.py:207, 211), and line 199 evaluates
    # dt_bias.stride(-1) whenever A and dt are tied. So pass zeros (adding 0.0 to dt is exact).
    dt3 = dt[:, :, None].expand(Bsz, H, P)
    A3 = A.to(torch.float32)[:, None, None].expand(H, P, N)
    bias2 = _zeros_h1(H, dev) if dt_bias is None else dt_bias.to(torch.float32)[:, None]
    D2 = _zeros_h1(H, dev) if D is None else D
    D2 = D2[:, None].expand(H, P) if D2.dim() == 1 else (D2.expand(H, P) if D2.shape[-1] == 1 else D2)
    # The kernel reads the state in its dtype, computes in float32 and stores back in the pool dtype; y comes
    # from the float32 state (as the reference). dt_softplus uses threshold 20 (selective_state_update.py:102),
    # as torch's softplus; the kernel has no dt_limit clamp, so a clamped dt must come processed.
    cfg = launch if launch is not None else ssu_launch_config(Bsz, H, P, N, ssm_states.dtype)
    if cfg is None:
        return k.selective_state_update(
            ssm_states, x, dt3, A3, B, C, D=D2, z=None, dt_bias=bias2.expand(H, P),
            dt_softplus=bool(dt_softplus), state_batch_indices=idx,
        )
    return _launch_ssu(k, ssm_states, x, dt3, bias2.expand(H, P), A3, B, C, D2, idx, bool(dt_softplus), *cfg)


# (BLOCK_SIZE_M, num_warps) for mamba-ssm's ``_selective_scan_update_kernel``. Its wrapper always launches
# (4, 4) for d_state 128 (selective_state_update.py:193-197): head_dim/4 x batch x heads programs of one 4 x 128
# tile each, which reaches ~1.7 TB/s of state traffic on an H200. Measured there (benchmarks/ssu_launch.py,
# RESULTS.md, 2026-12-02): (16, 2) runs 2.1-3.0x faster from batch*heads >= 1536 (3.6-3.9 TB/s) and 1.3-1.5x at
# batch 1 with 80-128 heads; at batch*heads = 24 the two are within noise, so small launches keep upstream's.
# Keyed by (head_dim, d_state, state bytes); shapes not measured keep the upstream launch.
# fp32 states (--mamba-ssm-cache-dtype float32): the tile of vLLM 0.26's tuned H200 table for its copy of this
# kernel (configs/selective_state_update/headdim=64,dstate=128,device_name=NVIDIA_H200,cache_dtype=float32.json:
# BLOCK_SIZE_M 4 with one warp up to batch*heads 8192, 8 with one warp around 12288-24576), simplified to those
# two. Measured on the H200 (ssu_launch.py --state-dtype float32, RESULTS.md, 2026-12-03): these run at 3.7-3.9
# TB/s of state traffic at 2.7b and 7b, batch 64 and 256, and no other candidate was more than 2 % faster (a
# flat optimum); upstream's own (4, 4) was not in that sweep (the script's baseline row was this table's entry).
SSU_LAUNCH_TABLE: dict = {
    (64, 128, 2): [(64, (16, 2))],  # [(min batch*heads, (BLOCK_SIZE_M, num_warps)), ...] ascending
    (64, 128, 4): [(64, (4, 1)), (12288, (8, 1))],
}


def ssu_launch_config(batch: int, nheads: int, head_dim: int, dstate: int,
                      state_dtype: torch.dtype) -> Optional[Tuple[int, int]]:
    """The launch to use, or None for mamba-ssm's own (its wrapper)."""
    rows = SSU_LAUNCH_TABLE.get((head_dim, dstate, state_dtype.itemsize))
    cfg = None
    for lo, c in rows or ():
        if batch * nheads >= lo:
            cfg = c
    return cfg


def ssu_warm_batches(nheads: int, head_dim: int, dstate: int, state_dtype: torch.dtype) -> list:
    """Batch sizes whose state updates compile every launch ``ssu_launch_config`` can pick for this layer, each
    under each of Triton's specialisations of the integer ``batch`` argument (== 1, multiple of 16, other).
    A launch the warm-up never ran is compiled the first time a step needs it: on the H200 the fp32 table's
    second tile (from batch * heads >= 12 288, i.e. batch >= 154 at 2.7b) was compiled during serving, in a mixed
    step (vLLM's JIT monitor, benchmarks/RESULTS.md); a compile inside a CUDA-graph capture would fail."""
    rows = SSU_LAUNCH_TABLE.get((head_dim, dstate, state_dtype.itemsize), ())
    starts = sorted({1} | {max(1, -(-lo // nheads)) for lo, _ in rows})  # first batch of each launch's range
    out = set()
    for b, nxt in zip(starts, starts[1:] + [float("inf")]):
        out |= {c for c in (b, b + 1, (b // 16 + 1) * 16) if c < nxt}
    return sorted(out)


def _launch_ssu(k, state, x, dt, dt_bias, A, B, C, D, idx, dt_softplus: bool, block_m: int, num_warps: int):
    """mamba-ssm's ``_selective_scan_update_kernel`` launched exactly as its wrapper does
    (selective_state_update.py:186-219: same arguments, z = None), but with the given tile and warp count."""
    batch, nheads, dim = x.shape
    dstate = state.shape[-1]
    out = torch.empty_like(x)
    grid = ((dim + block_m - 1) // block_m, batch, nheads)
    tie_hdim = A.stride(-1) == 0 and A.stride(-2) == 0 and dt.stride(-1) == 0 and dt_bias.stride(-1) == 0
    with torch.cuda.device(x.device.index):
        k.ssu_kernel[grid](
            state, x, dt, dt_bias, A, B, C, D, None, out, idx,
            batch, nheads, dim, dstate, nheads // B.shape[1],
            *state.stride(), *x.stride(), *dt.stride(), *dt_bias.stride(), *A.stride(), *B.stride(),
            *C.stride(), *D.stride(), 0, 0, 0, *out.stride(),
            dt_softplus, tie_hdim, block_m, num_warps=num_warps,
        )
    return out


def _unit_stride(idx: torch.Tensor) -> torch.Tensor:
    """A 1-D index tensor with stride 1. ``.contiguous()`` is not enough: it keeps any stride of a one-element
    tensor (a one-row step's slot, sliced from a block-table column, has the table's row stride), and
    causal-conv1d's update checks ``conv_state_indices.stride(0) == 1`` (causal_conv1d.cpp:521)."""
    return idx if idx.stride(0) == 1 else idx.clone(memory_format=torch.contiguous_format)


_ZEROS: dict = {}


def _zeros_h1(H: int, dev: torch.device) -> torch.Tensor:
    """A cached (H, 1) float32 zero column per device (a fresh one per call would be one more launch per layer)."""
    key = (H, dev)
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros(H, 1, dtype=torch.float32, device=dev)
    return _ZEROS[key]


# --------------------------------------------------------------------------------------------------------
# gated RMSNorm
# --------------------------------------------------------------------------------------------------------


def gated_rms_norm(
    x: torch.Tensor,
    z: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """y = rmsnorm_per_group(x * silu(z)) * weight (contract: reference.gated_rms_norm).

    x, z: (M, d_inner)  weight: (d_inner,)  group_size divides d_inner  out: (M, d_inner) or None (written
    in place and returned). Returns x.dtype.
    mamba-ssm's kernel normalises each group of group_size channels (layernorm_gated.py:108-146) and gates
    before the norm when norm_before_gate=False (:81-83), computing in float32. ``_layer_norm_fwd`` is
    called directly (as ``rmsnorm_fn`` does inside its autograd Function) to write into ``out`` and skip the
    autograd wrapper: inference needs no backward.
    """
    d = x.shape[-1]
    if group_size <= 0 or d % group_size != 0:
        raise ValueError(f"d_inner ({d}) must be a multiple of group_size ({group_size})")
    if x.numel() == 0:
        return x.new_empty(x.shape) if out is None else out
    k = _kernels()
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    z2 = None if z is None else z.reshape(-1, d)
    if z2 is not None and z2.stride(-1) != 1:
        z2 = z2.contiguous()
    if out is not None and (out.stride(-1) != 1 or out.shape != x2.shape):
        raise ValueError(f"out must be ({x2.shape[0]}, {d}) with unit inner stride")
    y, _, _ = k.layer_norm_fwd(x2, weight.contiguous(), None, eps, z=z2, out=out, group_size=group_size,
                               norm_before_gate=False, is_rms_norm=True)
    return y.view(x.shape)
