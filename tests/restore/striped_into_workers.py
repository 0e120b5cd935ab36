"""Workers of tests/restore/test_striped_into.py (module level: importable by the launcher)."""

from __future__ import annotations

from typing import Any

import torch

from xla_ckpt.comm import DistConfig, get_dist
from xla_ckpt.restore import restore, save_distributed


def _value() -> torch.Tensor:
    return torch.arange(1536 * 1024, dtype=torch.float32).reshape(1536, 1024) * 0.25


def save_tied(uri: str) -> None:
    """A 6 MiB plain tensor saved under two keys (one tensor object: tied), plus a scalar."""
    d = get_dist(DistConfig(backend="gloo"))
    w = _value()
    save_distributed({"a": w, "b": w, "step": torch.tensor(7.0)}, uri, dist=d)


def restore_untied(uri: str, strategy: str) -> dict[str, Any]:
    """Restore into separate zero targets for the two tied keys (what a rebuilt model holds)."""
    d = get_dist(DistConfig(backend="gloo"))
    into = {"a": torch.zeros(1536, 1024), "b": torch.zeros(1536, 1024), "step": torch.zeros(())}
    r = restore(uri, dist=d, into=into, strategy=strategy)
    want = _value()
    return {"a": torch.equal(into["a"], want), "b": torch.equal(into["b"], want),
            "step": float(into["step"]), "read": r.stats.bytes_read,
            "received": r.stats.bytes_received, "plan": r.stats.plan}


def restore_with_rank1_differing(uri: str, what: str) -> str:
    """Rank 1 passes another strategy or bucket size than the others: every rank must refuse."""
    from xla_ckpt.restore import RestoreConfig

    d = get_dist(DistConfig(backend="gloo"))
    cfg = RestoreConfig(strategy="striped" if what == "strategy" and d.rank == 1 else "all_ranks",
                        bucket_size_bytes=(1 << 20) + (d.rank == 1 and what == "bucket"))
    try:
        restore(uri, dist=d, config=cfg)
    except Exception as e:  # noqa: BLE001 - the test inspects the class and message
        return f"{type(e).__name__}: {e}"
    return "restored"
