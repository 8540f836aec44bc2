"""sharding.py: which heads, groups and checkpoint rows a tensor-parallel rank holds, for every TP size dividing
num_heads (groups sharded, shared by ranks, or split across ranks)."""

import math
from types import SimpleNamespace

import pytest

from vllm_mamba2_plugin import sharding

CASES = [(8, 1), (8, 2), (8, 4), (8, 8), (6, 3), (24, 4), (24, 6), (16, 8)]  # (num_heads, n_groups)


def _config(H, G, P=4, N=3):
    return SimpleNamespace(num_heads=H, n_groups=G, head_dim=P, state_size=N)


@pytest.mark.parametrize("H, G", CASES)
def test_every_head_reads_its_own_group(H, G):
    """The kernels map a rank's heads to its local groups uniformly; each local group must copy the true group of
    every head it serves."""
    cfg = _config(H, G)
    for tp in sharding.valid_tp_sizes(cfg):
        h, g_local = H // tp, sharding.local_groups(cfg, tp)
        assert h % g_local == 0
        for rank in range(tp):
            groups = sharding.rank_groups(cfg, tp, rank)
            assert len(groups) == g_local
            for k in range(h):
                true_group = (rank * h + k) // (H // G)
                assert groups[k // (h // g_local)] == true_group
                assert sharding.head_groups(cfg, tp, rank)[k] == true_group
        if G % tp == 0:
            assert g_local == G // tp and sharding.owns_whole_groups(cfg, tp)


@pytest.mark.parametrize("H, G", CASES)
def test_checkpoint_rows_of_each_rank(H, G):
    """in_proj rows: z, x and dt partitioned among the ranks in order; B and C rows are whole groups' rows."""
    cfg = _config(H, G)
    P, N, I = cfg.head_dim, cfg.state_size, H * cfg.head_dim
    for tp in sharding.valid_tp_sizes(cfg):
        h, g_local = H // tp, sharding.local_groups(cfg, tp)
        z, x, dt = [], [], []
        for rank in range(tp):
            rows = sharding.in_proj_rows(cfg, tp, rank)
            assert len(rows) == 2 * h * P + 2 * g_local * N + h
            z += rows[: h * P]
            x += rows[h * P: 2 * h * P]
            b = rows[2 * h * P: 2 * h * P + g_local * N]
            c = rows[2 * h * P + g_local * N: -h]
            dt += rows[-h:]
            groups = sharding.rank_groups(cfg, tp, rank)
            assert b == [2 * I + g * N + n for g in groups for n in range(N)]
            assert c == [2 * I + G * N + g * N + n for g in groups for n in range(N)]
            assert sharding.xbc_rows(cfg, tp, rank) == [r - I for r in rows[h * P: -h]]
        assert z == list(range(I)) and x == list(range(I, 2 * I)) and dt == list(range(2 * I + 2 * G * N,
                                                                                         2 * I + 2 * G * N + H))


def test_valid_sizes_are_the_divisors_of_num_heads():
    assert sharding.valid_tp_sizes(_config(24, 4)) == [1, 2, 3, 4, 6, 8, 12, 24]
    assert sharding.local_groups(_config(24, 4), 6) == 2  # 4 heads a rank, groups of 6 heads: copies per 2 heads
    assert sharding.heads_per_local_group(_config(24, 4), 6) == math.gcd(4, 6)


def test_rows_loader_does_no_cpu_work_for_a_device_parameter():
    """vLLM forks its engine core when CUDA is not yet initialised. A process that had used torch's CPU threads
    (libgomp) before that leaves the child with a thread pool that never starts: any CPU op large enough to run
    in parallel hangs there. The loader must take a GPU parameter's rows on the GPU; the "meta" device stands in
    for it (it holds no data), so a forked child finishes only if no CPU op touched the checkpoint tensor."""
    import os
    import time

    import torch

    a = torch.randn(1024, 1024)
    (a @ a).sum().item()  # the parent's OpenMP threads are up
    loaded = torch.randn(1296, 256)  # large enough for ATen to run a CPU gather in parallel
    param = torch.nn.Parameter(torch.empty(1296, 256, device="meta"), requires_grad=False)
    loader = sharding.rows_loader(list(range(1296))[::-1])
    pid = os.fork()
    if pid == 0:  # the child: exit 0 once the loader returns
        try:
            loader(param, loaded)
        finally:
            os._exit(0)
    deadline = time.time() + 30
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the loader hung in a forked child: it ran a parallel CPU op on the checkpoint tensor")
