"""Mamba2StateSpec is a MambaSpec (so vLLM's allocator, grouping and scheduler treat it as Mamba state) and
its manager refuses modes the plugin does not implement, and with prefix caching keeps a block per boundary and
turns vLLM's block-aligned prefill cut off (patches.py, 4)."""

from types import SimpleNamespace

import pytest
import torch

from vllm_mamba2_plugin.manager import Mamba2StateManager
from vllm_mamba2_plugin.spec import Mamba2StateSpec, state_shapes


def _spec(**kw):
    shapes = state_shapes(SimpleNamespace(conv_kernel=4, num_heads=8, head_dim=16, n_groups=1, state_size=16))
    return Mamba2StateSpec(shapes=shapes, dtypes=(torch.bfloat16, torch.float32), **{"block_size": 512, **kw})


def test_spec_is_a_mamba_spec_with_the_state_sizes():
    from vllm.v1.kv_cache_interface import MambaSpec

    spec = _spec()
    assert isinstance(spec, MambaSpec)
    assert spec.shapes == ((3, 160), (8, 16, 16))
    assert spec.page_size_bytes == 3 * 160 * 2 + 8 * 16 * 16 * 4


def test_manager_refuses_modes_it_does_not_implement():
    with pytest.raises(ValueError, match="mamba_cache_mode 'none' and 'align'.*got 'all'"):
        Mamba2StateManager(_spec(mamba_cache_mode="all"), SimpleNamespace())


@pytest.mark.parametrize("mode", ["none", "align"])
def test_manager_with_prefix_caching_installs_the_unaligned_prefill_chunks(mode, monkeypatch):
    from vllm.v1.core.block_pool import BlockPool

    from vllm_mamba2_plugin import patches

    installed = []
    monkeypatch.setattr(patches, "install_scheduler", lambda: installed.append(mode))
    caching = mode == "align"
    manager = Mamba2StateManager(_spec(mamba_cache_mode=mode), BlockPool(8, caching, 512), enable_caching=caching,
                                 kv_cache_group_id=0, scheduler_block_size=512)
    assert installed == ([mode] if caching else [])
    assert manager.mamba_cache_mode == "none"  # MambaManager's per-block paths (manager.EVERY_BOUNDARY)


def test_with_prefix_caching_a_request_holds_the_block_of_its_last_token_and_frees_the_ones_before():
    """Block ids step by step (blocks of 4 tokens): each step allocates the blocks its tokens reach; after it,
    every block before the block of the last computed token goes back to the pool and reads as the null block
    (id 0) in the request's table; at the end the rest is freed. (No block hashes here: a freed block is reused
    at once. In an engine it keeps its hash, so its boundary state is a cache hit until evicted.)"""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(16, True, 4)
    manager = Mamba2StateManager(_spec(mamba_cache_mode="align", block_size=4), pool, enable_caching=True,
                                 kv_cache_group_id=0, scheduler_block_size=4)
    free_at_start = pool.get_num_free_blocks()

    def step(computed_after: int):
        new = [b.block_id for b in manager.allocate_new_blocks("r", computed_after, computed_after)]
        manager.remove_skipped_blocks("r", computed_after)
        return new, [b.block_id for b in manager.req_to_blocks["r"]], free_at_start - pool.get_num_free_blocks()

    # (tokens computed after the step) -> (new block ids, the request's table, blocks held)
    assert step(6) == ([1, 2], [0, 2], 1)  # a 6-token chunk: blocks 0-1, block 0 freed after it
    assert step(10) == ([1], [0, 0, 1], 1)  # the prompt's last 4 tokens reach block 2; block 1 freed
    assert step(11) == ([], [0, 0, 1], 1)  # a decode inside block 2
    assert step(13) == ([2], [0, 0, 0, 2], 1)  # a decode crossing into block 3
    manager.free("r")
    assert pool.get_num_free_blocks() == free_at_start
