"""Compile and autotune every kernel launch a step can need, in vLLM's profile run (CUDA path only).

``warm_up(layer, projected, decode_graphs)`` runs from the mixer's profile / dummy run (no requests, no state),
once per process and layer signature, on scratch pools, through the layer's real prefill and decode paths
(``Mamba2Mixer.run_prefill_block`` / ``run_decode_rows``), so that:

* mamba-ssm's SSD kernels are autotuned before the state pools take the memory the autotuner's trial runs need,
  and on layouts as large as a real step (``prefill_layouts``): without this the first prefill of a process
  pays for it, seconds inside a served step (benchmarks/RESULTS.md);
* every Triton specialisation a step can hit is compiled before serving, and before vLLM captures FULL decode
  graphs: a JIT compile must not happen inside a capture (``decode_step.ssu_warm_batches``).
As vLLM's in-tree Mamba2 does with its ``_warmup_ssd_kernels``.
"""

from __future__ import annotations

import torch

from .decode_step import ssu_warm_batches

# Layer signatures already warmed in this process. Keyed by what the Triton kernels specialise on, not one flag
# per process: two engines of different shapes or state dtypes in one process (tests, notebooks) each need
# their own compiles before their captures.
_WARMED_PREFILL: set = set()
_WARMED_DECODE: set = set()


def warm_up(layer, projected: torch.Tensor, decode_graphs: bool) -> None:
    """The prefill kernels, and with ``decode_graphs`` (FULL decode graphs will be captured) the decode ones.
    projected: the profile run's projection (max tokens, projection width)."""
    warm_prefill(layer, projected)
    if decode_graphs:
        warm_decode(layer, projected)


def _signature(layer, projected: torch.Tensor) -> tuple:
    return (str(projected.device), projected.dtype, projected.shape[-1], *layer.get_state_dtype(),
            layer.num_heads, layer.head_dim, layer.n_groups, layer.state_size, layer.conv_kernel,
            layer.conv1d.bias is not None)


def warm_prefill(layer, projected: torch.Tensor) -> None:
    """Every layout of ``prefill_layouts`` (and with prefix caching of ``boundary_layouts``) through the layer's
    prefill path, once per layer signature."""
    sig = (*_signature(layer, projected), layer.chunk_size, layer.dt_limit, layer.prefix_caching)
    if sig in _WARMED_PREFILL:
        return
    tokens = projected.shape[0]
    layouts = [(lengths, resumed, None) for lengths, resumed in prefill_layouts(layer.chunk_size, tokens)]
    if layer.prefix_caching:
        layouts += boundary_layouts(layer.chunk_size, tokens)
    slots = 1 + max(len(lengths) + sum(map(len, offsets or [])) for lengths, _, offsets in layouts)
    conv_pool, ssm_pool = layer.scratch_pools(slots, projected.device)
    for lengths, resumed, offsets in layouts:
        layer.run_prefill_block(projected.new_zeros(sum(lengths), projected.shape[-1]), lengths, resumed,
                                conv_pool, ssm_pool, boundary_offsets=offsets)
    _sync(projected.device)
    _WARMED_PREFILL.add(sig)


def warm_decode(layer, projected: torch.Tensor) -> None:
    """The decode step at every batch size of ``ssu_warm_batches`` (Triton's integer specialisations, == 1,
    other, multiple of 16, under every state-update launch the table can pick for this layer), on scratch state
    laid out like the real inputs (slices of a projection); rows share 16 scratch slots (what they compute is
    thrown away). Once per layer signature."""
    sig = (*_signature(layer, projected), layer.dt_limit_is_noop)
    if sig in _WARMED_DECODE:
        return
    num_slots = 17  # slot 0 stays untouched, rows cycle through 1..16
    conv_pool, ssm_pool = layer.scratch_pools(num_slots, projected.device)
    for bs in ssu_warm_batches(layer.num_heads, layer.head_dim, layer.state_size, ssm_pool.dtype):
        slots = torch.arange(bs, device=projected.device) % (num_slots - 1) + 1
        layer.run_decode_rows(projected.new_zeros(bs, projected.shape[-1]), slots, conv_pool, ssm_pool)
    _sync(projected.device)
    _WARMED_DECODE.add(sig)


def prefill_layouts(chunk_size: int, tokens: int = 0) -> list:
    """(sequence lengths, resumes-a-state flags) of the packed batches ``warm_prefill`` runs.

    First, when ``tokens`` (the profile run's token budget, i.e. the largest step) exceeds two chunks: three
    layouts filling it, one per call signature of the SSD kernels. mamba-ssm's SSD kernels are autotuned once per
    key of head, state and chunk sizes -- not length -- and tensor dtypes (an argument given or None counts), on
    the arguments of that signature's first call, and that choice then serves every step; tuned on two chunks,
    ``_chunk_state_fwd`` takes a tile that is slower on the 32-chunk steps where the GPU time is
    (benchmarks/ssd_autotune.py). So: two fresh prompts (the packed call), a resumed first sequence ending inside
    chunk 0 (state passing with an initial state; the varlen final-state kernel) and a resumed second sequence
    (its row group of one: the kernels without seq_idx). Their intermediates are allocated inside the profile run that
    sizes the state pools, as a real step of that size allocates them.

    Then every compile a step can need. Triton compiles a kernel per specialisation of its integer arguments
    (== 1, a multiple of 16, other) and pointer alignments. In the SSD kernels the integers that change from
    step to step are the packed length T, the chunk count and strides that are multiples of T, so the
    specialisation of a step is fixed by (chunk count: 1 / 16k / other) x (T mod 16: 0 / 8 / 4 / 2 / 1 decide
    which multiples of T are divisible by 16) x (path: one fresh prompt, fresh prompts with a boundary inside a
    chunk, a resumed first sequence ending inside chunk 0 or on a chunk boundary). The chunk count reaches 16
    only in steps of more than 15 chunks, and 2 only in calls longer than a chunk (a packed call holds at most
    ``tokens``, a rows call at most ``tokens`` rounded up to 16), so those classes are warmed only when the budget
    allows such calls: an unreachable class costs compile time (seconds per layout in float32) for nothing.

    Last, the other paths of the wrappers: a sequence shorter than W-1 (conv through the extended buffer), a
    resumed sequence after a fresh one (a row group of one, called on its own tokens: lengths in Triton's classes
    other, 16k and 1; a resumed first sequence would take the packed call's own state), and more resumed ones as
    the padded rows of one call (``varlen_plan.RowGroup``: batch rows I in Triton's classes "other" and 16k, row
    length L a multiple of 16 of one or of 2-15 chunks, where a step within the budget can have them: I * L <= 2 *
    tokens, half of the rows padding), after a fresh one and as a whole step of resumed ones."""
    cs = chunk_size
    multi_chunk = cs < -(-tokens // 16) * 16  # can a call be longer than one chunk
    lead = cs if multi_chunk else 5  # a fresh first sequence: a chunk long where calls may span chunks
    singles = [37, 48, 1] if multi_chunk else [5, 16, 1]  # lengths in Triton's classes
    rows = []
    for L in (16, cs + 16):
        for n in (4, 16):
            lengths = [L] * (n // 2) + [1] * (n - n // 2)
            if sum(lengths) <= tokens:
                rows.append((lengths, [True] * n))
    layouts = [
        ([tokens // 2, tokens - tokens // 2], [False, False]),  # the packed call (seq_idx, no initial state)
        ([17, tokens - 17], [True, False]),  # + state passing with an initial state, the varlen final states
        ([1, tokens - 1], [False, True]),  # a group of one: the kernels without seq_idx, with an initial state
    ] if tokens > 2 * cs else []
    for chunks in [1] + ([2] if multi_chunk else []) + ([16] if tokens >= 15 * cs + 32 else []):
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
        ([lead + 5, 2], [False, False]),
        *[([lead, n], [False, True]) for n in singles],  # after a fresh first sequence: a group of one
        ([lead, 5, 9], [False, True, True]),  # two short ones: the padded rows of one call, after a packed call
    ] + rows


def boundary_layouts(chunk_size: int, tokens: int) -> list:
    """(sequence lengths, resumes-a-state flags, boundary offsets) of the prefix-caching steps ``warm_prefill`` also
    runs when the engine caches prefixes, within the step budget ``tokens``: the calls that give the states at
    block boundaries (``ssd_prefill._boundary_states``). A prompt's chunk starts on a block boundary while the
    block fits the budget, and may start inside one when it does not (patches.py, 4). The packed
    call serves both alike; a second pass up to an offset inside a chunk (of a resumed sequence in a row group)
    compiles at its first use.

    * Fresh prompts (and a continued prompt opening the step) take their boundary states from the packed call
      and one launch of ``chunk_state_varlen`` over its results (``varlen_plan._packed_pairs``): the packed call's
      length T in Triton's classes (chunk count other or 16k) x (T mod 16: 0 / 8 / 4 / 2 / 1), with the varlen
      final states, from zeros and with a first initial state.
    * Resumed sequences in row groups give theirs from their group's call: one resumed sequence after a fresh one
      (a group of one, chunk counts 1, 2 and 16) and 2 or 16 of them (padded rows, chunk counts 1 and 2:
      ``varlen_plan`` keeps rows calls below 16 chunks)."""
    cs, layouts = chunk_size, []
    for chunks in (4, 16):
        for residue in (0, 8, 4, 2, 1):
            T = (chunks - 1) * cs + 16 + residue  # the second prompt's boundary falls 5 tokens into chunk 2
            if T <= tokens:
                layouts += [([cs + 5, T - cs - 5], [first, False], [[cs], [cs]]) for first in (False, True)]
    for n, chunk_counts in ((1, (1, 2, 16)), (2, (1, 2)), (16, (1, 2))):
        for chunks in chunk_counts:
            lengths = [1] + [chunks * cs + 16] * n  # a fresh first sequence: the packed call starts none
            if sum(lengths) <= tokens:
                offsets = [[]] + [[cs * k for k in range(1, chunks + 1)]] * n
                layouts.append((lengths, [False] + [True] * n, offsets))
    return layouts


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":  # (the tests run the warm-up on the CPU, with stand-ins for the kernels)
        torch.cuda.synchronize(dev)
