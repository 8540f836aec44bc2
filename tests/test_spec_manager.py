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
    return Mamba2StateSpec(shapes=shapes, dtypes=(torch.bfloat16, torch.float32), block_size=512, **kw)


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
    assert manager.mamba_cache_mode == ("all" if caching else "none")
