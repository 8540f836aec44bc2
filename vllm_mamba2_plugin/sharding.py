"""What one tensor-parallel rank of a Mamba2 layer holds (docs/parallelism.md).

Notation: H heads of P channels, G groups of B / C (N rows each), tp ranks; rank r owns the h = H/tp heads
[r·h, (r+1)·h), their z / x channels and dt, and the B / C rows those heads read. A true group spans s = H/G heads.

The SSD and state-update kernels map a rank's heads to its local groups uniformly (local group j serves heads
[j·q, (j+1)·q)), so a rank holds G_local = h / q local groups with q = gcd(h, s): every run of q heads lies in one
true group, and local group j is a copy of true group (r·h + j·q) // s. That covers every tp dividing H:
    G % tp == 0      q = s, G_local = G / tp: whole groups, sharded (no copies)
    tp % G == 0      q = h, G_local = 1: the rank's heads share one group, copied to the tp / G ranks that read it
    otherwise        q < s: a group's copy per q heads (e.g. H = 6, G = 3, tp = 2: q = 1, a copy per head)
(G == 1 is the second case.) The gated RMSNorm normalises over a true group's s·P channels: a rank with whole
groups norms alone; otherwise the sums of squares are all-reduced per true group (mixer.py).
"""

import math

import torch


def valid_tp_sizes(config) -> list[int]:
    """Every TP size that divides num_heads."""
    return [tp for tp in range(1, config.num_heads + 1) if config.num_heads % tp == 0]


def heads_per_local_group(config, tp: int) -> int:
    """q = gcd(h, s): heads per local group of a rank."""
    H, G = config.num_heads, config.n_groups
    return math.gcd(H // tp, H // G)


def local_groups(config, tp: int = 1) -> int:
    """G_local: local groups (copies of B / C) one rank holds."""
    return config.num_heads // tp // heads_per_local_group(config, tp)


def rank_groups(config, tp: int, rank: int) -> list[int]:
    """The true group each local group of ``rank`` copies."""
    h, s, q = config.num_heads // tp, config.num_heads // config.n_groups, heads_per_local_group(config, tp)
    return [(rank * h + j * q) // s for j in range(h // q)]


def owns_whole_groups(config, tp: int) -> bool:
    """A rank's channels are whole norm groups (G % tp == 0): the gated norm needs no collective."""
    return config.n_groups % tp == 0


def head_groups(config, tp: int, rank: int) -> list[int]:
    """The true group of each of ``rank``'s heads (the norm's grouping across ranks)."""
    h, s = config.num_heads // tp, config.num_heads // config.n_groups
    return [(rank * h + k) // s for k in range(h)]


def _rows(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def xbc_rows(config, tp: int, rank: int, offset: int = 0) -> list[int]:
    """Rows of a checkpoint tensor laid out [x I | B G·N | C G·N] (conv1d; in_proj from ``offset`` = I) that
    ``rank`` holds, in its own order [x | B copies | C copies]."""
    H, P, G, N = config.num_heads, config.head_dim, config.n_groups, config.state_size
    I, h = H * P, H // tp
    x = _rows(offset + rank * h * P, h * P)
    groups = rank_groups(config, tp, rank)
    b = [row for g in groups for row in _rows(offset + I + g * N, N)]
    c = [row for g in groups for row in _rows(offset + I + G * N + g * N, N)]
    return x + b + c


def in_proj_rows(config, tp: int, rank: int) -> list[int]:
    """Rows of in_proj ([z I | x I | B G·N | C G·N | dt H] in the checkpoint) that ``rank`` holds:
    [z | x | B copies | C copies | dt], the mixer's split with local sizes."""
    H, P, G, N = config.num_heads, config.head_dim, config.n_groups, config.state_size
    I, h = H * P, H // tp
    z = _rows(rank * h * P, h * P)
    dt = _rows(2 * I + 2 * G * N + rank * h, h)
    return z + xbc_rows(config, tp, rank, offset=I) + dt


def rows_loader(rows: list[int]):
    """A weight loader that copies those rows (dim 0) of the checkpoint tensor into the parameter."""
    index = torch.tensor(rows, dtype=torch.long)

    def loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        # Gathered on the parameter's device. The checkpoint tensor arrives on the CPU, and a CPU gather of this
        # size runs on OpenMP threads: in an engine core that vLLM forked after the parent process had used them,
        # those never start (libgomp is not fork-safe) and loading hangs.
        src = loaded_weight.to(param.device)
        param.data.copy_(src.index_select(0, index.to(param.device)))

    return loader
