"""The metadata builder: decode/prefill split, slots, has-initial-state, for the batch orders runners make."""

from types import SimpleNamespace

import pytest
import torch

from vllm_mamba2_plugin.backend import Mamba2PluginBackend, Mamba2PluginMetadataBuilder, split_decodes_first


def _builder(chunk=8, max_num_seqs=8, max_capture=4, layers=None, spec=None, num_spec_tokens=0):
    """A builder for one group of layers: ``layers`` maps layer names to (conv pool, ssm pool)."""
    layers = layers or {"l0": (torch.zeros(0), torch.zeros(0))}
    hf_config = SimpleNamespace(chunk_size=chunk, conv_kernel=4)
    ctx = {name: SimpleNamespace(kv_cache=list(pools)) for name, pools in layers.items()}
    speculative = SimpleNamespace(num_speculative_tokens=num_spec_tokens) if num_spec_tokens else None
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config), speculative_config=speculative,
                                  scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
                                  compilation_config=SimpleNamespace(max_cudagraph_capture_size=max_capture,
                                                                     static_forward_context=ctx))
    return Mamba2PluginMetadataBuilder(spec, list(layers), vllm_config, torch.device("cpu"))


def _common_metadata(query_lens, context_lens, slots):
    """slots: each row's slot, or its block-table row (a list)."""
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()), dtype=torch.int32)
    seq = torch.tensor(query_lens) + torch.tensor(context_lens)
    table = torch.zeros(len(slots), 4, dtype=torch.int32)
    for r, s in enumerate(slots):
        table[r, : len(s) if isinstance(s, list) else 1] = torch.tensor(s)
    # The "device" tensors are separate copies, so that the test notices which ones the builder reads.
    return SimpleNamespace(num_reqs=len(slots), query_start_loc_cpu=qsl, seq_lens_cpu_upper_bound=seq.int(),
                           query_start_loc=qsl.clone(), seq_lens=seq.int().clone(),
                           block_table_tensor=table, num_actual_tokens=int(qsl[-1]))


def test_backend_identity():
    assert Mamba2PluginBackend.is_ssm()
    assert Mamba2PluginBackend.get_builder_cls() is Mamba2PluginMetadataBuilder
    assert Mamba2PluginMetadataBuilder.reorder_batch_threshold == 1


@pytest.mark.parametrize("qlens, ctx, want", [
    ([1, 1, 1], [5, 3, 9], 3),       # all decodes
    ([4, 1, 7], [0, 0, 0], 0),       # all fresh prompts
    ([1, 1, 6, 2], [5, 2, 0, 8], 2),  # decodes, then a fresh prompt and a resumed chunk
    ([1, 1, 1, 3], [4, 0, 6, 0], 1),  # a fresh 1-token prompt sorted among decodes ends the decode block
    ([], [], 0),
])
def test_decode_block_is_the_leading_run_of_one_token_rows_with_state(qlens, ctx, want):
    assert split_decodes_first(torch.tensor(qlens, dtype=torch.int64), torch.tensor(ctx, dtype=torch.int64)) == want


def test_build_mixed_batch():
    # rows: decode(slot 7), decode(slot 2), fresh 1-token prompt (slot 5), decode (slot 9, after the break:
    # handled by the prefill path with its state), resumed 4-token chunk (slot 3), fresh 6-token prompt (slot 4)
    meta = _builder().build(0, _common_metadata([1, 1, 1, 1, 4, 6], [3, 8, 0, 2, 12, 0], [7, 2, 5, 9, 3, 4]))
    assert (meta.num_decodes, meta.num_decode_tokens) == (2, 2)
    assert (meta.num_prefills, meta.num_prefill_tokens) == (4, 12)
    assert meta.state_indices_d.tolist() == [7, 2]
    batch = meta.prefill
    assert batch.slots.tolist() == [5, 9, 3, 4]
    assert batch.cu_seqlens.tolist() == batch.cu_seqlens_cpu.tolist() == [0, 1, 2, 6, 12]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.resumes.tolist() == batch.resumes_cpu.tolist() == [False, True, True, False]
    assert meta.num_actual_tokens == 14 and meta.chunk_size == 8 == batch.chunk_size
    assert meta.state_indices_d_i32.dtype == torch.int32 and meta.state_indices_d_i32.tolist() == [7, 2]
    assert batch.plan is None  # the reference kernels take no plan
    assert batch.any_resumes  # a resumed chunk and a decode-like row among the prefills
    assert batch.boundary_offsets is None and batch.boundary_slots is None  # no prefix caching


def test_speculative_rows_run_position_by_position_through_the_state_ring():
    # k = 2: a ring of 3 slots per request, the state after position p in column (-1 - p) mod 3. Rows: a verify
    # row of 3 tokens after 7 computed (positions 7, 8, 9: columns 1, 0, 2 from column 2), one of 1 token after 5
    # (column 0 from 1), a 2-token row with state after 3 (columns 2, 1 from 0), then a resumed 5-token chunk
    # after 4 (reads column 2, its last token 8 goes to column 0) and a fresh 4-token prompt (last token 3:
    # column 2).
    builder = _builder(num_spec_tokens=2)
    assert builder.reorder_batch_threshold == 3
    meta = builder.build(0, _common_metadata([3, 1, 2, 5, 4], [7, 5, 3, 4, 0],
                                             [[10, 11, 12], [20, 21, 22], [30, 31, 32], [40, 41, 42], [50, 51, 52]]))
    assert (meta.num_decodes, meta.num_decode_tokens, meta.num_prefills, meta.num_prefill_tokens) == (3, 6, 2, 9)
    assert meta.state_indices_d.numel() == 0
    got = [(p.tokens.tolist(), p.src.tolist(), p.dst.tolist()) for p in meta.verify]
    assert got == [([0, 3, 4], [12, 21, 30], [11, 20, 32]),  # position 0 of every row
                   ([1, 5], [11, 32], [10, 31]),
                   ([2], [10], [12])]
    assert all(p.dst_i32.dtype == torch.int32 and p.dst_i32.tolist() == p.dst.tolist() for p in meta.verify)
    assert meta.prefill.slots.tolist() == [40, 52]
    assert meta.prefill.initial_slots.tolist()[0] == 42  # the fresh prompt's is never read
    assert meta.prefill.resumes_cpu.tolist() == [True, False]


def test_all_fresh_prefills_say_so_on_the_host():
    meta = _builder().build(0, _common_metadata([1, 5, 3], [4, 0, 0], [7, 2, 5]))
    assert (meta.num_decodes, meta.num_prefills) == (1, 2)
    assert meta.prefill.resumes.tolist() == [False, False] and meta.prefill.any_resumes is False


def test_cuda_kernels_get_a_plan_from_the_host_bounds():
    """With the CUDA kernels the builder adds the step's prefill plan, made from the runner's host copies; it
    must describe the same batch as the device-side fields, and the layers' resume mask is the plan's upload of
    the same host flags (one source for which rows resume)."""
    from vllm_mamba2_plugin.kernels import cuda

    b = _builder(chunk=4)
    b.kernels = cuda
    common = _common_metadata([1, 1, 1, 1, 4, 6], [3, 8, 0, 2, 12, 0], [7, 2, 5, 9, 3, 4])
    common.query_start_loc = common.query_start_loc + 1000  # the plan must not come from the device copies
    common.seq_lens = common.seq_lens + 1000
    meta = b.build(0, common)
    plan = meta.prefill.plan
    assert plan.cu == [0, 1, 2, 6, 12] and plan.init_flags == [False, True, True, False]
    assert meta.prefill.resumes is plan.resume_mask and plan.resume_mask.tolist() == plan.init_flags
    assert meta.prefill.cu_seqlens.tolist() == [1000, 1001, 1002, 1006, 1012]  # the runner's, as they are
    assert plan.T == 12 and plan.nonempty == [0, 1, 2, 3]
    assert plan.seq_idx.tolist() == [0, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3]
    # Continuing sequences 1 (1 token) and 2 (4 tokens), after a fresh one: the padded rows of one more call, in
    # packed order (rows of 16 tokens; padding repeats a row's first token).
    assert plan.path is cuda.varlen_plan.ResumePath.ROWS and not plan.first_native and plan.packed_call
    (group,) = plan.groups
    assert group.seqs == [1, 2] and group.pos.tolist() == [1, 2] and (group.rows.I, group.rows.L) == (2, 16)
    assert group.rows.src.view(2, 16)[:, :5].tolist() == [[1, 1, 1, 1, 1], [2, 3, 4, 5, 2]]
    assert group.dst.tolist() == [1, 2, 3, 4, 5] and group.real.tolist() == [0, 16, 17, 18, 19]
    assert not plan.whole_step
    assert sorted(plan.conv) == [3]  # conv width 4


@pytest.mark.parametrize("switch", ["1", "0"])  # FULL decode graphs on (default: graph path) or off
def test_build_decode_only_batch_has_empty_prefill_fields(switch, monkeypatch):
    monkeypatch.setenv("VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS", switch)
    meta = _builder().build(0, _common_metadata([1, 1, 1], [3, 8, 5], [4, 6, 2]))
    assert (meta.num_decodes, meta.num_prefills, meta.num_prefill_tokens) == (3, 0, 0)
    assert meta.state_indices_d.tolist() == [4, 6, 2] and meta.prefill is None


@pytest.fixture
def full_graphs(monkeypatch):
    monkeypatch.setenv("VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS", "1")


def test_cudagraph_support_follows_the_switch(monkeypatch):
    from vllm.v1.attention.backend import AttentionCGSupport

    plain, speculative = SimpleNamespace(speculative_config=None), SimpleNamespace(speculative_config=object())
    monkeypatch.delenv("VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS", raising=False)  # the default: FULL decode graphs
    monkeypatch.delenv("VLLM_MAMBA2_PLUGIN_SPEC_FULL_GRAPHS", raising=False)  # the default: uniform batches too
    assert (Mamba2PluginMetadataBuilder.get_cudagraph_support(plain, None)
            == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE)
    assert Mamba2PluginMetadataBuilder.get_cudagraph_support(speculative, None) == AttentionCGSupport.UNIFORM_BATCH
    monkeypatch.setenv("VLLM_MAMBA2_PLUGIN_SPEC_FULL_GRAPHS", "0")
    assert Mamba2PluginMetadataBuilder.get_cudagraph_support(speculative, None) == AttentionCGSupport.NEVER
    monkeypatch.setenv("VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS", "0")
    assert Mamba2PluginMetadataBuilder.get_cudagraph_support(plain, None) == AttentionCGSupport.NEVER
    assert Mamba2PluginMetadataBuilder.get_cudagraph_support(speculative, None) == AttentionCGSupport.NEVER


def test_padded_decode_batch_uses_the_persistent_slot_buffer(full_graphs):
    builder = _builder()
    # 3 real decodes padded to a graph of 4 rows: the pad row has no tokens; its slot is PAD_SLOT (-1), skipped.
    meta = builder.build(0, _common_metadata([1, 1, 1, 0], [5, 2, 9, 0], [7, 3, 6, 0]))
    assert (meta.num_decodes, meta.num_decode_tokens, meta.num_prefills) == (4, 4, 0)
    assert meta.state_indices_d.tolist() == [7, 3, 6, -1] and meta.state_indices_d_i32.tolist() == [7, 3, 6, -1]
    first_ptr = meta.state_indices_d.data_ptr()
    meta = builder.build(0, _common_metadata([1, 1], [4, 4], [2, 5]))
    assert meta.state_indices_d.tolist() == [2, 5] and meta.state_indices_d.data_ptr() == first_ptr


def test_capture_metadata_counts_context_free_dummy_rows_as_decodes(full_graphs):
    meta = _builder().build_for_cudagraph_capture(_common_metadata([1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]))
    assert (meta.num_decodes, meta.num_prefills) == (4, 0)
    with pytest.raises(ValueError, match="exceeds the 4 persistent state slots"):
        _builder().build_for_cudagraph_capture(_common_metadata([1] * 5, [0] * 5, [0] * 5))


def test_batches_a_full_graph_cannot_replay_take_the_general_path(full_graphs):
    builder = _builder()
    mixed = builder.build(0, _common_metadata([1, 4], [3, 0], [2, 5]))  # a prefill row
    assert (mixed.num_decodes, mixed.num_prefills) == (1, 1)
    # a zero-token row that is not trailing padding
    gap = builder.build(0, _common_metadata([1, 0, 1], [3, 0, 2], [2, 0, 5]))
    assert gap.num_prefills == 2 and gap.state_indices_d.data_ptr() != builder.graph_slots.slots.data_ptr()
    big = builder.build(0, _common_metadata([1] * 6, [2] * 6, list(range(1, 7))))  # larger than any captured graph
    assert (big.num_decodes, big.num_prefills) == (6, 0)
    assert big.state_indices_d.data_ptr() != builder.graph_slots.slots.data_ptr()


def test_fresh_one_token_rows_of_a_decode_shaped_batch_start_from_a_zeroed_slot(full_graphs):
    """The runner replays a FULL decode graph for any batch of one-token rows, fresh prompts included (its
    dispatch looks at the shape only), and the graph runs the decode kernels on the persistent slot buffer. So
    such a batch must get the graph metadata, with the fresh rows' slots in the buffer and their states zeroed
    in every layer (a slot keeps its last owner's state). Before, a fresh row sent the batch down the general
    path, and the replay ran on the previous graph step's slots: those requests advanced twice, and the fresh
    prompt read a stale state."""
    pools = {name: (torch.ones(8, 3, 4), torch.ones(8, 2, 2, 2)) for name in ("l0", "l1")}
    builder = _builder(layers=pools)
    builder.build(0, _common_metadata([1, 1, 1], [4, 2, 7], [1, 2, 3]))  # an earlier graph step
    # rows 1, 2 fresh (slot 2 reused)
    meta = builder.build(0, _common_metadata([1, 1, 1, 0], [5, 0, 0, 0], [6, 2, 4, 0]))
    assert (meta.num_decodes, meta.num_prefills) == (4, 0)
    assert meta.state_indices_d.data_ptr() == builder.graph_slots.slots.data_ptr()
    assert meta.state_indices_d.tolist() == [6, 2, 4, -1]
    for conv, ssm in pools.values():
        for pool in (conv, ssm):
            zeroed = [s for s in range(8) if bool((pool[s] == 0).all())]
            assert zeroed == [2, 4] and bool((pool[6] == 1).all())


def test_capture_rows_leave_the_states_alone(full_graphs):
    pools = {"l0": (torch.ones(8, 3, 4), torch.ones(8, 2, 2, 2))}
    _builder(layers=pools).build_for_cudagraph_capture(_common_metadata([1, 1], [0, 0], [0, 0]))
    assert all(bool((p == 1).all()) for p in pools["l0"])


def test_prefix_caching_reads_the_last_block_and_lists_the_boundaries_a_prefill_crosses():
    """With prefix caching (blocks of 4 tokens here) a row's running state is in the block of its last token
    (the runner copied the previous state there), and each prefill row lists the boundaries before that block
    that its tokens cross: offset (b + 1) * 4 - context in this step's tokens, and block b's slot."""
    spec = SimpleNamespace(mamba_cache_mode="align", block_size=4)
    qlens, ctx = [1, 1, 9, 3, 5], [4, 6, 0, 8, 2]  # decode crossing into block 1; decode; fresh 9; resumed; mid
    common = _common_metadata(qlens, ctx, [0] * 5)
    common.block_table_tensor = torch.arange(100, 100 + 5 * 4, dtype=torch.int32).view(5, 4)  # row r: 100+4r+b
    meta = _builder(spec=spec).build(0, common)
    # last token's block: (seq_len - 1) // 4 with seq_lens 5, 7, 9, 11, 7
    assert meta.state_indices_d.tolist() == [101, 105]
    assert meta.prefill.slots.tolist() == [110, 114, 117]
    # fresh 9 tokens: boundaries 4, 8 (blocks 0, 1; its last block is 2); resumed at 8 with 3: none before
    # its last block (2); from 2 with 5 (to 7): the boundary at 4 (block 0), offset 2
    assert meta.prefill.boundary_offsets == [[4, 8], [], [2]]
    assert meta.prefill.boundary_slots.tolist() == [108, 109, 116]
    plain = _builder().build(0, _common_metadata(qlens, ctx, [7, 2, 5, 9, 3]))
    assert plain.prefill.boundary_offsets is None and plain.prefill.boundary_slots is None
    assert plain.prefill.slots.tolist() == [5, 9, 3]
    # a prefill inside its last block crosses no boundary
    no_crossing = _builder(spec=spec).build(0, _common_metadata([1, 3], [4, 8], [0, 0]))
    assert no_crossing.prefill.boundary_offsets is None and no_crossing.prefill.boundary_slots is None


RING3 = [[10, 11, 12], [20, 21, 22], [30, 31, 32], [0, 0, 0]]  # k = 2: three ring slots per request


@pytest.fixture
def spec_graphs(monkeypatch):
    monkeypatch.setenv("VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS", "1")
    monkeypatch.setenv("VLLM_MAMBA2_PLUGIN_SPEC_FULL_GRAPHS", "1")


def _positions(meta):
    return [(p.tokens.tolist(), p.src.tolist(), p.dst.tolist()) for p in meta.verify]


def _uniform(meta):
    plan = meta.uniform_verify
    return plan.src.tolist(), plan.dst.tolist()


def test_uniform_speculative_batch_runs_from_the_persistent_buffers(spec_graphs):
    """Rows of 1 + k tokens each, then a padding row: each row's source slot and its destination slot per token
    are the general plan's (verify_positions) in the graphs' buffers, the padding row on the null block (slot 0),
    every build in the same buffers."""
    builder = _builder(layers={"l0": (torch.ones(40, 3, 4), torch.ones(40, 2, 2, 2))}, num_spec_tokens=2)
    meta = builder.build(0, _common_metadata([3, 3, 3, 0], [7, 5, 0, 0], RING3))  # row 2: a fresh 3-token prompt
    assert (meta.num_decodes, meta.num_decode_tokens, meta.num_prefills) == (4, 12, 0)
    assert meta.verify is None
    plan = meta.uniform_verify
    assert plan.rows.tolist() == [0, 1, 2, 3] and plan.src_i32.tolist() == plan.src.tolist()
    # column (-1 - p) mod 3: row 0 (7 computed) reads column 2 and writes 1, 0, 2; row 1 (5) reads 1 and writes
    # 0, 2, 1; the fresh row 2 reads column 0 (zeroed) and writes 2, 1, 0.
    assert _uniform(meta) == ([12, 21, 30, 0], [[11, 20, 32, 0], [10, 22, 31, 0], [12, 21, 30, 0]])
    general = _builder(num_spec_tokens=2)
    general.full_decode_graphs = False
    want = _positions(general.build(0, _common_metadata([3, 3], [7, 5], RING3[:2])))
    assert [t for t, _, _ in want] == [[0, 3], [1, 4], [2, 5]]  # the tokens of row r: r * m .. r * m + m - 1
    assert want[0][1] == plan.src.tolist()[:2] and [d for _, _, d in want] == [d[:2] for d in plan.dst.tolist()]
    buffers = builder.graph_slots
    assert plan.dst.data_ptr() == buffers.verify_dst.data_ptr()
    again = builder.build(0, _common_metadata([3, 0], [4, 0], [RING3[2], RING3[3]]))
    assert _uniform(again) == ([32, 0], [[31, 0], [30, 0], [32, 0]])
    assert again.uniform_verify.src_i32.data_ptr() == buffers.verify_src_i32.data_ptr()


def test_a_fresh_row_of_a_uniform_speculative_batch_starts_from_a_zeroed_slot(spec_graphs):
    pools = {"l0": (torch.ones(40, 3, 4), torch.ones(40, 2, 2, 2))}
    builder = _builder(layers=pools, num_spec_tokens=2)
    builder.build(0, _common_metadata([3, 3], [7, 0], RING3[:2]))
    for pool in pools["l0"]:
        assert [s for s in range(40) if bool((pool[s] == 0).all())] == [20]  # the fresh row's source column


def test_speculative_batches_a_uniform_graph_cannot_replay_take_the_general_path(spec_graphs):
    builder = _builder(num_spec_tokens=2)
    buffers = builder.graph_slots.verify_dst
    for qlens, ctx in (([3, 2], [7, 5]), ([3, 5], [7, 0]), ([3, 0, 3], [7, 0, 5]), ([3] * 5, [4] * 5)):
        meta = builder.build(0, _common_metadata(qlens, ctx, (RING3 * 2)[:len(qlens)]))  # 5 rows: above max_batch
        assert meta.uniform_verify is None
        assert not any(buffers[0, 0].data_ptr() <= p.dst.data_ptr() <= buffers[-1, -1].data_ptr()
                       for p in meta.verify)


def test_without_the_switch_uniform_speculative_batches_are_planned_per_step(full_graphs, monkeypatch):
    monkeypatch.setenv("VLLM_MAMBA2_PLUGIN_SPEC_FULL_GRAPHS", "0")
    builder = _builder(num_spec_tokens=2)
    assert builder.graph_slots is None
    meta = builder.build(0, _common_metadata([3, 3], [7, 5], RING3[:2]))
    assert [p.src.tolist() for p in meta.verify] == [[12, 21], [11, 20], [10, 22]]


def test_speculative_capture_rows_leave_the_states_alone(spec_graphs):
    pools = {"l0": (torch.ones(8, 3, 4), torch.ones(8, 2, 2, 2))}
    meta = _builder(layers=pools, num_spec_tokens=2).build_for_cudagraph_capture(
        _common_metadata([3, 3], [0, 0], [[0, 0, 0], [0, 0, 0]]))
    assert (meta.num_decodes, meta.num_decode_tokens, meta.num_prefills) == (2, 6, 0)
    assert all(bool((p == 1).all()) for p in pools["l0"])
