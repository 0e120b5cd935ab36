"""``--local-dir`` of ``xla-ckpt ls`` / ``verify`` / ``gc``: this host's local tier of a run
(:mod:`xla_ckpt.run.local_tier`), run on the host whose tier it is.

* ``ls RUN --local-dir DIR``: each checkpoint folder of the run's local tier on this host:
  committed (this host's marker), untrusted (a check failed; never restored), files missing,
  or uncommitted (no marker: a save that did not finish; never restored); and the replicas
  of other hosts' parts it holds (``REPLICAS``: their hosts; ``replica only`` when this host
  has no part of its own there).
* ``verify RUN --local-dir DIR [--step N]``: every crc32c of this host's copy of the newest
  committed local step (or of step N), only of the files this host holds.
* ``gc RUN --local-dir DIR --keep-last N``: keep the newest N committed local steps (and the
  newest N steps held as replicas); delete the rest, the spare files kept for the next save
  to recycle (``.spare/``), and uncommitted folders with ``--incomplete``.

``--host H`` names this host's index (default 0; ``{host}`` in DIR becomes it, as in
``checkpoint.local_dir``).
"""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Any

from xla_ckpt.cli.common import UsageError, human_bytes, table


def add_local_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--local-dir", default=None, metavar="DIR",
                   help="also this host's local tier of the run (checkpoint.local_dir)")
    p.add_argument("--host", type=int, default=0, metavar="H",
                   help="this host's index in the job (default 0)")


def open_tier(args: argparse.Namespace, run_uri: str) -> Any:
    """The :class:`LocalTier` ``--local-dir`` names for run ``run_uri`` (its URI as the
    manager opened it), or None without the option.

    Raises:
        UsageError: the folder does not exist (a typo would list nothing, silently).
    """
    from xla_ckpt.run.local_tier import LocalTier  # noqa: PLC0415 - torch-free start-up

    if args.local_dir is None:
        return None
    root = args.local_dir.replace("{host}", str(args.host))
    if not os.path.isdir(root):
        raise UsageError(f"--local-dir {root}: no such folder on this host")
    return LocalTier(root, run_uri, host=args.host)


def listing(tier: Any) -> list[dict[str, Any]]:
    """Every checkpoint folder of ``tier`` with its state (see the module docstring)."""
    from xla_ckpt.run.local_tier import marker_name, untrusted_name  # noqa: PLC0415 - start-up

    committed = {s.name: s for s in tier.inventory()}
    held: dict[str, list[Any]] = {}
    for r in tier.replicas():
        held.setdefault(r.name, []).append(r)
    out = []
    for name in tier.folders():
        p = tier.path(name)
        size = sum(os.path.getsize(os.path.join(p, f)) for f in os.listdir(p)
                   if os.path.isfile(os.path.join(p, f)))
        s = committed.get(name)
        reps = held.get(name, [])
        row: dict[str, Any] = {"name": name, "nbytes": size,
                               "replicas": [r.host for r in reps]}
        if s is not None:
            state = "committed" if not s.missing else f"missing {len(s.missing)} file(s)"
            row.update(state=state, step=s.num_updates, save_id=s.save_id,
                       lease_epoch=s.lease_epoch, complete=s.complete, missing=list(s.missing))
        elif os.path.exists(os.path.join(p, untrusted_name(tier.host))):
            row["state"] = "untrusted"
        elif os.path.exists(os.path.join(p, marker_name(tier.host))):
            row["state"] = "unreadable marker"
        elif reps:
            row.update(state="replica only", step=reps[0].num_updates, save_id=reps[0].save_id,
                       lease_epoch=reps[0].lease_epoch)
        else:
            row["state"] = "uncommitted"
        out.append(row)
    return out


def print_listing(tier: Any, rows: list[dict[str, Any]]) -> None:
    spare = tier.spare_bytes()
    print(f"local tier of host {tier.host}: {tier.folder}: "
          f"{sum(r['state'] == 'committed' for r in rows)} committed, {len(rows)} folders"
          + (f", {human_bytes(spare)} of spare files (the next save recycles them)"
             if spare else ""))
    if rows:
        print(table([[r["name"], str(r.get("step", "-")), r.get("save_id", "-"),
                      str(r.get("lease_epoch", "-")), human_bytes(r["nbytes"]), r["state"],
                      ",".join(f"host {h}" for h in r["replicas"]) or "-"]
                     for r in rows],
                    ["NAME", "STEP", "SAVE ID", "LEASE", "SIZE", "STATE", "REPLICAS"]))


def chosen_step(tier: Any, step: int | None) -> Any:
    """The committed local step to verify: the newest, or the one of ``step`` updates.

    Raises:
        UsageError: none committed (or none at ``step``) on this host.
    """
    steps = tier.inventory()
    if step is not None:
        steps = [s for s in steps if s.num_updates == step]
    if not steps:
        raise UsageError(f"{tier.folder}: no committed local step"
                         + (f" at step {step}" if step is not None else "") + " on host "
                         f"{tier.host}")
    return steps[-1]


def verify_local(tier: Any, step: Any, *, progress: Any = None) -> Any:
    """Verify every byte of host ``tier.host``'s copy of ``step``: the files it holds
    (other hosts' files are not here by design and are not problems)."""
    from xla_ckpt.format.manifest import Manifest  # noqa: PLC0415 - torch-free start-up
    from xla_ckpt.io.verify import verify_checkpoint  # noqa: PLC0415 - torch-free start-up

    st = tier.step_storage(step.name)
    try:
        manifest = Manifest.from_json_bytes(tier.manifest_bytes(step.name),
                                            where=f"{st.uri}/manifest.json", require_crc=True)
        report = verify_checkpoint(st, manifest, progress=progress, files=step.files)
    finally:
        st.close()
    return report


def collect_local(tier: Any, *, keep_last: int, incomplete: bool, dry_run: bool) -> list[str]:
    """Delete all but the newest ``keep_last`` committed local steps (and, with
    ``incomplete``, uncommitted folders); the folders deleted (or to delete)."""
    keep = tier.newest(keep_last)
    rows = listing(tier)
    gone = [r["name"] for r in rows
            if r["name"] not in keep and (r["state"] != "uncommitted" or incomplete)]
    if not dry_run:
        for name in gone:
            shutil.rmtree(tier.path(name), ignore_errors=True)
    return gone
