"""mixer.slot_words: the view whole-slot state copies run on (verification steps' gathers and ring copies)."""

import torch

from vllm_mamba2_plugin.mixer import slot_words


def test_a_slot_is_one_row_of_words_and_copies_through_it_move_whole_slots():
    raw = torch.randn(10 * 68).to(torch.bfloat16)
    pool = raw.as_strided((10, 2, 4, 8), (68, 32, 8, 1))  # slots padded apart, as in vLLM's shared buffer
    words = slot_words(pool)
    assert words.dtype == torch.int64 and words.shape == (10, 16)
    want, padding = pool.clone(), raw.view(10, 68)[:, 64:].clone()
    want[[0, 5]] = want[[1, 4]]
    words.index_copy_(0, torch.tensor([0, 5]), words.index_select(0, torch.tensor([1, 4])))
    assert torch.equal(pool, want)
    assert torch.equal(raw.view(10, 68)[:, 64:], padding)  # between slots: untouched


def test_layouts_that_words_cannot_cover_keep_their_elements_or_the_pool():
    assert slot_words(torch.zeros(4, 3, 5)).dtype == torch.float32  # 60-byte slots
    odd = torch.zeros(4 * 66, dtype=torch.bfloat16).as_strided((4, 2, 4, 8), (66, 32, 8, 1))
    assert slot_words(odd).dtype == torch.bfloat16  # a slot stride of 132 bytes
    strided = torch.zeros(4, 3, 4, 8).transpose(2, 3)  # a slot's elements not contiguous: flatten would copy
    assert slot_words(strided) is strided
