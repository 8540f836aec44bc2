"""state_copy.py against vLLM's own copy specs (``get_conv_copy_spec`` / ``get_temporal_copy_spec``, the functions
the runner used before): the same source address and element count for every block and accepted-token count, on
state pools laid out as vLLM allocates them (blocks of one padded page, the states side by side in it)."""

import pytest
import torch
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec

from vllm_mamba2_plugin.model import Mamba2PluginForCausalLM
from vllm_mamba2_plugin.state_copy import STATE_COPY_FUNCS, conv_copy_spec, ssm_copy_spec


def _pools(dtype, blocks=7, K=3, D=40, H=4, P=6, N=8, pad=24):
    """(conv (blocks, K, D), ssm (blocks, H, P, N)) views of one byte buffer of padded pages, as vLLM's
    KV-cache tensors for a Mamba layer: each state at its offset in the block's page, page stride > its size."""
    es = torch.empty(0, dtype=dtype).element_size()
    conv_n, ssm_n = K * D, H * P * N
    page = conv_n + ssm_n + pad
    raw = torch.zeros(blocks * page * es, dtype=torch.uint8).view(dtype)
    conv = raw.as_strided((blocks, K, D), (page, D, 1))
    ssm = raw.as_strided((blocks, H, P, N), (page, P * N, N, 1), conv_n)
    return conv, ssm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_copy_specs_equal_vllms(dtype):
    conv, ssm = _pools(dtype)
    block_ids = [5, 0, 3, 6, 2]
    for cur in range(3):
        for accepted in (1, 2, 3):
            for ours, theirs, state in ((conv_copy_spec, get_conv_copy_spec, conv),
                                        (ssm_copy_spec, get_temporal_copy_spec, ssm)):
                a, b = ours(state, block_ids, cur, accepted), theirs(state, block_ids, cur, accepted)
                assert (a.start_addr, a.num_elements) == (b.start_addr, b.num_elements), (ours.__name__, cur, accepted)


def test_the_model_hands_both_runners_the_plugins_copy_specs():
    assert STATE_COPY_FUNCS == (conv_copy_spec, ssm_copy_spec)
    assert Mamba2PluginForCausalLM.get_mamba_state_copy_func() == STATE_COPY_FUNCS  # vLLM 0.26
    assert set(Mamba2PluginForCausalLM.get_mamba_state_copy_funcs(["mamba2"]).values()) == {STATE_COPY_FUNCS}
