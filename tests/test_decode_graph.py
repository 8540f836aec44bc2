"""decode_graph.DecodeGraphSlots: the persistent slot buffers of FULL decode graphs and the reset of fresh slots."""

import pytest
import torch

from vllm_mamba2_plugin.decode_graph import NULL_SLOT, PAD_SLOT, DecodeGraphSlots


def _slots(max_batch=4, pools=()):
    return DecodeGraphSlots(max_batch, torch.device("cpu"), lambda: iter(pools))


def test_every_write_lands_in_the_same_buffers_with_padding_rows_on_pad_slot():
    """A captured graph keeps its inputs' addresses: each batch's slots go into a prefix of the same buffers,
    the int32 copy included, and the padding rows hold PAD_SLOT, never a real slot."""
    g = _slots()
    first = g.write(torch.tensor([7, 3, 6]), 4)
    assert [t.tolist() for t in first] == [[7, 3, 6, PAD_SLOT]] * 2
    assert first[0].dtype == torch.int64 and first[1].dtype == torch.int32
    again = g.write(torch.tensor([2]), 2)  # a smaller graph after a larger one: the stale 3 must not stay
    assert [t.tolist() for t in again] == [[2, PAD_SLOT]] * 2
    assert again[0].data_ptr() == first[0].data_ptr() == g.slots.data_ptr()
    assert again[1].data_ptr() == first[1].data_ptr() == g.slots_i32.data_ptr()


def test_a_batch_larger_than_the_buffers_is_refused():
    with pytest.raises(ValueError, match="exceeds the 4 persistent state slots"):
        _slots().write(torch.tensor([1, 2]), 5)
    with pytest.raises(ValueError, match="capture sizes <= max_num_seqs"):
        _slots().check_batch(5)


def test_zero_resets_exactly_the_given_slots_in_every_pool():
    pools = [torch.ones(6, 3, 4), torch.ones(6, 2, 2, 2), torch.ones(6, 3, 4)]
    g = _slots(pools=pools)
    g.zero(torch.tensor([1, 4]))
    for pool in pools:
        assert [s for s in range(6) if bool((pool[s] == 0).all())] == [1, 4]
        assert bool((pool[[0, 2, 3, 5]] == 1).all())
    g.zero(torch.zeros(0, dtype=torch.int64))  # nothing fresh: nothing touched
    assert all(int((p == 0).flatten(1).all(1).sum()) == 2 for p in pools)


def test_a_uniform_verification_plan_is_views_of_one_set_of_buffers_with_padding_on_the_null_block():
    g = DecodeGraphSlots(3, torch.device("cpu"), lambda: iter(()), ring=2)
    slots = torch.tensor([[5, 6, 5], [8, 9, 8]])  # each row: the state before its first token, after each token
    first = g.write_verify(slots, 3)
    assert (first.src.tolist(), first.src_i32.tolist(), first.dst.tolist(), first.rows.tolist()) == (
        [5, 8, NULL_SLOT], [5, 8, NULL_SLOT], [[6, 9, NULL_SLOT], [5, 8, NULL_SLOT]], [0, 1, 2])
    again = g.write_verify(slots[1:], 2)  # a smaller batch: the stale row must not stay
    assert (again.src.tolist(), again.dst.tolist()) == ([8, NULL_SLOT], [[9, NULL_SLOT], [8, NULL_SLOT]])
    assert first.last_i32 is None  # no prefix caching: the conv update runs on the source slot
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(first[:4], again[:4]))
    with pytest.raises(ValueError, match="exceeds the 3 persistent state slots"):
        g.write_verify(slots, 4)


def test_with_prefix_caching_the_plan_names_each_rows_last_slot_for_the_conv_update():
    """With prefix caching a row's last column may differ from its source (it crossed a block), and the source may
    be a cached block: the conv update runs on the last token's slot (spec_decode.UniformVerify)."""
    g = DecodeGraphSlots(3, torch.device("cpu"), lambda: iter(()), ring=2, prefix_caching=True)
    first = g.write_verify(torch.tensor([[5, 6, 7], [8, 9, 8]]), 3)
    assert first.last_i32.dtype == torch.int32 and first.last_i32.tolist() == [7, 8, NULL_SLOT]
    again = g.write_verify(torch.tensor([[1, 2, 3]]), 2)
    assert again.last_i32.tolist() == [3, NULL_SLOT] and again.last_i32.data_ptr() == first.last_i32.data_ptr()
