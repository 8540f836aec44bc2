"""Index plans for the CUDA prefill wrappers: built once per engine step, on the host, shipped in one copy.

Every mixer layer of a step runs ``conv.causal_conv1d`` and ``ssd_prefill.ssd_chunk_scan`` on the same packed batch, so
the index tensors they need (sequence ids, conv row layout, the row groups of resumed sequences) are the same for
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

import enum
import functools
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
import torch

from ..interface import PrefillBatch

# The in-place conv layout recomputes the first K outputs of at most this many resumed sequences from their
# states (one small launch each); more take the extended buffer (``conv.causal_conv1d``).
CONV_RECOMPUTE_MAX = 3
# Resumed sequences that the packed call cannot start from their own state go as the batch rows of more SSD
# calls (``RowGroup``), each row padded at its end to the group's longest, rounded up to 16 (one Triton
# specialisation of the length). A group takes sequences, longest first, while its I * L tokens stay within
# ROWS_MAX_PADDING times its sequences' tokens, each counted as at least 16, and L within ROWS_MAX_CHUNKS chunks
# (so a rows call never has a multiple of 16 chunks: the start-up warm-up compiles the classes it can have); a
# sequence that fits no group is a group of its own, called on its own tokens without padding.
ROWS_MAX_PADDING = 2.0
ROWS_MAX_CHUNKS = 15


class ResumePath(enum.Enum):
    """How ``ssd_prefill`` starts the step's resumed sequences from their states (decided once per plan)."""

    NONE = "none"  # no non-empty sequence resumes a state (or no states are given)
    NATIVE = "native"  # only the first one does: the packed call's own initial state
    ROWS = "rows"  # others too: they go as row groups (the first, if it resumes, still takes the packed call's)


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
class RowGroup:
    """Resumed sequences computed by one more SSD call, each as a batch row from its own state.

    seqs: their sequences, in packed order (rows of initial_states), host; seq_rows: the same, (I,) long;
    pos: (I,) long their index among the S' non-empty sequences (rows of the final states);
    rows: ``PaddedRows`` of the call, with real: (Tr,) long the row positions of the sequences' tokens and dst:
    (Tr,) long those tokens relative to cu[0]; rows None: one sequence, called on its own tokens;
    nchunks: chunks per row of the call (its passed states are (I, nchunks, ...))."""

    seqs: List[int]
    seq_rows: torch.Tensor
    pos: torch.Tensor
    nchunks: int
    rows: Optional[PaddedRows] = None
    real: Optional[torch.Tensor] = None
    dst: Optional[torch.Tensor] = None


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
    the host and uploaded with the plan. Four sources, concatenated in this order, then put in the order of the
    offsets (``order``):

    1. packed: the inner offsets (before the sequence's end) of the sequences the packed call computes from their
       true initial state (fresh ones; the first one when it takes the kernel's own initial state): ONE launch of
       mamba-ssm's ``chunk_state_varlen`` over the packed call's own tensors, asked for the states at ``pairs``
       (``_packed_pairs``), in offset order;
    2. groups: {group: (Mg,) long}: states entering chunks of a row group's call (``RowGroup``; a row starts at its
       sequence's start), as rows of its states flattened to (I * nchunks, ...), for inner offsets that are chunk
       multiples, in group order;
    3. final: (Mf,) long: sequences whose offset is their end: the final state, whatever call computed it;
    4. rest: the other offsets (inside a chunk of a resumed sequence: a step that began inside a block), per
       sequence, for a second pass over those sequences (``boundary_rows`` or one forward each); None if none.

    pairs: (2 Mp,) int32 (start, end) per state of source 1, relative to the packed call's first token, as
    ``chunk_state_varlen`` reads its cu_seqlens; None when source 1 is empty.
    order: (M,) long: each offset's row in the concatenation of 1-4; None: already in order."""

    pairs: Optional[torch.Tensor]
    groups: Dict[int, torch.Tensor]
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
    chunk_size: int  # the SSD chunk the row groups and boundary plans are laid out for
    # device
    cu_k: torch.Tensor  # (S'+1,) int32 bounds of the non-empty sequences, relative to cu[0]
    seq_idx: torch.Tensor  # (Tu,) int32 id (0..S'-1) of each token's sequence
    seq_idx_row: torch.Tensor  # (1, Tu) view of seq_idx: the kernels' one batch row, made once per step
    nonempty_dev: torch.Tensor  # (S',) long
    resume_mask: torch.Tensor  # (S,) bool: init_flags on the device (the layers' has_initial_state)
    # (S'-1,) long: when every non-empty sequence but the last ends on an SSD chunk boundary (relative to cu[0]),
    # the chunk whose entering state is each one's final state; None otherwise (see ssd_prefill.ssd_chunk_scan)
    final_chunks: Optional[torch.Tensor] = None
    path: ResumePath = ResumePath.NONE
    # host: the packed call starts its first sequence from that sequence's state (NATIVE, or ROWS with a resumed
    # first sequence among fresh ones)
    first_native: bool = False
    # the resumed sequences the packed call cannot start from their state (ROWS), in groups of one call each;
    # when they are every non-empty sequence (a step of cache hits) there is no packed call
    groups: List[RowGroup] = field(default_factory=list)
    packed_call: bool = True
    conv: Dict[int, ConvPlan] = field(default_factory=dict)  # by K; read through ``conv_plan``
    device: torch.device = torch.device("cpu")  # where the plan's tensors live (on-demand conv layouts too)
    # prefix caching (``add_boundaries``): the step's boundary offsets per sequence and their plans
    boundary_offsets: Optional[List[List[int]]] = None
    boundary: Optional[BoundaryPlan] = None
    boundary_rows: Optional[BoundaryRowsPlan] = None
    conv_boundary: Dict[int, ConvBoundaryRows] = field(default_factory=dict)  # by K

    @property
    def S(self) -> int:
        return len(self.cu) - 1

    @functools.cached_property
    def resumed(self) -> List[int]:
        """The non-empty sequences that start from a saved state."""
        return [s for s in self.nonempty if self.init_flags[s]]

    @property
    def all_resume(self) -> bool:
        """Every sequence is non-empty and resumes (a step of cache hits): the rows of initial_states need no
        mask."""
        return self.S > 0 and len(self.resumed) == self.S

    @property
    def whole_step(self) -> bool:
        """No packed call, and one call of padded rows holds every non-empty sequence in packed order: its outputs
        and final states are the scan's as they come."""
        return (not self.packed_call and len(self.groups) == 1 and self.groups[0].rows is not None
                and len(self.groups[0].seqs) == len(self.nonempty))

    def conv_recomputes_resumed(self) -> bool:
        """The conv's choice: up to ``CONV_RECOMPUTE_MAX`` resumed sequences keep the in-place layout (each one's
        first outputs recomputed from its state); more take the extended buffer (``conv.causal_conv1d``)."""
        return len(self.resumed) <= CONV_RECOMPUTE_MAX


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
    num_tokens: T, the tokens of x; chunk_size: the SSD chunk;
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
    path, first_native, others = _resume_path(init_pos, len(ne))
    groups = _row_groups_host(host, cu, ne, others, chunk_size)
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
        cu=cu, init_flags=flags, T=num_tokens, nonempty=ne, chunk_size=int(chunk_size),
        cu_k=dev["cu_k"].to(torch.int32), seq_idx=seq_idx, seq_idx_row=seq_idx.unsqueeze(0),
        nonempty_dev=dev["nonempty"], resume_mask=dev["resume_mask"].bool(), final_chunks=dev.get("final_chunks"),
        path=path, first_native=first_native, packed_call=len(others) < len(ne), device=device,
        groups=[_row_group(group, dev, f"g{i}_", chunk_size) for i, group in enumerate(groups)],
    )
    for W in conv_widths:
        K = W - 1
        cp = ConvPlan(K=K, E=num_tokens + S * K, in_place=in_place[K], last_row=dev[f"c{K}_last_row"])
        if f"c{K}_tok_row" in dev:
            _set_ext(cp, {k: dev[f"c{K}_{k}"] for k in ("tok_row", "state_row", "seq_idx", "final_row")})
        plan.conv[K] = cp
    return plan


def plan_of(batch: PrefillBatch, have_initial_states: bool, num_tokens: int, conv_widths: tuple,
            device: torch.device) -> VarlenPlan:
    """The batch's plan, or, for a batch without one (a direct kernel call), one built from its host bounds and
    flags; checked against the tokens of x."""
    plan = batch.plan
    if plan is None:
        return build_plan(batch.cu_seqlens_cpu, batch.resumes_cpu, have_initial_states, num_tokens,
                          batch.chunk_size, conv_widths, device)
    if plan.T != num_tokens:
        raise ValueError(f"the batch was planned for {plan.T} tokens, x has {num_tokens}")
    return plan


def _resume_path(init_pos: List[int], nonempty: int) -> tuple:
    """(``ResumePath``, first_native, others) from the positions (among the non-empty sequences) of the resumed
    ones. The packed call starts its first sequence from that sequence's state; every other resumed sequence is
    one of ``others``, for the row groups. When every non-empty sequence resumes (a step of cache hits) they are
    all ``others``, and no packed call runs."""
    if not init_pos:
        return ResumePath.NONE, False, []
    if init_pos == [0]:
        return ResumePath.NATIVE, True, []
    if len(init_pos) == nonempty:
        return ResumePath.ROWS, False, init_pos
    first = init_pos[0] == 0
    return ResumePath.ROWS, first, init_pos[1:] if first else init_pos


def _rows_fit(I: int, L: int, tokens: int, chunk_size: int) -> bool:
    """Padded rows of I x L within ROWS_MAX_PADDING times their sequences' tokens and ROWS_MAX_CHUNKS chunks."""
    return I * L <= ROWS_MAX_PADDING * tokens and L <= ROWS_MAX_CHUNKS * chunk_size


def _round16(n: int) -> int:
    return -(-n // 16) * 16


def _row_groups_host(host: Dict[str, torch.Tensor], cu: List[int], ne: List[int], others: List[int],
                     chunk_size: int) -> List[tuple]:
    """The ``RowGroup``s of ``others`` (positions among the non-empty sequences): longest first, a group takes the
    next one while its padded rows fit (``_rows_fit``, every sequence counted as at least 16 tokens: a row is
    never shorter), its rows then in packed order; a group of one is called on its own tokens. Adds each group's
    host tensors to host as "g<i>_*"; returns [(its sequences, (I, L) of its padded rows or None, its longest
    sequence's tokens)]."""
    length = {i: cu[ne[i] + 1] - cu[ne[i]] for i in others}
    members: List[List[int]] = []
    for i in sorted(others, key=lambda i: -length[i]):
        if members:
            group = members[-1] + [i]
            tokens = sum(max(length[j], 16) for j in group)
            if _rows_fit(len(group), _round16(length[group[0]]), tokens, chunk_size):
                members[-1] = group
                continue
        members.append([i])
    groups = []
    for g, pos in enumerate(members):
        pos = sorted(pos)  # rows in packed order: a group of the whole step then needs no scatter (``whole_step``)
        prefix = f"g{g}_"
        host[prefix + "seqs"] = torch.tensor([ne[i] for i in pos], dtype=torch.long)
        host[prefix + "pos"] = torch.tensor(pos, dtype=torch.long)
        shape = None
        if len(pos) > 1:
            shape = _padded_rows_host(host, prefix, [cu[ne[i]] for i in pos], [length[i] for i in pos])
            src = host[prefix + "src"].numpy()
            real = np.flatnonzero(host[prefix + "pad"].numpy() == 0)
            host.update({prefix + "real": torch.from_numpy(real), prefix + "dst": torch.from_numpy(src[real] - cu[0])})
        groups.append(([ne[i] for i in pos], shape, max(length[i] for i in pos)))
    return groups


def _row_group(group: tuple, dev: Dict[str, torch.Tensor], prefix: str, chunk_size: int) -> RowGroup:
    seqs, shape, longest = group
    result = RowGroup(seqs=seqs, seq_rows=dev[prefix + "seqs"], pos=dev[prefix + "pos"],
                      nchunks=-(-(shape[1] if shape else longest) // chunk_size))
    if shape is not None:
        result.rows = _padded_rows(*shape, dev, prefix)
        result.real, result.dst = dev[prefix + "real"], dev[prefix + "dst"]
    return result


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


def _padded_rows_host(host: Dict[str, torch.Tensor], prefix: str, starts: List[int], lens: List[int]) -> tuple:
    """The host arrays of ``PaddedRows`` for sequences at these starts and lengths, added to host as
    prefix + "src" / "pad"; returns (I, L)."""
    start, n = np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64)
    I, L = len(starts), _round16(int(n.max()))
    j = np.arange(L, dtype=np.int64)[None, :]
    pad = j >= n[:, None]  # (I, L)
    src = np.where(pad, start[:, None], start[:, None] + j)
    host.update({prefix + "src": torch.from_numpy(src.reshape(-1)),
                 prefix + "pad": torch.from_numpy(pad.reshape(-1).astype(np.int64))})
    return I, L


def _padded_rows(I: int, L: int, dev: Dict[str, torch.Tensor], prefix: str) -> PaddedRows:
    return PaddedRows(I=I, L=L, src=dev[prefix + "src"], pad=dev[prefix + "pad"].bool())


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


def add_boundaries(plan: VarlenPlan, offsets: List[List[int]]) -> None:
    """Prefix caching's boundary offsets of the step (per sequence, 0 < o <= its length in the step) and their
    plans, set on ``plan`` with one upload: where each state comes from (``BoundaryPlan``), the rows of a second
    pass where one is needed (``BoundaryRowsPlan``) and the conv's gathers for every conv width of the plan
    (``ConvBoundaryRows``). Once per step, by the metadata builder; a plan built without the step's offsets gets
    them from its first caller, and every later call with the same offsets list finds them set."""
    if plan.boundary_offsets is offsets:
        return
    if len(offsets) != plan.S:
        raise ValueError(f"boundary_offsets has {len(offsets)} entries for {plan.S} sequences")
    for s, offs in enumerate(offsets):
        n = plan.cu[s + 1] - plan.cu[s]
        for o in offs:
            if not 0 < o <= n:
                raise ValueError(f"boundary offset {o} outside a sequence of {n} tokens")
    host: Dict[str, torch.Tensor] = {}
    chunk_size = plan.chunk_size
    finish = _boundary_plan_host(plan, offsets, chunk_size, host)
    rows_shape = None
    rest = finish["rest"]
    if rest is not None:
        rows_shape = _boundary_rows_host(plan, rest, chunk_size, host)
    for K in plan.conv:
        _conv_boundary_host(plan, offsets, K, host)
    dev = _upload(host, plan.device)
    plan.boundary_offsets = offsets
    plan.boundary = BoundaryPlan(pairs=dev["b_pairs"].to(torch.int32) if "b_pairs" in dev else None,
                                 groups={g: dev[f"b_group{g}"] for g in finish["groups"]}, final=dev["b_final"],
                                 rest=rest, order=dev.get("b_order"))
    if rows_shape is not None:
        I, L, nchunks = rows_shape
        plan.boundary_rows = BoundaryRowsPlan(_padded_rows(I, L, dev, "br_"), nchunks=nchunks, seq=dev["br_seq"],
                                              fresh=dev["br_fresh"].bool(), pick=dev["br_pick"])
    plan.conv_boundary = {K: ConvBoundaryRows(x_rows=dev[f"cb{K}_x_rows"], pick=dev.get(f"cb{K}_pick"))
                          for K in plan.conv}


def _boundary_plan_host(plan: VarlenPlan, offsets, cs: int, host: Dict[str, torch.Tensor]) -> dict:
    """The host tensors of the ``BoundaryPlan`` (added to host as "b_*"); returns its host parts: the groups with
    picks and the rest (per sequence, None if none)."""
    group_of = {s: (g, row) for g, group in enumerate(plan.groups) for row, s in enumerate(group.seqs)}
    packed, pairs = _packed_pairs(plan, offsets, cs, set(group_of))
    picks: Dict[object, list] = {}  # source -> what to take from it; a group's source is ("group", g)
    where = []  # per offset: (source, position among the source's picks)
    for s, offs in enumerate(offsets):
        for o in offs:
            source, pick = _source_of(plan, s, o, cs, packed, group_of)
            where.append((source, len(picks.setdefault(source, []))))
            picks[source].append(pick)
    assert picks.get("packed", []) == list(range(len(packed)))  # chunk_state_varlen's rows come in offset order
    groups = sorted(k for k in picks if isinstance(k, tuple))
    keys = [k for k in ("packed", *groups, "final", "rest") if k in picks]
    base = dict(zip(keys, np.cumsum([0] + [len(picks[k]) for k in keys]).tolist()))
    order = [base[k] + i for k, i in where]  # the rest come back from a second pass in sequence order, as picked
    host["b_final"] = torch.tensor(picks.get("final", []), dtype=torch.long)
    host.update({f"b_group{k[1]}": torch.tensor(picks[k], dtype=torch.long) for k in groups})
    if pairs:
        host["b_pairs"] = torch.tensor(pairs, dtype=torch.long)
    if order != sorted(order):
        host["b_order"] = torch.tensor(order, dtype=torch.long)
    rest = [[o for s2, o in picks.get("rest", []) if s2 == s] for s in range(plan.S)]
    return {"groups": [k[1] for k in groups], "rest": rest if any(rest) else None}


def _source_of(plan: VarlenPlan, s: int, o: int, cs: int, packed: dict, group_of: dict) -> tuple:
    """(source, what to take from it) for the state after o tokens of sequence s: its final state; the packed
    call's (``_packed_pairs``); the call of the row group that computes s from its own start, at a chunk multiple
    (a row of its states flattened to (rows * chunks)); else the second pass's."""
    if o == plan.cu[s + 1] - plan.cu[s]:
        return "final", s
    if (s, o) in packed:
        return "packed", packed[(s, o)]
    if s in group_of and o % cs == 0:
        g, row = group_of[s]
        return ("group", g), row * plan.groups[g].nchunks + o // cs
    return "rest", (s, o)


def _packed_pairs(plan: VarlenPlan, offsets, cs: int, in_groups: set) -> tuple:
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
        n, a = cu[s + 1] - cu[s], cu[s] - cu[0]  # offsets within 0 < o <= n: checked by add_boundaries
        if s in in_groups:
            continue  # computed from zeros by the packed call, its result replaced by its row group's
        for o in offsets[s]:
            c = (a + o - 1) // cs
            start = (c - 1) * cs + 1 if a < c * cs else (a if a > 0 else -1)
            if o < n and (start >= 1 or not pairs):
                packed[(s, o)] = len(packed)
                pairs += [start, a + o]
    return packed, pairs


def _boundary_rows_host(plan: VarlenPlan, offsets, chunk_size: int, host: Dict[str, torch.Tensor]):
    """The host tensors of the second pass's ``BoundaryRowsPlan`` for these offsets (per sequence, relative to its
    first token in the step), added to host as "br_*"; returns (I, L, nchunks), or None where the rows call does
    not serve: fewer than two sequences with offsets, an offset inside a chunk that is not its sequence's last (a
    step that began inside a block), or padding / length beyond ``_rows_fit``."""
    seqs = [s for s, offs in enumerate(offsets) if offs]
    lasts = [max(offsets[s]) for s in seqs]
    aligned = all(o % chunk_size == 0 or o == n for s, n in zip(seqs, lasts) for o in offsets[s])
    if len(seqs) < 2 or not aligned or not _rows_fit(len(seqs), _round16(max(lasts)), sum(lasts), chunk_size):
        return None
    I, L = _padded_rows_host(host, "br_", [plan.cu[s] for s in seqs], lasts)
    nchunks = -(-L // chunk_size)
    pick = [I * nchunks + i if o == lasts[i] else i * nchunks + o // chunk_size
            for i, s in enumerate(seqs) for o in offsets[s]]
    host.update({"br_seq": torch.tensor(seqs, dtype=torch.long),
                 "br_fresh": torch.tensor([not plan.init_flags[s] for s in seqs], dtype=torch.long),
                 "br_pick": torch.tensor(pick, dtype=torch.long)})
    return I, L, nchunks


def _conv_boundary_host(plan: VarlenPlan, offsets, K: int, host: Dict[str, torch.Tensor]) -> None:
    """The host tensors of the ``ConvBoundaryRows`` of width K + 1, added to host as "cb<K>_*"."""
    x_rows, pick = [], []
    for s, offs in enumerate(offsets):
        a = plan.cu[s]
        for o in offs:
            for p in range(o - K, o):  # position relative to the sequence's first token in the step
                pick.append(len(x_rows) if p >= 0 else -(s * K + K + p) - 1)  # negative: an initial-state row
                x_rows.append(a + max(p, 0))
    host[f"cb{K}_x_rows"] = torch.tensor(x_rows, dtype=torch.long)
    if any(i < 0 for i in pick):
        M = len(x_rows)
        host[f"cb{K}_pick"] = torch.tensor([i if i >= 0 else M - i - 1 for i in pick], dtype=torch.long)


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
