"""restore() on 4 gloo ranks while another writer saves over the checkpoint: every rank agrees.

A rank's read that fails because the checkpoint was replaced becomes a DistributedError on every
rank; every rank then decides again, together, and restores the new save; if it is replaced
again, every rank raises the same CheckpointReplacedError naming the race.

The rank function is defined here, at module level: the launcher's workers import it from this
module by name.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from restore_workers import Kind, dist_for

import xla_ckpt
from xla_ckpt.errors import CheckpointReplacedError, DistributedError
from xla_ckpt.io import read_manifest
from xla_ckpt.restore import RestoreConfig, restore
from xla_ckpt.storage import StorageConfig, open_storage
from xla_ckpt.storage.local import LocalStorage
from xla_ckpt.testing.launcher import shared_pool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WORLD = 4


BLOBS = 4
#: Each tensor is one 4 MiB crc32c chunk, so 4 MiB slices read the data file in at least four
#: sequential requests with one worker (the reader coalesces adjacent small blobs into one).
NUMEL = 1 << 20
READS = StorageConfig(max_workers=1, slice_size_bytes=4 << 20)


def race_state(value: float) -> dict:
    """Four 4 MiB tensors (four blobs: several sequential reads with one worker)."""
    return {f"t{i}": torch.full((NUMEL,), value + i) for i in range(BLOBS)}


def restore_while_replaced(uri: str, kind: Kind, strategy: str, saver_rank: int,
                           times: int) -> dict[str, Any]:
    """Every rank restores ``uri``; on ``saver_rank``, after the first blob read of each data file
    (one per read attempt), another save commits to ``uri``, ``times`` times in all."""
    d = dist_for(kind)
    original = LocalStorage.read_range
    seen: set[str] = set()

    def read_range(storage, name, offset, out, generation=None):
        original(storage, name, offset, out, generation)
        if name.startswith("data-") and name not in seen and len(seen) < times:
            seen.add(name)
            xla_ckpt.save(race_state(10.0 * (len(seen) + 1)), uri)

    if d.rank == saver_rank:
        LocalStorage.read_range = read_range  # type: ignore[method-assign]  # the fault hook
    try:
        # all_ranks: every rank reads for itself (with host shared memory it would run per_host,
        # where only each host's leader reads; that plan has its own case)
        r = restore(uri, dist=d, strategy=strategy, storage_config=READS,
                    config=RestoreConfig(host_shared_memory=strategy != "all_ranks"))
    finally:
        LocalStorage.read_range = original  # type: ignore[method-assign]  # undo the fault
    return {"save_id": r.manifest.save_id, "checkpoint": r.checkpoint,
            "values": [float(r.state[f"t{i}"][0]) for i in range(BLOBS)],
            "saves_made": len(seen)}


@pytest.fixture(scope="module")
def pool():
    return shared_pool(WORLD)


def current_save_id(uri: str) -> str:
    with open_storage(uri) as st:
        return read_manifest(st).save_id


@pytest.mark.parametrize("strategy,saver_rank", [("all_ranks", 2), ("per_host", 0),
                                                 ("broadcast", 0)])
def test_replaced_once_every_rank_restores_the_new_save(pool, tmp_path, strategy, saver_rank):
    uri = str(tmp_path / "checkpoint_1_1")
    first = xla_ckpt.save(race_state(1.0), uri).save_id
    got = [r.unwrap() for r in pool.run(restore_while_replaced, uri, "gloo", strategy,
                                        saver_rank, 1)]
    now = current_save_id(uri)
    assert now != first
    assert [g["saves_made"] for g in got] == [1 if r == saver_rank else 0 for r in range(WORLD)]
    for g in got:
        assert (g["save_id"], g["checkpoint"]) == (now, uri)
        assert g["values"] == [20.0, 21.0, 22.0, 23.0]  # the new save's, on every rank


@pytest.mark.parametrize("strategy,saver_rank", [("all_ranks", 2), ("per_host", 0),
                                                 ("broadcast", 0)])
def test_replaced_twice_every_rank_names_the_race(pool, tmp_path, strategy, saver_rank):
    uri = str(tmp_path / "checkpoint_1_1")
    xla_ckpt.save(race_state(1.0), uri)
    results = pool.run(restore_while_replaced, uri, "gloo", strategy, saver_rank, 2)
    now = current_save_id(uri)
    errors = [r.error for r in results]
    assert all(type(e) is CheckpointReplacedError for e in errors), [r.traceback for r in results]
    messages = {str(e) for e in errors}
    assert len(messages) == 1  # the same error on every rank
    (message,) = messages
    assert message.startswith(f"{uri} was replaced while reading (save id ")
    # then the failing ranks (other ranks may have lost the race too, reading after the save)
    assert f" -> {now}); retry or pause the other writer [rank " in message
    e = errors[0]
    assert isinstance(e, DistributedError) and saver_rank in e.failures
    assert e.failures[saver_rank].startswith("DataFileMissingError: ")
    assert isinstance(e, CheckpointReplacedError) and e.after == now and e.uri == uri
