"""Workers of tests/restore/test_read_balance.py (module level: importable by the launcher).

The issue's state, scaled down 16x: 48 vectors of 16 KiB and 6 matrices of 256 KiB (fp32),
the vectors stored before the matrices or after them (the order of the state dict is the
order of the blobs).
"""

from __future__ import annotations

from typing import Any

import torch

from xla_ckpt.comm import DistConfig, get_dist
from xla_ckpt.restore import RestoreConfig, restore, save_distributed

VECTORS, VECTOR_NUMEL = 48, 4096  # 16 KiB each
MATRICES, MATRIX_ROWS = 6, 256  # 256 x 256 fp32: 256 KiB each


def make_state(vectors_first: bool, *, empty: bool = False) -> dict[str, torch.Tensor]:
    """The state (or zero targets of its shapes, ``empty``), vectors first or matrices first."""
    def value(i: int, shape: tuple[int, ...]) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        if empty:
            return torch.zeros(shape)
        return (torch.arange(n, dtype=torch.float32) * 0.5 + i).reshape(shape)

    vecs = {f"v{i:02d}": value(i, (VECTOR_NUMEL,)) for i in range(VECTORS)}
    mats = {f"m{j}": value(100 + j, (MATRIX_ROWS, MATRIX_ROWS)) for j in range(MATRICES)}
    return {**vecs, **mats} if vectors_first else {**mats, **vecs}


def save(uri: str, vectors_first: bool) -> None:
    save_distributed(make_state(vectors_first), uri, dist=get_dist(DistConfig(backend="gloo")))


def restore_bytes(uri: str, vectors_first: bool, into: bool, plan: str) -> dict[str, Any]:
    """Restore with ``plan`` (into zero targets or not); this rank's bytes read and whether its
    state is bitwise the saved one."""
    d = get_dist(DistConfig(backend="gloo"))
    targets = make_state(vectors_first, empty=True) if into else None
    r = restore(uri, dist=d, config=RestoreConfig(strategy=plan), into=targets)
    want = make_state(vectors_first)
    got = targets if targets is not None else r.state
    same = set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    return {"rank": d.rank, "read": r.stats.bytes_read, "plan": r.stats.plan, "same": same}
