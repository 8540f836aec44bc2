"""The chunked SSD scan of a packed prefill block: mamba-ssm's Triton SSD forward, one packed call per step.

Contract and notation: ``reference.ssd_chunk_scan`` (T tokens, S sequences, H heads, P head dim, G groups,
N state size; S' the non-empty sequences, Tu their tokens). Line numbers: mamba-ssm 2.3.2.post1.

**The upstream limit.** ``_mamba_chunk_scan_combined_fwd`` (what ``mamba_chunk_scan_combined`` runs inside its
autograd Function) takes one initial state per batch row (ssd_combined.py:369), and with seq_idx that state
reaches only the row's FIRST sequence: state passing starts from it and resets whenever seq_idx changes
(ssd_state_passing.py:64-80), and chunk scan applies the previous state only to tokens whose seq_idx equals the
previous token's (ssd_chunk_scan.py:98-113). Per-sequence final states of a packed row need cu_seqlens, which
requires batch == 1 (ssd_combined.py:390). One call per resumed sequence would work, but costs 5 Triton
launches each, and vLLM's runner can send many one-token rows that carry state.

**The calls** (``ssd_chunk_scan`` -> ``_scan``; ``varlen_plan.ResumePath``, decided once per step by the plan):

1. ONE packed call of every non-empty sequence, with seq_idx (``_packed_call``). Final states: when every
   sequence but the last ends on a chunk boundary (one sequence always does), they are the states that state
   passing hands from chunk to chunk: no ``chunk_state_varlen`` launch. Otherwise cu_seqlens asks for them
   (``chunk_state_varlen``, one more autotuned launch). Nobody resumes a state (NONE): done.
2. A resumed sequence that opens the batch (vLLM's runner orders a step's rows decode, short extend, long
   extend, fresh prompt, so the chunk that continues a cut prompt comes first) starts from its state as the
   packed call's ``initial_states`` (NATIVE when it is the only one). One upstream gap is patched:
   ``chunk_state_varlen`` adds the state entering a sequence's last chunk only if the sequence started before
   that chunk (ssd_chunk_state.py:700-706), so a first sequence ending in chunk 0 gets its final state without
   the h0 term; ``_patch_first_final`` adds exp(dA_cumsum[its last token]) h0 (the kernel's own in-chunk cumsum).
3. Every other resumed sequence (ROWS) goes as a batch row of one more call, from its own initial state: the
   kernels' native form (``_row_groups``, ``varlen_plan.RowGroup``). Rows of one call are padded at their end
   to the longest with tokens of processed step size 0, which leave a state unchanged; sequences whose lengths
   differ too much take separate calls, a lone one on its own tokens. Their rows of out and their final states
   replace the packed call's. When every sequence of the step resumes (a step of cache hits), the groups are
   the whole step: no packed call.
4. Empty sequences never reach the kernel (``chunk_state_varlen`` would compute (end-1)//chunk for an empty
   sequence at position 0, ssd_chunk_state.py:661-675); they keep their selected initial state.

Why these and no others: each resumed sequence starts from its state in the upstream kernels' own form, exact,
and a step makes few SSD calls. The alternatives this replaced (each resumed sequence rerun alone, an exact
linear correction of a zero-state result, a first sequence leading rows where every sequence resumes), forced
through served steps (benchmarks/prefill_steps.sh, RESULTS.md "Resume paths"), lost on cache hits and won
nowhere beyond the noise.

Final states come in C's dtype from the kernel's varlen states (float32 from a row group's call): with bf16
activations and an fp32 state pool, a prompt prefilled over several steps takes one bf16 rounding of its state
per step. With dt_bias the kernel's first pass applies softplus(dt + dt_bias) and the limit
(ssd_chunk_state.py:72-81): no separate dt kernels. Host sync: none. The step's ``PrefillBatch`` carries its plan
(``plan_prefill``, built by the metadata builder from host bounds, uploaded once); a batch without one is planned
from its host bounds at the call.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from .. import reference
from ..interface import PrefillBatch, ScanResult
from ..reference import row_range, select_initial
from . import upstream
from .varlen_plan import BoundaryRowsPlan, PaddedRows, ResumePath, VarlenPlan, add_boundaries, build_plan, plan_of


def plan_prefill(
    cu_seqlens_cpu: torch.Tensor,
    has_initial_state_cpu: Optional[torch.Tensor],
    num_tokens: int,
    chunk_size: int,
    conv_width: int,
    device: torch.device,
    boundary_offsets: Optional[list] = None,
) -> VarlenPlan:
    """The index plan of one step's prefill block, shared by every layer (see ``varlen_plan``): pass host
    tensors; the result lives on ``device`` after one non-blocking copy (two with boundary_offsets, prefix
    caching's: ``varlen_plan.add_boundaries``). The reference kernels need none."""
    plan = build_plan(cu_seqlens_cpu, has_initial_state_cpu, True, num_tokens, chunk_size, (conv_width,), device)
    if boundary_offsets is not None:
        add_boundaries(plan, boundary_offsets)
    return plan


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    batch: PrefillBatch,
    initial_states: Optional[torch.Tensor] = None,
    D: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_limit: Tuple[float, float] = (0.0, float("inf")),
    state_dtype: torch.dtype = torch.float32,
) -> ScanResult:
    """Chunked SSD scan over a packed varlen batch (contract: reference.ssd_chunk_scan; paths: module doc).

    x: (T, H, P)  dt: (T, H) processed, or raw with dt_bias (H,) (the kernel then computes
    softplus(dt + dt_bias) clamped to dt_limit: ``process_dt`` fused into its first pass)  A: (H,)
    B, C: (T, G, N)  initial_states: (S, H, P, N) or None  D: (H,)|(H, P)
    batch.plan: ``plan_prefill`` of the batch (the mixer's path); None plans the call here from the batch's host
    bounds and flags.
    returns ScanResult: y (T, H, P) in x.dtype, final_states (S, H, P, N) in state_dtype (the caller's pool
    dtype: the kernel's states come in C's dtype, so a bf16 pool takes them without a round trip through
    float32); with batch.boundary_offsets (prefix caching's block boundaries) also boundary_states, (M, H, P, N)
    in state_dtype (``_boundary_states``), mostly from the step's own calls.
    """
    T, H, P = x.shape
    N = B.shape[-1]
    reference.heads_per_group(H, B.shape[-2])
    dev = x.device
    plan = plan_of(batch, initial_states is not None, T, (), dev)
    S, offsets = plan.S, batch.boundary_offsets
    if not plan.nonempty:
        no_states = None if offsets is None else x.new_zeros(0, H, P, N, dtype=state_dtype)  # every offset > 0
        return ScanResult(x.new_zeros(T, H, P),
                          _initial_or_zeros(initial_states, batch.resumes, (S, H, P, N), state_dtype, dev), no_states)
    if plan.path is not ResumePath.NONE and initial_states is None:
        raise ValueError("the batch has resumed sequences: pass their initial_states")
    fwd = _Forward(x, dt, A, B, C, batch.chunk_size, D, dt_bias, dt_limit)
    if offsets is not None:
        add_boundaries(plan, offsets)  # set already where the batch was planned with them
    out, fin_k, calls = _scan(fwd, plan, initial_states, state_dtype)
    y, finals = _scatter(x, out, fin_k.to(state_dtype), plan, initial_states, batch.resumes, state_dtype)
    if offsets is None:
        return ScanResult(y, finals)
    return ScanResult(y, finals, _boundary_states(fwd, plan, calls, finals, initial_states, state_dtype, (H, P, N)))


def _scan(fwd: "_Forward", plan: VarlenPlan, initial_states, state_dtype):
    """The packed call and the row groups (``VarlenPlan.path``): (out (Tu, H, P) in x's dtype, final states
    (S', H, P, N) of the non-empty sequences, in C's dtype or float32, ``_Calls``: the ``SsdResult``s of the calls
    made, whose passed states give prefix caching's boundary states)."""
    calls = _Calls()
    out = fin_k = None
    if plan.packed_call:
        first = initial_states if plan.first_native else None
        out, fin_k, calls.packed = _packed_call(fwd, plan, first, state_dtype)
        if plan.first_native:
            fin_k = _patch_first_final(fin_k, calls.packed, plan, initial_states, fwd.chunk_size, state_dtype)
    if plan.groups:
        out, fin_k = _row_groups(fwd, out, fin_k, plan, initial_states, calls)
    return out, fin_k, calls


class _Calls:
    """The ``SsdResult``s of a scan's calls: the packed call, and each row group's call (in group order)."""

    def __init__(self):
        self.packed, self.groups = None, []


def _boundary_states(fwd: "_Forward", plan: VarlenPlan, calls: _Calls, finals, initial_states, state_dtype, hpn):
    """The states after the first o tokens of each sequence, for each o of the step's boundary offsets, from the
    sources of ``plan.boundary`` (``varlen_plan.BoundaryPlan``): the packed call (``_packed_states_at``), the
    passed states (``states``, in C's dtype) of the row groups' calls, the final states (finals: (S, H, P, N) in
    state_dtype) and a second pass for the rest. (M, H, P, N) in state_dtype."""
    H, P, N = hpn
    bp, parts = plan.boundary, []
    if bp.pairs is not None:
        parts.append(_packed_states_at(fwd, plan, calls.packed, bp.pairs).to(state_dtype))
    for g, idx in bp.groups.items():
        parts.append(calls.groups[g].states.reshape(-1, H, P, N).index_select(0, idx).to(state_dtype))
    if bp.final.numel():
        parts.append(finals.index_select(0, bp.final))
    if bp.rest is not None:
        parts.append(_second_pass(fwd, plan, initial_states, bp.rest, state_dtype, hpn))
    if not parts:
        return torch.zeros(0, *hpn, dtype=state_dtype, device=fwd.x.device)
    states = parts[0] if len(parts) == 1 else torch.cat(parts)
    return states if bp.order is None else states.index_select(0, bp.order)


def _packed_states_at(fwd: "_Forward", plan: VarlenPlan, res, pairs: torch.Tensor) -> torch.Tensor:
    """The states at the ends of ``pairs`` (``varlen_plan._packed_pairs``: one (start, end) per state, then the
    discarded pairs between them) from the packed call's result ``res``: mamba-ssm's ``chunk_state_varlen`` (as
    the call itself runs it for varlen final states, ssd_combined.py:391) over the call's x, B, processed dt,
    dA_cumsum and passed states, which computes each from the state entering its chunk and at most one chunk of
    tokens. (Mp, H, P, N) in C's dtype."""
    if res is None:
        raise AssertionError("boundary states planned from a packed call that did not run")
    lo, hi = plan.cu[0], plan.cu[-1]
    states = upstream.kernels().chunk_state_varlen(row_range(fwd.B, lo, hi), row_range(fwd.x, lo, hi), res.dt[0],
                                                   res.dA_cumsum[0], pairs, res.states[0])
    return states[0::2]


def _second_pass(fwd: "_Forward", plan: VarlenPlan, initial_states, boundary_offsets, state_dtype, hpn):
    """The states after the first o tokens of each sequence, for each o of boundary_offsets (per sequence), by
    computing those sequences again.

    Every sequence that has offsets runs over its tokens up to its last offset as a batch row from its own
    initial state (the kernel's native form): its chunks then start at the sequence start, so the state after
    o tokens, o a multiple of the chunk, is the state entering chunk o / chunk (``states``, after state passing,
    in C's dtype), and after the last offset the row's final state (float32). Two or more such sequences go as
    the rows of ONE call (``varlen_plan.BoundaryRowsPlan``); otherwise, or when the padding would be too large,
    one forward per sequence. An offset that is not a multiple of the chunk (a step that began inside a chunk)
    takes a forward of its own, ending there. Only what the step's own calls do not give comes here
    (``varlen_plan.BoundaryPlan``): inner boundaries inside a chunk of a sequence of a row group."""
    if plan.boundary_rows is not None:
        return _boundary_rows(fwd, plan.boundary_rows, initial_states, state_dtype, hpn)
    cs, out = fwd.chunk_size, []
    for s, offs in enumerate(boundary_offsets):
        if not offs:
            continue
        a = plan.cu[s]
        h0 = initial_states[s: s + 1] if initial_states is not None and plan.init_flags[s] else None
        kw = {} if h0 is None else {"initial_states": h0}
        last = max(offs)
        res = fwd(a, a + last, **kw) if all(o % cs == 0 or o == last for o in offs) else None
        for o in offs:
            if res is not None and o == last:
                out.append(res.final_states[0])
            elif res is not None:
                out.append(res.states[0, o // cs])
            else:
                out.append(fwd(a, a + o, **kw).final_states[0])
    if not out:
        return torch.zeros(0, *hpn, dtype=state_dtype, device=fwd.x.device)
    return torch.stack([t.to(state_dtype) for t in out])


def _boundary_rows(fwd: "_Forward", bp: BoundaryRowsPlan, initial_states, state_dtype, hpn):
    """The boundary states from one call of padded rows (``BoundaryRowsPlan``); (M, H, P, N) in state_dtype."""
    H, P, N = hpn
    I = bp.rows.I
    if initial_states is None:
        h0 = fwd.x.new_zeros(I, H, P, N, dtype=state_dtype)
    else:  # unflagged rows hold garbage (vLLM never zeroes a slot): masked, not multiplied
        h0 = initial_states.index_select(0, bp.seq).masked_fill_(bp.fresh[:, None, None, None], 0.0)
    res = fwd.padded(bp.rows, h0)
    states = torch.cat([res.states.reshape(I * bp.nchunks, H, P, N).to(state_dtype),
                        res.final_states.to(state_dtype)])
    return states.index_select(0, bp.pick)


class SsdResult(NamedTuple):
    """What mamba-ssm's SSD forward returns (ssd_combined.py:386-391), by name; I batch rows, Q chunks per row."""

    out: torch.Tensor  # (I, L, H, P) in x's dtype
    out_x: Optional[torch.Tensor]  # None (no z)
    dt: torch.Tensor  # (I, H, Q, chunk) float32: the processed step sizes
    dA_cumsum: torch.Tensor  # (I, H, Q, chunk) float32: the in-chunk cumulative dt * A
    states: torch.Tensor  # (I, Q, H, P, N) in C's dtype: the state entering each chunk (after state passing)
    final_states: torch.Tensor  # (I, H, P, N) float32 (ssd_state_passing.py:208)
    varlen_states: Optional[torch.Tensor] = None  # (S', H, P, N) in C's dtype, with cu_seqlens only


class _Forward:
    """mamba-ssm's SSD forward over tokens [a, b) of the step as one batch row (1, b-a, ...), dt raw (softplus +
    limit inside) or processed. The forward function itself, not the autograd Function around it: inference
    needs no saved tensors, and prefill steps are host-bound. A call returns an ``SsdResult``
    (ssd_combined.py:343-393)."""

    def __init__(self, x, dt, A, B, C, chunk_size, D, dt_bias, dt_limit):
        self.x, self.dt, self.A, self.B, self.C, self.chunk_size, self.D = x, dt, A, B, C, int(chunk_size), D
        self.dt_bias, self.raw = dt_bias, dt_bias is not None
        self.dt_limit = dt_limit if self.raw else (0.0, float("inf"))

    def gathered(self, src: torch.Tensor, pad: torch.Tensor) -> "_Forward":
        """The same forward over the tokens ``src`` (long) of this one, in that order, with processed step sizes;
        where ``pad`` (bool) is set the token is padding and gets a step size of exactly 0, whatever dt_limit's
        lower bound (the kernel would clamp a raw padding dt up to it, turning padding into real steps)."""

        def gather(t):
            return t.index_select(0, src)

        dt = gather(self.dt)
        dt = reference.process_dt(dt, self.dt_bias, self.dt_limit) if self.raw else dt.to(torch.float32)
        return _Forward(gather(self.x), dt.masked_fill_(pad[:, None], 0.0), self.A, gather(self.B), gather(self.C),
                        self.chunk_size, self.D, None, (0.0, float("inf")))

    def padded(self, rows: PaddedRows, initial_states: torch.Tensor):
        """The forward over padded rows (``varlen_plan.PaddedRows``), each from its row of initial_states; a
        padding token gets a step size of 0 (``gathered``)."""
        g = self.gathered(rows.src, rows.pad)

        def row(t):
            return t.view(rows.I, rows.L, *t.shape[1:])

        return SsdResult(*upstream.kernels().ssd_fwd(row(g.x), row(g.dt), g.A, row(g.B), row(g.C), g.chunk_size,
                                                     D=g.D, initial_states=initial_states))

    def __call__(self, a: int, b: int, **kw):
        def rows(t):
            return row_range(t, a, b).unsqueeze(0)

        return SsdResult(*upstream.kernels().ssd_fwd(rows(self.x), rows(self.dt), self.A, rows(self.B),
                                                     rows(self.C), self.chunk_size, D=self.D, dt_bias=self.dt_bias,
                                                     dt_softplus=self.raw, dt_limit=self.dt_limit, **kw))


def _packed_call(fwd: _Forward, plan: VarlenPlan, first_state: Optional[torch.Tensor], state_dtype):
    """The one packed call of all non-empty sequences (seq_idx: int32 0..S'-1; the kernels only compare ids,
    ssd_bmm.py:84-88), the first one starting from first_state's row (path 3) if given.
    Returns (out (Tu, H, P) x.dtype, final states (S', H, P, N), the call's ``SsdResult``)."""
    aligned = plan.final_chunks is not None
    first = plan.nonempty[0]
    res = fwd(plan.cu[0], plan.cu[-1], seq_idx=plan.seq_idx_row,
              **({} if aligned else {"cu_seqlens": plan.cu_k}),
              **({} if first_state is None else {"initial_states": first_state[first: first + 1]}))
    if not aligned:
        return res.out[0], res.varlen_states, res  # varlen states, in C's dtype (chunk_state_varlen)
    # Every sequence but the last ends where a chunk ends: its final state is the state that state passing
    # hands to the next chunk (ssd_state_passing.py:82; the next chunk's sequence then resets it, :77-79), and
    # the last one's is the row's final state (float32, :84). No chunk_state_varlen launch, and no chunk-0 gap.
    fin_k = res.final_states  # (1, H, P, N)
    if plan.final_chunks.numel():
        cat = torch.promote_types(res.states.dtype, state_dtype)  # passed states are in C's dtype
        fin_k = torch.cat([res.states[0].index_select(0, plan.final_chunks).to(cat), fin_k.to(cat)])
    return res.out[0], fin_k, res


def _patch_first_final(fin_k, res, plan: VarlenPlan, initial_states, chunk_size: int, state_dtype):
    """Path 3's upstream gap: a first sequence ending in chunk 0 got its varlen final state without the h0 term
    (module doc); add exp(dA_cumsum[last token]) h0. Aligned final states come from state passing, which
    carried h0 already."""
    first = plan.nonempty[0]
    end = plan.cu[first + 1] - plan.cu[0]
    if end > chunk_size or plan.final_chunks is not None:
        return fin_k
    decay = torch.exp(res.dA_cumsum[0, :, 0, end - 1])  # (H,): exp(sum of dt*A over its tokens), the kernel's
    # Only its row changes, in place: one launch that computes in float32 (decay's dtype) and rounds once, in the
    # wider of the two dtypes (casting all S' states to float32 and back cost two full-size copies per layer of
    # every chunked-prefill step: benchmarks/RESULTS.md).
    fin_k = fin_k.to(torch.promote_types(fin_k.dtype, state_dtype))
    fin_k[0].addcmul_(decay.view(-1, 1, 1), initial_states[first])
    return fin_k.to(state_dtype)


def _row_groups(fwd: _Forward, out, fin_k, plan: VarlenPlan, initial_states, calls: _Calls):
    """The row groups (``varlen_plan.RowGroup``): each one more call, every row from its own initial state (the
    kernels' native form, one state per batch row); a group of one on its sequence's own tokens, more as padded
    rows whose padding has a processed step size of 0 (``_Forward.gathered``): exp(0 * A) = 1 and dt * B * x = 0,
    so it leaves the state as it is and a row's final state is its sequence's. Their rows of out and their final
    states are overwritten; without a packed call (out and fin_k None: every sequence is in a group) the groups'
    results are the whole. Returns (out, float32 final states)."""
    x = fwd.x
    lo = plan.cu[0]
    if plan.whole_step:  # a step of cache hits: this call's rows are every token, in packed order
        group = plan.groups[0]
        h0 = initial_states if plan.all_resume else initial_states.index_select(0, group.seq_rows)
        res = fwd.padded(group.rows, h0)
        calls.groups.append(res)
        return res.out.reshape(-1, *res.out.shape[2:]).index_select(0, group.real), res.final_states
    if out is None:
        out = x.new_empty(plan.cu[-1] - lo, *x.shape[1:])
        fin = x.new_empty(len(plan.nonempty), *initial_states.shape[1:], dtype=torch.float32)
    else:
        fin = fin_k.to(torch.float32)
    for group in plan.groups:
        if group.rows is None:
            s = group.seqs[0]
            a, b = plan.cu[s], plan.cu[s + 1]
            res = fwd(a, b, initial_states=initial_states[s: s + 1])
            out[a - lo: b - lo] = res.out[0]
        else:
            res = fwd.padded(group.rows, initial_states.index_select(0, group.seq_rows))
            y = res.out.reshape(-1, *res.out.shape[2:]).index_select(0, group.real)
            out.index_copy_(0, group.dst, y)
        fin.index_copy_(0, group.pos, res.final_states)  # float32 (ssd_state_passing.py:208)
        calls.groups.append(res)
    return out, fin


def _scatter(x, out, fin_k, plan: VarlenPlan, initial_states, has_initial_state, state_dtype):
    """The kernel's results (non-empty sequences, tokens cu[0]..cu[S]) in the contract's shapes: y (T, H, P),
    zeros outside; final states (S, H, P, N), empty sequences keeping their selected initial state (path 7)."""
    T, H, P = x.shape
    lo, hi = plan.cu[0], plan.cu[-1]
    if lo == 0 and hi == T:  # every token covered (the mixer's case): the kernel's output is the result
        y = out
    else:
        y = x.new_zeros(T, H, P)
        y[lo:hi] = out
    if len(plan.nonempty) == plan.S:
        return y, fin_k
    h0 = _initial_or_zeros(initial_states, has_initial_state, (plan.S, H, P, fin_k.shape[-1]), state_dtype,
                           x.device)
    h0[plan.nonempty_dev] = fin_k
    return y, h0


def _initial_or_zeros(initial_states, has_initial_state, shape, dtype, dev) -> torch.Tensor:
    """``select_initial`` as a fresh tensor (never the caller's initial_states: callers write into it)."""
    h0 = select_initial(initial_states, has_initial_state, shape, dtype, dev)
    if initial_states is not None and h0.data_ptr() == initial_states.data_ptr():
        h0 = h0.clone()
    return h0
