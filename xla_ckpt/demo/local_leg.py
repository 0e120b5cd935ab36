"""The demo's local-tier leg: a crash (SIGKILL) restored from host memory, then a damaged byte.

The replicated (DDP-style) run of the ``ddp`` leg, on ``train.hosts`` emulated hosts, with a
local tier (``checkpoint.local_dir``: one folder per emulated host, ``{host}`` in the path;
under ``/dev/shm`` when there is one, host memory as on a TPU VM):

1. **Crash**: the job saves to the local tier after every update and to the durable run
   folder every :data:`DURABLE_EVERY` updates.  Once every host committed the local step of
   update ``crash_at`` (mid-epoch, not a durable step), every worker gets SIGKILL: no
   preemption save, no clean exit.
2. **Relaunch** through the shaped proxy, which counts the bytes it serves to each host:
   ``restore_or_initialize`` must pick the newest local step (newer than the newest durable
   one), every host reading its own copy, with no checkpoint byte from GCS; the job trains on
   to the next durable step (``--stop-after-update``) and must match the uninterrupted
   reference bit for bit (losses, and the parameters' digest there).
3. **Flipped byte**: one byte in the middle of one tensor of the last host's local copy of
   that step (now the newest step of both tiers) is flipped; the next relaunch must read that
   tensor's damaged crc32c chunk from GCS and every other byte from the local tier, then train
   to the end bit for bit like the reference.
4. **Replaced host** (issue 26): the last host's local folder is deleted (a preempted VM, a
   rescheduled node, comes back with empty memory); the relaunch must restore the newest step
   anyway: that host's part comes from the replica another host keeps
   (``checkpoint.local_replicas``, default 1), sent over the data plane and checked on
   arrival, with no checkpoint byte from GCS, bitwise like the reference.

Every relaunch's figures per host: the tier it restored from, local and durable bytes (the
library's counters), the bytes the proxy served to the host's address (all of them, and the
bodies of data files alone), the fallbacks, and the times from the relaunch (process start,
dist init, decide, read, first training step).  :func:`xla_ckpt.demo.report.local_verdict`
judges them.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from typing import Any, Callable

from xla_ckpt.demo.link import ServedCounter
from xla_ckpt.demo.phase import DemoError, PhaseResult, run_phase
from xla_ckpt.demo.report import local_verdict
from xla_ckpt.format.manifest import MANIFEST_NAME, Manifest
from xla_ckpt.run.local_tier import LocalStep, marker_name, untrusted_name

logger = logging.getLogger(__name__)

DURABLE_EVERY = 4
"""Durable saves of the leg: every 4 updates (local ones: every update)."""
KEEP_LOCAL = 2
"""``checkpoint.keep_local_checkpoints`` of the leg."""


def make_local_root(workdir: str) -> str:
    """A fresh folder for the leg's local tiers: ``/dev/shm/xla-ckpt-demo-<8 hex>`` (host
    memory) when ``/dev/shm`` is writable, else ``<workdir>/local-tier``."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return tempfile.mkdtemp(prefix=f"xla-ckpt-demo-{uuid.uuid4().hex[:8]}-", dir=shm)
    root = os.path.join(workdir, "local-tier")
    os.makedirs(root, exist_ok=True)
    return root


def host_folder(root: str, host: int) -> str:
    return os.path.join(root, f"host-{host}")


def committed_steps(root: str, host: int) -> dict[str, LocalStep]:
    """Host ``host``'s committed, trusted local steps (its commit markers), by folder name."""
    out = {}
    pattern = os.path.join(host_folder(root, host), "*", "*", marker_name(host))
    for path in glob.glob(pattern):
        folder = os.path.dirname(path)
        if os.path.exists(os.path.join(folder, untrusted_name(host))):
            continue
        try:
            with open(path, "rb") as f:
                step = LocalStep.from_json(json.loads(f.read()), where=path)
        except (OSError, ValueError):
            continue
        out[os.path.basename(folder)] = step
    return out


def newest_everywhere(root: str, hosts: int) -> LocalStep | None:
    """The newest step every host committed (same save), or None."""
    per = [committed_steps(root, h) for h in range(hosts)]
    common = [s for name, s in per[0].items()
              if all(name in p and p[name].save_id == s.save_id for p in per[1:])]
    return max(common, key=lambda s: (s.lease_epoch, s.num_updates), default=None)


def _updates_of(name: str | None) -> int:
    m = re.fullmatch(r"checkpoint_\d+_(\d+)", name or "")
    return int(m.group(1)) if m else 0


def flip_one_byte(root: str, host: int, name: str) -> dict[str, Any]:
    """Flip one byte in the middle of the biggest tensor of ``host``'s local copy of
    checkpoint ``name``: inside a crc32c chunk that holds that tensor's bytes alone (so the
    check that fails names it, and only it).  Returns where: ``host``, ``checkpoint``,
    ``file``, ``tensor``, ``file_offset`` and the ``chunk`` ``[start, end)`` in the file."""
    folders = glob.glob(os.path.join(host_folder(root, host), "*", name))
    if len(folders) != 1:
        raise DemoError(f"local leg: host {host} has {len(folders)} local copies of {name}")
    folder = folders[0]
    with open(os.path.join(folder, MANIFEST_NAME), "rb") as f:
        manifest = Manifest.from_json_bytes(f.read(), where=folder, require_crc=True)
    with open(os.path.join(folder, marker_name(host)), "rb") as f:
        own = set(json.loads(f.read())["files"])  # not the replicas of other hosts' parts
    best: tuple[int, str, Any, Any] | None = None
    for item in manifest.items.values():
        for t in item.tensors:
            blob = item.blobs[t.blob]
            if blob.file not in own:
                continue  # not this host's file
            shared = [u for u in item.tensors if u.blob == t.blob and u is not t]
            if shared:
                continue  # a chunk of it may hold another tensor's bytes too
            n = t.span_bytes()
            if best is None or n > best[0]:
                best = (n, t.key, t, blob)
    if best is None:
        raise DemoError(f"local leg: no tensor of its own blob in host {host}'s copy of {name}")
    n, key, t, blob = best
    cs = blob.chunk_size
    start, end = t.byte_offset, t.byte_offset + n  # in the blob
    k = (start + end) // 2 // cs  # the chunk of the tensor's middle byte
    c0, c1 = k * cs, min((k + 1) * cs, blob.length)
    if c0 < start or c1 > end:
        raise DemoError(f"local leg: tensor {key} ({n} bytes) fills no crc32c chunk alone")
    at = blob.offset + (c0 + c1) // 2
    path = os.path.join(folder, blob.file)
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    logger.info("local leg: flipped the byte at offset %d of host %d's local %s/%s (tensor %s)",
                at, host, name, blob.file, key)
    return {"host": host, "checkpoint": name, "file": blob.file, "tensor": key,
            "file_offset": at, "chunk": [blob.offset + c0, blob.offset + c1]}


def run_local_leg(n: int, *, config: str, overrides: list[str], env: dict,
                  restore_env: dict, counter: ServedCounter | None, workdir: str, device: str,
                  hosts: int, preempt: int, total: int, save_dir: str, local_root: str,
                  ref: PhaseResult | None, durable_latest: Callable[[], str | None]) -> dict:
    """The leg (module docstring): crash, relaunch from the local tier, flipped byte,
    relaunch.  ``ref``: the uninterrupted reference with ``--digest-every DURABLE_EVERY``
    (the ddp leg's; None: run one here).  Saves of the crashed run go to storage through
    ``env``; the relaunches run through ``restore_env`` (the shaped proxy, counted by
    ``counter``; None: nothing counted, e.g. ``--uri``); ``durable_latest()``: the newest
    committed checkpoint of ``save_dir``."""
    d = DURABLE_EVERY
    crash_at = preempt if preempt % d else preempt + 1
    if crash_at >= total:
        raise DemoError(f"local leg: {total} updates leave no update after {crash_at} to "
                        "crash before; raise train.max_updates")
    local_dir = os.path.join(local_root, "host-{host}")
    base = overrides + [f"checkpoint.save_dir={save_dir}", f"checkpoint.local_dir={local_dir}",
                        "checkpoint.local_interval_updates=1",
                        f"checkpoint.save_interval_updates={d}",
                        f"checkpoint.keep_local_checkpoints={KEEP_LOCAL}",
                        "checkpoint.local_max_bytes=0", "checkpoint.restore_file=checkpoint_last"]
    phase_seconds: dict[str, float] = {}
    if ref is None:
        ref = run_phase("reference", workers=n, config=config, overrides=base, env=env,
                        workdir=workdir, device=device, hosts=hosts, label="local-reference",
                        args=["--digest-every", str(d)])
        phase_seconds["reference"] = round(ref.seconds, 2)

    def committed(done: int | None) -> bool:
        if done is None or done < crash_at:
            return False
        newest = newest_everywhere(local_root, hosts)
        return newest is not None and newest.num_updates >= crash_at

    crash = run_phase("train", workers=n, config=config, overrides=base, env=env,
                      workdir=workdir, device=device, hosts=hosts, label="local-train",
                      crash_when=committed)
    phase_seconds["train"] = round(crash.seconds, 2)
    local = newest_everywhere(local_root, hosts)
    durable = durable_latest()
    logger.info("local leg: killed after update %s; newest local step %s, newest durable %s",
                crash.crashed_after, local.name if local else None, durable)
    if local is None:
        raise DemoError("local leg: the crashed run left no local step that every host "
                        "committed")
    stop = min(total, (local.num_updates // d + 1) * d)
    crash_row = _relaunch("crash", n, config=config, overrides=base, env=restore_env,
                          counter=counter, workdir=workdir, device=device, hosts=hosts,
                          ref=ref, args=["--stop-after-update", str(stop)],
                          expect=local.name, newest_durable=durable, flipped=None)
    phase_seconds["restart"] = crash_row.pop("phase_seconds")

    step = newest_everywhere(local_root, hosts)
    durable2 = durable_latest()
    if step is None:
        raise DemoError("local leg: the relaunched run left no local step that every host "
                        "committed")
    flipped = flip_one_byte(local_root, hosts - 1, step.name)
    flip_row = _relaunch("flipped", n, config=config, overrides=base, env=restore_env,
                         counter=counter, workdir=workdir, device=device, hosts=hosts,
                         ref=ref, args=[], expect=step.name, newest_durable=durable2,
                         flipped=flipped)
    phase_seconds["flipped"] = flip_row.pop("phase_seconds")

    # A replaced host: the last host's memory is gone; its part comes back from the replica
    # another host keeps (checkpoint.local_replicas, default 1), over the data plane.
    last = newest_everywhere(local_root, hosts)
    durable3 = durable_latest()
    if last is None:
        raise DemoError("local leg: the run after the flipped byte left no local step that "
                        "every host committed")
    replaced = hosts - 1
    shutil.rmtree(host_folder(local_root, replaced))
    logger.info("local leg: deleted host %d's local tier (a replaced host) before relaunching",
                replaced)
    replaced_row = _relaunch("replaced", n, config=config, overrides=base, env=restore_env,
                             counter=counter, workdir=workdir, device=device, hosts=hosts,
                             ref=ref, args=[], expect=last.name, newest_durable=durable3,
                             flipped=None, replaced=replaced)
    phase_seconds["replaced"] = replaced_row.pop("phase_seconds")
    return {"workers": n, "hosts": hosts, "save_dir": save_dir, "local_dir": local_dir,
            "local_interval_updates": 1, "save_interval_updates": d,
            "keep_local_checkpoints": KEEP_LOCAL, "crash_at_update": crash_at,
            "crashed_after_update": crash.crashed_after, "phase_seconds": phase_seconds,
            "restores": [crash_row, flip_row, replaced_row]}


def _relaunch(kind: str, n: int, *, config: str, overrides: list[str], env: dict,
              counter: ServedCounter | None, workdir: str, device: str, hosts: int,
              ref: PhaseResult, args: list[str], expect: str, newest_durable: str | None,
              flipped: dict | None, replaced: int | None = None) -> dict:
    """One relaunch of the leg (``kind``: ``crash``, ``flipped`` or ``replaced``), judged."""
    if counter is not None:
        counter.reset()
    res = run_phase("resume", workers=n, config=config, overrides=overrides, env=env,
                    workdir=workdir, device=device, hosts=hosts, label=f"local-{kind}",
                    args=args + ["--no-state-digest"]
                    + (["--sync-restores"] if counter is not None else []),
                    poll=counter.poll if counter is not None else None)
    served = counter.served(0) if counter is not None else None
    row = local_verdict(kind, res, ref, served=served, hosts=hosts, expect=expect,
                        expect_updates=_updates_of(expect), newest_durable=newest_durable,
                        newest_durable_updates=_updates_of(newest_durable), flipped=flipped,
                        replaced=replaced)
    row["phase_seconds"] = round(res.seconds, 2)
    return row


def remove_local_root(root: str) -> None:
    shutil.rmtree(root, ignore_errors=True)
