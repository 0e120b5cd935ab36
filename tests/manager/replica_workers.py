"""What the replica transfer tests run on each rank of a 2-rank gloo pool (importable)."""

from __future__ import annotations

import json
import os

from xla_ckpt.comm import DistConfig, get_dist
from xla_ckpt.run.local_tier import LocalStep, LocalTier
from xla_ckpt.run.replicas import transfer_part


def transfer(root: str, step_doc: dict, files: list[str], damage: str) -> dict:
    """Rank 0 sends host 1's part of ``step_doc`` from ``<root>/host-0`` (after ``damage``:
    ``""``, ``"flip"`` the last byte of the first file, or ``"delete"`` it) to rank 1's tier
    at ``<root>/host-1``; what each rank saw."""
    d = get_dist(DistConfig(backend="gloo", timeout_s=60.0))
    step = LocalStep.from_json(step_doc, where="test")
    # Rank 0 is host 1 (the part's own host), rank 1 is host 0 (the holder of its replica).
    tier = LocalTier(os.path.join(root, f"host-{d.rank}"), "/runs/r", host=1 - d.rank)
    if d.rank == 0 and damage:
        path = os.path.join(tier.path(step.name), sorted(files)[0])
        if damage == "delete":
            os.unlink(path)
        else:
            with open(path, "r+b") as f:
                f.seek(-1, os.SEEK_END)
                b = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([b[0] ^ 0x80]))
    res = transfer_part(d, tier, step, files, src=0, dst=1)
    if d.rank == 1 and res.ok:
        tier.commit_replica(step)
    folder = tier.path(step.name)
    return {"nbytes": res.nbytes,
            "problems": [[p.kind, p.file, list(p.keys), p.detail] for p in res.problems],
            "files": sorted(os.listdir(folder)) if os.path.isdir(folder) else [],
            "replicas": [json.loads(json.dumps(s.to_json())) for s in tier.replicas()]}
