"""Index plans for the CUDA prefill wrappers: built once per engine step, on the host, shipped in one copy.

Every mixer layer of a step runs ``conv.causal_conv1d`` and ``ssd_prefill.ssd_chunk_scan`` on the same packed batch, so
the index tensors they need (sequence ids, conv row layout, initial-state correction blocks) are the same for
all layers. Computing them per layer cost ~20 small launches per layer and, worse, host syncs: the SSD kernels
need sequence bounds on the host (``.tolist()`` of a device tensor waits for the GPU), and a host-to-device copy
from pageable memory synchronises the stream too. A plan is computed from the runner's host copies of the
bounds (free: the scheduler produced them) and uploaded with ONE non-blocking copy from pinned memory, so the
prefill path of a step has no host sync at all.

Notation as in ``reference.py`` / ``ssd_prefill.py``: S sequences with bounds ``cu`` (S+1), T tokens in x (tokens at
and after cu[S] are padding), K = W-1 conv state rows, Tu = cu[S]-cu[0] tokens sent to the SSD kernel,
S' = the non-empty sequences.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
import torch

# At most this many resumed sequences in a step are rerun one by one (SSD scan and conv); more go as the batch
# rows of one more SSD call (``ResumedRowsPlan``), or where that would pad too much, take the batched
# initial-state correction. One rerun is ~6 kernel launches of host time, the rows call ~12, the correction ~40
# small ones with float32 temporaries of (tokens, H, P). (A lone resumed sequence that opens the batch needs
# none of them: ``VarlenPlan.native_first``.)
SEPARATE_RESUMED_MAX = 3
# The rows call pads every resumed sequence to L, the longest rounded up to 16 (one Triton specialisation of the
# length), and is taken while its I * L tokens stay within ROWS_MAX_PADDING times the resumed sequences' own
# tokens (prefix-cache hits resume many short suffixes in one step) and L within ROWS_MAX_CHUNKS chunks (so a
# rows call never has a multiple of 16 chunks: the start-up warm-up compiles the classes it can have).
ROWS_MAX_PADDING = 2.0
ROWS_MAX_CHUNKS = 15


@dataclass
class ConvPlan:
    """Layouts of ``conv.causal_conv1d`` (see its docstring) for conv state width K.

    In place (x read directly): only ``last_row``. The extended buffer (E = T + S*K rows) needs the four row
    tensors below; they are built with the plan when the step cannot be read in place, and otherwise only on
    demand (``conv_plan(..., extended=True)``, once per step, cached here): most prefill steps never use them, and
    building them cost about half of a step's plan on the host (T-sized index arrays, a T-sized upload)."""

    K: int
    E: int
    # The in-place layout of fresh prompts (x read directly, no extended buffer):
    in_place: bool  # host: cu[0] == 0, cu[S] == T (no padding) and every sequence has >= K tokens
    last_row: torch.Tensor  # (S*K,) long: the last K tokens of each sequence in x (valid when in_place)
    tok_row: Optional[torch.Tensor] = None  # (T,) long: row of each token in the extended buffer
    state_row: Optional[torch.Tensor] = None  # (S*K,) long: rows of each sequence's K initial-state inputs
    seq_idx: Optional[torch.Tensor] = None  # (E,) int32: sequence id of every row, -1 for padding tokens
    final_row: Optional[torch.Tensor] = None  # (S*K,) long: the last K rows of each [init_s, seq_s] block


@dataclass
class InitCorrectionPlan:
    """Token blocks of ``ssd_prefill.add_initial_state`` for the sequences that carry an initial state."""

    block: int  # tokens per block (a power of two <= the SSD chunk size)
    tok_start: torch.Tensor  # (Tu,) long: first token of each token's sequence (relative to cu[0])
    start: torch.Tensor  # (I,) long: bounds of the I continuing sequences
    end: torch.Tensor  # (I,) long
    pos: torch.Tensor  # (I,) long: their index among the S' non-empty sequences
    rows: torch.Tensor  # (I,) long: their index among all S sequences (rows of initial_states)
    tok: torch.Tensor  # (nb, block) long: the tokens of each block, Tu (a zero dummy row) past the end
    b_seq: torch.Tensor  # (nb,) long: the continuing sequence (0..I-1) of each block


@dataclass
class PaddedRows:
    """Sequences as the rows of one (I, L) SSD batch, each padded at its end to L: the longest, rounded up to 16
    (one Triton specialisation of the length).

    src: (I*L,) long: the token of x in each row position (padding repeats the sequence's first token: its x, B
    and C only reach padding outputs, and its dt is overwritten so that it neither decays nor feeds the state);
    pad: (I*L,) bool: padding positions."""

    I: int
    L: int
    src: torch.Tensor
    pad: torch.Tensor


@dataclass
class ResumedRowsPlan:
    """The I resumed sequences as padded rows (``rows``, each from its own state). real: (Tr,) long: the row
    positions of the sequences' tokens, in packed order; dst: (Tr,) long: those tokens relative to cu[0] (rows of
    the packed call's output)."""

    rows: PaddedRows
    real: torch.Tensor
    dst: torch.Tensor


@dataclass
class ConvBoundaryRows:
    """Prefix caching's boundary conv states of a step as gathers (``conv.conv_states_at``): the state after o
    tokens of sequence s is the K inputs before position o, rows cu[s] + o - K ... cu[s] + o - 1 of x, where o >= K.

    x_rows: (M*K,) long: those rows of x for every offset (in boundary_offsets order); where o < K the first
    K - o of them lie in the sequence's initial state instead, and pick (M*K,) long indexes
    cat(x rows gathered, initial states (S*K rows)); None when every offset is >= K (then x_rows alone serve)."""

    x_rows: torch.Tensor
    pick: Optional[torch.Tensor]


@dataclass
class BoundaryRowsPlan:
    """Prefix caching's boundary states of a step from ONE SSD call: each sequence with boundary offsets (all chunk
    multiples but maybe its last) as a padded row (``rows``) from its own initial state (zeros if fresh) over its
    tokens up to its last offset. The state after o tokens is then the state entering the row's chunk o / chunk
    (the call's ``states``), and after the last offset the row's final state.

    seq: (I,) long: the rows' sequences (rows of initial_states); fresh: (I,) bool: rows without a saved state
    (their initial state is zeroed); pick: (M,) long: for every offset in boundary_offsets order, its state's row
    in cat(states (I * nchunks), final states (I))."""

    rows: PaddedRows
    nchunks: int
    seq: torch.Tensor
    fresh: torch.Tensor
    pick: torch.Tensor


@dataclass
class BoundaryPlan:
    """Where prefix caching's boundary states of a step come from (``ssd_prefill._boundary_states``); built on
    the host and uploaded once per step. Five sources, concatenated in this order, then put in the order of the
    offsets (``order``):

    1. packed: the inner offsets (before the sequence's end) of the sequences the packed call computes from their
       true initial state (fresh ones; the first one when it takes the kernel's own initial state): ONE launch of
       mamba-ssm's ``chunk_state_varlen`` over the packed call's own tensors, asked for the states at ``pairs``
       (``_packed_pairs``), in offset order;
    2. rows: (Mr,) long: states entering chunks of the call of resumed rows (``ResumedRowsPlan``; a row starts at
       its sequence's start), as rows of its states flattened to (I * chunks, ...), for inner offsets that are
       chunk multiples;
    3. rerun: {sequence: (chunks,) long}: the same from the rerun of each resumed sequence, in sequence order;
    4. final: (Mf,) long: sequences whose offset is their end: the final state, whatever path computed it;
    5. rest: the other offsets (inner offsets of resumed sequences under the correction, or inside a chunk), per
       sequence, for a second pass over those sequences (``boundary_rows`` or one forward each); None if none.

    pairs: (2 Mp,) int32 (start, end) per state of source 1, relative to the packed call's first token, as
    ``chunk_state_varlen`` reads its cu_seqlens; None when source 1 is empty.
    order: (M,) long: each offset's row in the concatenation of 1-5; None: already in order."""

    pairs: Optional[torch.Tensor]
    rows: torch.Tensor
    rerun: Dict[int, torch.Tensor]
    final: torch.Tensor
    rest: Optional[List[List[int]]]
    order: Optional[torch.Tensor]


@dataclass
class VarlenPlan:
    # host
    cu: List[int]  # (S+1) token bounds
    init_flags: List[bool]  # (S) does sequence s start from a saved state
    T: int  # tokens in x (>= cu[S])
    nonempty: List[int]  # the S' non-empty sequences
    # device
    cu_k: torch.Tensor  # (S'+1,) int32 bounds of the non-empty sequences, relative to cu[0]
    seq_idx: torch.Tensor  # (Tu,) int32 id (0..S'-1) of each token's sequence
    seq_idx_row: torch.Tensor  # (1, Tu) view of seq_idx: the kernels' one batch row, made once per step
    nonempty_dev: torch.Tensor  # (S',) long
    resume_mask: torch.Tensor  # (S,) bool: init_flags on the device (the layers' has_initial_state)
    # (S'-1,) long: when every non-empty sequence but the last ends on an SSD chunk boundary (relative to cu[0]),
    # the chunk whose entering state is each one's final state; None otherwise (see ssd_prefill.ssd_chunk_scan)
    final_chunks: Optional[torch.Tensor] = None
    # host: the first non-empty sequence resumes and takes the packed call's own initial state while others resume
    # too (``others``); never where all resumed sequences fit as the rows of one call
    lead: bool = False
    init: Optional[InitCorrectionPlan] = None  # over ``others``; None: none of them
    # host: every sequence is non-empty and resumes (a step of cache hits); unless ``lead``, init.rows is then
    # 0..S-1 and the rows of initial_states need no gather
    all_resume: bool = False
    rows: Optional[ResumedRowsPlan] = None  # ``others`` as rows: more than SEPARATE_RESUMED_MAX, within the limits
    conv: Dict[int, ConvPlan] = field(default_factory=dict)  # by K; read through ``conv_plan``
    device: torch.device = torch.device("cpu")  # where the plan's tensors live (on-demand conv layouts too)
    # boundary_plan's result for the step's boundary offsets (the same list object for every layer): (offsets,
    # (has_states, chunk_size), plan); boundary_rows' likewise: (offsets, plan)
    boundary_plan_cache: Optional[tuple] = None
    boundary_cache: Optional[tuple] = None
    # conv_boundary_rows' result, likewise: (offsets, K, ConvBoundaryRows)
    conv_boundary_cache: Optional[tuple] = None

    @property
    def S(self) -> int:
        return len(self.cu) - 1

    @functools.cached_property
    def resumed(self) -> List[int]:
        """The non-empty sequences that start from a saved state (host; asked several times in every layer)."""
        return [s for s in self.nonempty if self.init_flags[s]]

    @functools.cached_property
    def others(self) -> List[int]:
        """The resumed sequences the packed call cannot start from their state: all but a ``lead`` first one."""
        return self.resumed[1:] if self.lead else self.resumed

    @property
    def rows_cover_all(self) -> bool:
        """Every non-empty sequence is one of ``others`` (a step of cache hits): a rows call alone computes the
        step."""
        return self.others == self.nonempty != []

    def native_first(self, has_states: bool) -> bool:
        """The only sequence that resumes a state is the first non-empty one of the packed batch: the kernels'
        own initial state (per batch row, which with seq_idx reaches exactly the row's first sequence) serves
        it. has_states: the caller passed initial states at all."""
        return has_states and self.resumed == self.nonempty[:1] != []

    def first_takes_state(self, has_states: bool) -> bool:
        """The packed call starts its first sequence from that sequence's state: ``native_first``, or ``lead``
        (then ``others`` take one of the paths below as well)."""
        return has_states and (self.lead or self.native_first(True))

    def resume_path(self, has_states: bool) -> str:
        """How ``ssd_prefill`` computes the resumed sequences: "none" (no non-empty sequence resumes a state, or no
        states given), "native" (``native_first``), or, for ``others``: "rerun" (each alone, at most
        ``SEPARATE_RESUMED_MAX``), "rows" (as the rows of one more call) or "correction"."""
        if self.native_first(has_states):
            return "native"
        if self.init is None or not has_states:
            return "none"
        if len(self.others) <= SEPARATE_RESUMED_MAX:
            return "rerun"
        return "rows" if self.rows is not None else "correction"

    def reruns_resumed(self) -> bool:
        """The conv's choice: up to ``SEPARATE_RESUMED_MAX`` resumed sequences keep the in-place layout (each one's
        first outputs recomputed from its state); more take the extended buffer (``conv.causal_conv1d``)."""
        return len(self.resumed) <= SEPARATE_RESUMED_MAX


def _upload(host: Dict[str, torch.Tensor], device: torch.device) -> Dict[str, torch.Tensor]:
    """Many small host int tensors -> device, with one copy (pinned and non-blocking on CUDA)."""
    names = list(host)
    flat = [host[n].reshape(-1).to(torch.int64) for n in names]
    buf = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.int64)
    if device.type == "cuda":
        buf = buf.pin_memory().to(device, non_blocking=True)
    else:
        buf = buf.to(device)
    out, off = {}, 0
    for n, f in zip(names, flat):
        out[n] = buf[off: off + f.numel()].view(host[n].shape)
        off += f.numel()
    return out


def build_plan(
    cu_seqlens: torch.Tensor,
    has_initial_state: Optional[torch.Tensor],
    have_initial_states: bool,
    num_tokens: int,
    chunk_size: int,
    conv_widths: tuple = (),
    device: torch.device = torch.device("cpu"),
) -> VarlenPlan:
    """Plan of one packed batch.

    cu_seqlens: (S+1,) int; has_initial_state: (S,) bool or None (None: all True when have_initial_states);
    num_tokens: T, the tokens of x; chunk_size: the SSD chunk (correction blocks are at most this long);
    conv_widths: the conv widths W to lay out for ``causal_conv1d`` (usually one).
    Pass CPU tensors: device tensors work but cost a sync (``.tolist()``).
    """
    cu = [int(v) for v in cu_seqlens.tolist()]
    S = len(cu) - 1
    if any(b < a for a, b in zip(cu[:-1], cu[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu}")
    if S > 0 and cu[-1] > num_tokens:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but x has only {num_tokens} tokens")
    flags = _init_flags(has_initial_state, have_initial_states, S)

    lo = cu[0] if S > 0 else 0
    ne = [s for s in range(S) if cu[s + 1] > cu[s]]
    cu_k = [0] + [cu[s + 1] - lo for s in ne]
    # Token-sized host arrays in numpy: torch's CPU repeat_interleave runs a parallel loop over the sequences
    # (grain 1), and waking the intra-op threads costs milliseconds per call on a many-core host (cProfile of the
    # metadata build: benchmarks/prefill_layer.py --host-profile); numpy stays on the calling thread.
    cu_k_np = np.asarray(cu_k, dtype=np.int64)
    seq_idx_np = np.repeat(np.arange(len(ne), dtype=np.int64), np.diff(cu_k_np))
    host = {
        "cu_k": torch.from_numpy(cu_k_np),
        "seq_idx": torch.from_numpy(seq_idx_np),
        "nonempty": torch.tensor(ne, dtype=torch.long),
        "resume_mask": torch.tensor(flags, dtype=torch.long),
    }
    if ne and all(e % chunk_size == 0 for e in cu_k[1:-1]):
        host["final_chunks"] = torch.tensor([e // chunk_size for e in cu_k[1:-1]], dtype=torch.long)
    init_pos = [i for i, s in enumerate(ne) if flags[s]]
    # Resumed sequences go as rows of one call where they fit (the whole step where every sequence resumes);
    # otherwise a resumed first sequence leads (the packed call starts it from its state: no rerun, correction or
    # second pass for it), and only the others take rows, reruns or the correction.
    rows_shape = _rows_host(host, cu, ne, init_pos, chunk_size) if _many(init_pos) else None
    lead = rows_shape is None and len(init_pos) > 1 and init_pos[0] == 0
    rest = init_pos[1:] if lead else init_pos
    blk = _correction_host(host, cu_k_np, seq_idx_np, rest, chunk_size) if rest else 0
    if rows_shape is None and _many(rest):
        rows_shape = _rows_host(host, cu, ne, rest, chunk_size)
    in_place = {}
    for W in conv_widths:
        K = W - 1
        in_place[K] = S > 0 and cu[0] == 0 and cu[-1] == num_tokens and min(b - a for a, b in zip(cu, cu[1:])) >= K
        host[f"c{K}_last_row"] = _conv_last_rows(cu, K)
        if not in_place[K]:  # the extended buffer will be needed: in the same upload
            host.update({f"c{K}_{k}": v for k, v in _conv_ext_host(cu, num_tokens, K).items()})

    dev = _upload(host, device)
    seq_idx = dev["seq_idx"].to(torch.int32)
    plan = VarlenPlan(
        cu=cu, init_flags=flags, T=num_tokens, nonempty=ne, cu_k=dev["cu_k"].to(torch.int32), seq_idx=seq_idx,
        seq_idx_row=seq_idx.unsqueeze(0), nonempty_dev=dev["nonempty"], resume_mask=dev["resume_mask"].bool(),
        final_chunks=dev.get("final_chunks"),
        device=device,
    )
    plan.all_resume, plan.lead = S > 0 and len(init_pos) == S, lead
    if rest:
        plan.init = InitCorrectionPlan(
            block=blk, tok_start=dev["i_tok_start"], start=dev["i_start"], end=dev["i_end"], pos=dev["i_pos"],
            rows=dev["i_rows"], tok=dev["i_tok"], b_seq=dev["i_b_seq"],
        )
    if rows_shape is not None:
        plan.rows = ResumedRowsPlan(_padded_rows(*rows_shape, dev, "r_"), real=dev["r_real"], dst=dev["r_dst"])
    for W in conv_widths:
        K = W - 1
        cp = ConvPlan(K=K, E=num_tokens + S * K, in_place=in_place[K], last_row=dev[f"c{K}_last_row"])
        if f"c{K}_tok_row" in dev:
            _set_ext(cp, {k: dev[f"c{K}_{k}"] for k in ("tok_row", "state_row", "seq_idx", "final_row")})
        plan.conv[K] = cp
    return plan


def _many(positions: List[int]) -> bool:
    """More resumed sequences than are rerun one by one."""
    return bool(positions) and len(positions) > SEPARATE_RESUMED_MAX


def _init_flags(has_initial_state: Optional[torch.Tensor], have_initial_states: bool, S: int) -> List[bool]:
    """Per sequence: does it start from a saved state (None: all do, when initial states are given)."""
    if not have_initial_states:
        return [False] * S
    if has_initial_state is None:
        return [True] * S
    flags = [bool(v) for v in has_initial_state.reshape(-1).tolist()]
    if len(flags) != S:
        raise ValueError(f"has_initial_state has {len(flags)} entries for {S} sequences")
    return flags


def _correction_host(host: Dict[str, torch.Tensor], cu_k_np, seq_idx_np, init_pos: List[int], chunk_size: int) -> int:
    """The host tensors of the ``InitCorrectionPlan`` of the non-empty sequences at positions init_pos, added
    to host as "i_*"; returns the block length."""
    Tu = int(cu_k_np[-1])
    pos_t = torch.tensor(init_pos)
    starts, ends = host["cu_k"][pos_t], host["cu_k"][pos_t + 1]
    lens = (ends - starts).tolist()
    # Blocks of at most chunk_size tokens of one sequence; a power of two fitting the longest sequence.
    blk = max(1, min(int(chunk_size), 1 << (max(lens) - 1).bit_length()))
    nblk = [(n + blk - 1) // blk for n in lens]
    b_seq = torch.from_numpy(np.repeat(np.arange(len(init_pos), dtype=np.int64), nblk))
    first = torch.tensor([0] + nblk[:-1]).cumsum(0)
    b_k = torch.arange(len(b_seq)) - first[b_seq]
    tok = starts[b_seq, None] + b_k[:, None] * blk + torch.arange(blk)[None, :]
    tok = torch.where(tok < ends[b_seq, None], tok, torch.full_like(tok, Tu))
    host.update({
        "i_tok_start": torch.from_numpy(cu_k_np[seq_idx_np]),
        "i_start": starts, "i_end": ends,
        "i_pos": pos_t, "i_rows": host["nonempty"][pos_t],
        "i_tok": tok, "i_b_seq": b_seq,
    })
    return blk


def _padded_rows_host(host: Dict[str, torch.Tensor], prefix: str, starts: List[int], lens: List[int],
                      chunk_size: int) -> Optional[tuple]:
    """The host arrays of ``PaddedRows`` for sequences at these starts and lengths, added to host as
    prefix + "src" / "pad"; returns (I, L), or None where the padding or the length exceeds the limits
    (ROWS_MAX_PADDING, ROWS_MAX_CHUNKS)."""
    start, n = np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64)
    I, L = len(starts), -(-int(n.max()) // 16) * 16
    if I * L > ROWS_MAX_PADDING * int(n.sum()) or L > ROWS_MAX_CHUNKS * chunk_size:
        return None
    j = np.arange(L, dtype=np.int64)[None, :]
    pad = j >= n[:, None]  # (I, L)
    src = np.where(pad, start[:, None], start[:, None] + j)
    host.update({prefix + "src": torch.from_numpy(src.reshape(-1)),
                 prefix + "pad": torch.from_numpy(pad.reshape(-1).astype(np.int64))})
    return I, L


def _padded_rows(I: int, L: int, dev: Dict[str, torch.Tensor], prefix: str) -> PaddedRows:
    return PaddedRows(I=I, L=L, src=dev[prefix + "src"], pad=dev[prefix + "pad"].bool())


def _rows_host(host: Dict[str, torch.Tensor], cu: List[int], ne: List[int], init_pos: List[int], chunk_size: int):
    """The host tensors of the ``ResumedRowsPlan`` (added to host as "r_*") and its (I, L); None beyond the
    limits (``_padded_rows_host``)."""
    seqs = [ne[i] for i in init_pos]
    shape = _padded_rows_host(host, "r_", [cu[s] for s in seqs], [cu[s + 1] - cu[s] for s in seqs], chunk_size)
    if shape is not None:
        src = host["r_src"].numpy()
        real = np.flatnonzero(host["r_pad"].numpy() == 0)
        host.update({"r_real": torch.from_numpy(real), "r_dst": torch.from_numpy(src[real] - cu[0])})
    return shape


def _set_ext(cp: ConvPlan, ext: Dict[str, torch.Tensor]) -> None:
    cp.tok_row, cp.state_row, cp.final_row = ext["tok_row"], ext["state_row"], ext["final_row"]
    cp.seq_idx = ext["seq_idx"].to(torch.int32)


def _conv_last_rows(cu: List[int], K: int) -> torch.Tensor:
    """(S*K,) the last K token rows of each sequence (clamped at 0; valid for sequences of >= K tokens)."""
    rows = np.asarray(cu[1:], dtype=np.int64)[:, None] - K + np.arange(K, dtype=np.int64)[None, :]
    return torch.from_numpy(np.maximum(rows, 0).reshape(-1))


def _conv_ext_host(cu: List[int], T: int, K: int) -> Dict[str, torch.Tensor]:
    """Rows of the extended buffer [init_0, seq_0, init_1, seq_1, ...] (cu must start at 0):
    row(init_s[j]) = cu[s] + s*K + j; row(token t of seq s) = t + (s+1)*K; padding token t >= cu[S] -> t + S*K."""
    S = len(cu) - 1
    cu_a = np.asarray(cu, dtype=np.int64)  # numpy: T-sized host work off torch's intra-op threads (build_plan)
    t = np.arange(T, dtype=np.int64)
    seq_of_tok = np.searchsorted(cu_a[1:], t, side="right")  # (T,) in [0, S]; S = past the last sequence
    tok_row = t + np.minimum(seq_of_tok + 1, S) * K
    s_ar = np.arange(S, dtype=np.int64)
    state_row = ((cu_a[:-1] + s_ar * K)[:, None] + np.arange(K)[None, :]).reshape(-1)
    seq_idx = np.empty(T + S * K, dtype=np.int64)
    seq_idx[tok_row] = np.where(seq_of_tok < S, seq_of_tok, -1)
    seq_idx[state_row] = np.repeat(s_ar, K)
    end_row = cu_a[1:] + (s_ar + 1) * K  # one past the last row of [init_s, seq_s]
    final_row = (end_row[:, None] - K + np.arange(K)[None, :]).reshape(-1)
    return {k: torch.from_numpy(v) for k, v in
            (("tok_row", tok_row), ("state_row", state_row), ("seq_idx", seq_idx), ("final_row", final_row))}


def boundary_plan(plan: VarlenPlan, offsets, chunk_size: int, has_states: bool) -> BoundaryPlan:
    """The ``BoundaryPlan`` of these boundary offsets (per sequence, 0 < o <= its length in the step), built once
    per plan. has_states: the scan gets initial states at all."""
    key = (has_states, chunk_size)
    cache = plan.boundary_plan_cache
    if cache is not None and cache[0] is offsets and cache[1] == key:
        return cache[2]
    if len(offsets) != plan.S:
        raise ValueError(f"boundary_offsets has {len(offsets)} entries for {plan.S} sequences")
    path = plan.resume_path(has_states)
    packed, pairs = _packed_pairs(plan, offsets, chunk_size, has_states and path != "none",
                                  plan.first_takes_state(has_states))
    picks: Dict[object, list] = {}  # source -> what to take from it; a rerun's source is ("rerun", sequence)
    where = []  # per offset: (source, position among the source's picks)
    for s, offs in enumerate(offsets):
        for o in offs:
            source, pick = _source_of(plan, s, o, chunk_size, path, packed)
            where.append((source, len(picks.setdefault(source, []))))
            picks[source].append(pick)
    assert picks.get("packed", []) == list(range(len(packed)))  # chunk_state_varlen's rows come in offset order
    reruns = sorted(k for k in picks if isinstance(k, tuple))
    keys = [k for k in ("packed", "rows", *reruns, "final", "rest") if k in picks]
    base = dict(zip(keys, np.cumsum([0] + [len(picks[k]) for k in keys]).tolist()))
    order = [base[k] + i for k, i in where]  # the rest come back from a second pass in sequence order, as picked
    host = {k: torch.tensor(picks.get(k, []), dtype=torch.long) for k in ("rows", "final")}
    host.update({f"rerun{k[1]}": torch.tensor(picks[k], dtype=torch.long) for k in reruns})
    if pairs:
        host["pairs"] = torch.tensor(pairs, dtype=torch.long)
    if order != sorted(order):
        host["order"] = torch.tensor(order, dtype=torch.long)
    dev = _upload(host, plan.device)
    rest = [[o for s2, o in picks.get("rest", []) if s2 == s] for s in range(plan.S)]
    result = BoundaryPlan(pairs=dev["pairs"].to(torch.int32) if pairs else None, rows=dev["rows"],
                          rerun={k[1]: dev[f"rerun{k[1]}"] for k in reruns}, final=dev["final"],
                          rest=rest if any(rest) else None, order=dev.get("order"))
    plan.boundary_plan_cache = (offsets, key, result)
    return result


def _source_of(plan: VarlenPlan, s: int, o: int, cs: int, path: str, packed: dict) -> tuple:
    """(source, what to take from it) for the state after o tokens of sequence s: its final state; the packed
    call's (``_packed_pairs``); the call that computes one of ``others`` from its own start (a row of the resumed
    rows' call, flattened to (rows * chunks), or its rerun), at a chunk multiple; else the second pass's."""
    if o == plan.cu[s + 1] - plan.cu[s]:
        return "final", s
    if (s, o) in packed:
        return "packed", packed[(s, o)]
    if path in ("rows", "rerun") and s in plan.others and o % cs == 0:
        if path == "rerun":
            return ("rerun", s), o // cs
        row = plan.others.index(s)  # the rows call's rows are ``others``, in order
        return "rows", row * -(-plan.rows.rows.L // cs) + o // cs
    return "rest", (s, o)


def _packed_pairs(plan: VarlenPlan, offsets, cs: int, any_resumed: bool, native: bool) -> tuple:
    """({(s, o): k}, pairs): the k-th (start, end) of ``pairs`` asks mamba-ssm's ``chunk_state_varlen`` for the
    state after o tokens of sequence s, for the inner offsets (before its end) of the sequences the packed call
    computes from their true initial state (fresh ones; the first one when it takes the kernel's own initial state).

    The kernel (ssd_chunk_state.py:656-715) computes, for each consecutive (start, end) of its cu_seqlens, the
    state at token ``end`` (after the tokens before it): with c = (end - 1) // cs, the tokens of chunk c from
    max(start, c * cs) to end, plus the state entering chunk c (the call's passed states) decayed to end if
    start < c * cs. For sequence s at position a of the packed call, end = a + o: the state entering chunk c is
    s's own if s began before c (it owns the token before c * cs; state passing resets at sequence starts), so
    start = (c - 1) * cs + 1, any start below c * cs would do; else start = a (s began inside chunk c, from
    zeros: a fresh sequence), except the first sequence, at 0, which takes start = -1 in chunk 0: the state
    entering chunk 0 is the call's initial state (the kernel's own for the native first sequence, zeros
    otherwise).
    Given [start0, end0, start1, end1, ...] the kernel also computes the odd pairs (end0, start1), ..., which are
    discarded. Each program loops over its end's chunk up to its end, so a start just past a chunk start keeps
    the odd pair ending there to one token. Their ends must be real positions >= 1 (the kernel reads dA_cumsum at
    end - 1): only the first pair may start below 1, so a second offset of the first sequence inside chunk 0
    (blocks shorter than the chunk, which the engine refuses) goes to the second pass instead. (cs >= 2.)"""
    cu = plan.cu
    packed: Dict[tuple, int] = {}
    pairs: List[int] = []
    for s in range(plan.S):
        n, a = cu[s + 1] - cu[s], cu[s] - cu[0]
        for o in offsets[s]:
            if not 0 < o <= n:
                raise ValueError(f"boundary offset {o} outside a sequence of {n} tokens")
        if any_resumed and plan.init_flags[s] and not (native and s == plan.nonempty[0]):
            continue  # computed from zeros by the packed call, its result corrected or replaced
        for o in offsets[s]:
            c = (a + o - 1) // cs
            start = (c - 1) * cs + 1 if a < c * cs else (a if a > 0 else -1)
            if o < n and (start >= 1 or not pairs):
                packed[(s, o)] = len(packed)
                pairs += [start, a + o]
    return packed, pairs


def boundary_rows(plan: VarlenPlan, offsets, chunk_size: int) -> Optional[BoundaryRowsPlan]:
    """The ``BoundaryRowsPlan`` of these boundary offsets (per sequence, relative to its first token in the step),
    built and uploaded once per plan; None where the rows call does not serve: fewer than two sequences with
    offsets, an offset inside a chunk that is not its sequence's last (a step that began inside a block), or
    padding / length beyond ROWS_MAX_PADDING / ROWS_MAX_CHUNKS (as for resumed rows)."""
    if plan.boundary_cache is not None and plan.boundary_cache[0] is offsets:
        return plan.boundary_cache[1]
    seqs = [s for s, offs in enumerate(offsets) if offs]
    lasts = [max(offsets[s]) for s in seqs]
    result, host = None, {}
    aligned = all(o % chunk_size == 0 or o == n for s, n in zip(seqs, lasts) for o in offsets[s])
    shape = (_padded_rows_host(host, "", [plan.cu[s] for s in seqs], lasts, chunk_size)
             if len(seqs) >= 2 and aligned else None)
    if shape is not None:
        I, nchunks = shape[0], -(-shape[1] // chunk_size)
        pick = [I * nchunks + i if o == lasts[i] else i * nchunks + o // chunk_size
                for i, s in enumerate(seqs) for o in offsets[s]]
        host.update({"seq": torch.tensor(seqs, dtype=torch.long),
                     "fresh": torch.tensor([not plan.init_flags[s] for s in seqs], dtype=torch.long),
                     "pick": torch.tensor(pick, dtype=torch.long)})
        dev = _upload(host, plan.device)
        result = BoundaryRowsPlan(_padded_rows(*shape, dev, ""), nchunks=nchunks, seq=dev["seq"],
                                  fresh=dev["fresh"].bool(), pick=dev["pick"])
    plan.boundary_cache = (offsets, result)
    return result


def conv_boundary_rows(plan: VarlenPlan, offsets, K: int) -> ConvBoundaryRows:
    """The ``ConvBoundaryRows`` of these boundary offsets (per sequence, 0 < o <= its length), built on the host
    and uploaded once per plan: no host sync in the layers."""
    cache = plan.conv_boundary_cache
    if cache is not None and cache[0] is offsets and cache[1] == K:
        return cache[2]
    if len(offsets) != plan.S:
        raise ValueError(f"boundary_offsets has {len(offsets)} entries for {plan.S} sequences")
    x_rows, pick = [], []
    for s, offs in enumerate(offsets):
        a, n = plan.cu[s], plan.cu[s + 1] - plan.cu[s]
        for o in offs:
            if not 0 < o <= n:
                raise ValueError(f"boundary offset {o} outside a sequence of {n} tokens")
            for p in range(o - K, o):  # position relative to the sequence's first token in the step
                pick.append(len(x_rows) if p >= 0 else -(s * K + K + p) - 1)  # negative: an initial-state row
                x_rows.append(a + max(p, 0))
    host = {"x_rows": torch.tensor(x_rows, dtype=torch.long)}
    if any(i < 0 for i in pick):
        M = len(x_rows)
        host["pick"] = torch.tensor([i if i >= 0 else M - i - 1 for i in pick], dtype=torch.long)
    dev = _upload(host, plan.device)
    result = ConvBoundaryRows(x_rows=dev["x_rows"], pick=dev.get("pick"))
    plan.conv_boundary_cache = (offsets, K, result)
    return result


def conv_plan(plan: VarlenPlan, K: int, extended: bool = False) -> ConvPlan:
    """The plan's conv layout for state width K; ``extended=True`` also guarantees the extended-buffer rows
    (built and uploaded here, once per plan, if the step was expected to read x in place)."""
    if K not in plan.conv:
        raise ValueError(f"this VarlenPlan has no conv layout for width {K + 1} (built for widths "
                         f"{sorted(k + 1 for k in plan.conv)})")
    cp = plan.conv[K]
    if extended and cp.tok_row is None:
        _set_ext(cp, _upload(_conv_ext_host(plan.cu, plan.T, K), plan.device))
    return cp
