"""Both kernel implementations export the interface the mixer calls (kernels/interface.py), with its parameters
in its order; the CUDA module may add keyword parameters with defaults. Importing kernels.cuda imports no
upstream package, so this runs anywhere."""

import inspect

import pytest
import torch

from vllm_mamba2_plugin.kernels import cpu, cuda, reference
from vllm_mamba2_plugin.kernels.interface import Mamba2Kernels

MEMBERS = [name for name, fn in vars(Mamba2Kernels).items() if inspect.isfunction(fn) and not name.startswith("_")]


def _params(fn, skip_self=False):
    params = list(inspect.signature(fn).parameters.values())
    return params[1:] if skip_self else params


@pytest.mark.parametrize("module", [reference, cuda, cpu], ids=["reference", "cuda", "cpu"])
@pytest.mark.parametrize("name", MEMBERS)
def test_the_implementation_exports_the_member_with_its_parameters(module, name):
    want = _params(getattr(Mamba2Kernels, name), skip_self=True)
    got = _params(getattr(module, name))
    assert [p.name for p in got[:len(want)]] == [p.name for p in want]
    assert [p.default for p in got[:len(want)]] == [p.default for p in want]
    assert all(p.default is not inspect.Parameter.empty for p in got[len(want):]), "extra parameters need defaults"


@pytest.mark.parametrize("module", [reference, cuda, cpu], ids=["reference", "cuda", "cpu"])
def test_the_implementation_names_its_state_update_index_type(module):
    assert module.STATE_UPDATE_INDEX_DTYPE in (torch.int32, torch.int64)


def test_the_interface_is_what_the_modules_list():
    assert sorted(MEMBERS) == sorted(cuda.__all__) == sorted(cpu.__all__) == sorted(
        n for n in reference.__all__ if n != "segsum")
