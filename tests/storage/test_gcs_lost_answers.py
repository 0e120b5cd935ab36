"""Conditional writes and deletes whose first answer was lost after the service acted (issue 25,
defect 9: "a retried conditional delete whose first answer was lost raises after our delete
worked").

``Fault.lost_answer`` forwards the request to the emulator, which applies it, then drops the
connection before any byte of the answer: the client retries, and the retry meets the state its
own first attempt made -- 404 for a delete (the object is gone), 412 for a create-only or
compare-and-swap write (the object now has a generation the request did not name).  Each is
success when the store holds what the request was for (the object gone; the live object has our
bytes), and still a :class:`PreconditionFailedError` when another writer got there (the object
has another generation and other bytes).  The same holds through the manager, whose manifests,
pointers, lease and rotation are all conditional.
"""

import os
import re
from typing import Any

import pytest
import torch

from xla_ckpt.errors import PreconditionFailedError
from xla_ckpt.manager import CheckpointManager
from xla_ckpt.storage import StorageConfig
from xla_ckpt.storage import retry as retry_mod
from xla_ckpt.testing.fault_proxy import Fault

FAST: dict[str, Any] = dict(initial_backoff_s=0.001, max_backoff_s=0.01, retry_deadline_s=20.0)
SMALL_PARTS = StorageConfig(max_workers=4, slice_size_bytes=64 * 1024, max_attempts=4,
                            parallel_upload_threshold_bytes=100_000,
                            upload_part_size_bytes=32 * 1024, **FAST)



def _generation_match(query: str) -> str | None:
    m = re.search(r"(?:^|&)ifGenerationMatch=(\d+)", query)
    return m.group(1) if m else None


def _deletes(r) -> bool:
    return r.method == "DELETE"


def _conditional_write(r) -> bool:
    return r.method == "POST" and _generation_match(r.query) is not None


@pytest.mark.parametrize("conditional", [True, False])
def test_a_delete_whose_answer_was_lost_is_success_when_the_object_is_gone(
        fault_proxy, gcs_emulator, stem, conditional):
    with fault_proxy.storage(gcs_emulator.uri(stem), SMALL_PARTS) as st:
        live = st.write_atomic("marker", [b"ours"])
        st.write_atomic("other", [b"stays"])
        fault_proxy.inject(Fault.lost_answer(), match=_deletes)
        st.delete("marker", if_generation_match=live.generation if conditional else None)
        assert not st.exists("marker") and st.read_bytes("other") == b"stays"
    deletes = fault_proxy.records(_deletes)
    assert [(r.fault, r.status) for r in deletes] == [("lost_answer", 0), ("", 404)]
    expected = str(live.generation) if conditional else None
    assert [_generation_match(r.query) for r in deletes] == [expected, expected]
    assert gcs_emulator.object_names(stem + "/") == [f"{stem}/other"]


def test_a_retried_conditional_delete_that_meets_another_writers_object_keeps_it(
        fault_proxy, gcs_emulator, stem, monkeypatch):
    """Our delete worked, its answer was lost, and before the retry another writer created the
    name again: the retry's 412 is right to refuse -- the live object is not the generation we
    were asked to delete, and it stays."""
    with fault_proxy.storage(gcs_emulator.uri(stem), SMALL_PARTS) as st:
        ours = st.write_atomic("marker", [b"ours"])
        failed = retry_mod.Backoff.failed
        theirs: dict[str, Any] = {}

        def another_writer_first(self, cause, **kw):
            if self.what.startswith("delete ") and not theirs:
                with gcs_emulator.storage(stem) as other:
                    theirs["info"] = other.write_atomic("marker", [b"theirs"])
            return failed(self, cause, **kw)

        monkeypatch.setattr(retry_mod.Backoff, "failed", another_writer_first)
        fault_proxy.inject(Fault.lost_answer(), match=_deletes)
        with pytest.raises(PreconditionFailedError) as ei:
            st.delete("marker", if_generation_match=ours.generation)
        monkeypatch.undo()
        assert st.read_bytes("marker") == b"theirs"
    e = ei.value
    assert e.expected_generation == ours.generation
    assert e.actual_generation == theirs["info"].generation != ours.generation
    assert f"the live object has generation {theirs['info'].generation}" in str(e)
    assert ("an earlier attempt of this delete, whose answer was lost, may have deleted "
            f"generation {ours.generation}") in str(e)
    assert [(r.fault, r.status) for r in fault_proxy.records(_deletes)] == [
        ("lost_answer", 0), ("", 412)]


@pytest.mark.parametrize("n, existing", [(100, False), (100, True), (300_000, False),
                                         (300_000, True)])
def test_a_conditional_write_whose_answer_was_lost_is_success_when_the_object_is_ours(
        fault_proxy, gcs_emulator, stem, n, existing):
    """Create-only (``0``) and compare-and-swap (``N``) writes, one multipart upload or a
    composite one (the final compose carries the precondition): the retry gets 412, the live
    object has our size and crc32c, so the write succeeded."""
    data = os.urandom(n)
    with fault_proxy.storage(gcs_emulator.uri(stem), SMALL_PARTS) as st:
        expected = st.write_atomic("o", [b"before"]).generation if existing else 0
        fault_proxy.inject(Fault.lost_answer(), match=_conditional_write)
        info = st.write_atomic("o", [data], if_generation_match=expected)
        assert st.read_bytes("o") == data
        live = st.stat("o")
        assert info.generation == live.generation != expected and info.size == n
        assert st.list_in_flight("") == []
    answered = fault_proxy.records(_conditional_write)
    assert [(r.fault, r.status) for r in answered] == [("lost_answer", 0), ("", 412)]
    assert {_generation_match(r.query) for r in answered} == {str(expected)}
    composite = n > SMALL_PARTS.parallel_upload_threshold_bytes
    assert answered[0].path.endswith("/compose") == composite


def test_a_lost_answer_to_a_conditional_write_is_still_a_failure_when_the_bytes_are_others(
        fault_proxy, gcs_emulator, stem, monkeypatch):
    """The first attempt never landed here: between it and the retry another writer created
    the object (other bytes): the 412 stands."""
    with fault_proxy.storage(gcs_emulator.uri(stem), SMALL_PARTS) as st:
        failed = retry_mod.Backoff.failed
        theirs: dict[str, Any] = {}

        def another_writer_first(self, cause, **kw):
            if not theirs:
                with gcs_emulator.storage(stem) as other:
                    theirs["info"] = other.write_atomic("o", [b"theirs"])
            return failed(self, cause, **kw)

        monkeypatch.setattr(retry_mod.Backoff, "failed", another_writer_first)
        fault_proxy.inject(Fault.error(503), match=_conditional_write)
        with pytest.raises(PreconditionFailedError) as ei:
            st.write_atomic("o", [b"ours!!"], if_generation_match=0)
        monkeypatch.undo()
        assert st.read_bytes("o") == b"theirs"
    assert ei.value.actual_generation == theirs["info"].generation


class _FirstAttemptOfEach:
    """A matcher losing the answer to the first conditional write or delete of each object."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set()

    def __call__(self, r) -> bool:
        conditional = _generation_match(r.query) is not None and r.method in ("POST", "DELETE")
        key = (r.method, r.object_name)
        if not conditional or key in self.seen:
            return False
        self.seen.add(key)
        return True


def test_a_manager_whose_conditional_answers_are_all_lost_once_saves_rotates_and_restores(
        fault_proxy, gcs_emulator, stem, monkeypatch):
    """Lease, manifests (create-only), pointers (compare-and-swap) and rotation (a delete pinned
    to the manifest's generation): the first answer to each is lost, and every save still
    commits, rotation keeps the newest only, and the restore is bitwise the last save."""
    from xla_ckpt.manager import CheckpointConfig

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", fault_proxy.url)  # what the restore opens
    lose = _FirstAttemptOfEach()
    fault_proxy.inject(Fault.lost_answer(), match=lose, times=10_000)
    cfg = CheckpointConfig(save_dir=gcs_emulator.uri(f"{stem}/run"), async_save=False,
                           handle_sigterm=False, save_interval_epochs=0,
                           keep_interval_updates=1)
    steps = (10, 20, 30)
    states = [{"w": torch.full((5,), float(u)), "step": u} for u in steps]
    with fault_proxy.storage(gcs_emulator.uri(f"{stem}/run"), SMALL_PARTS) as run:
        with CheckpointManager(cfg, storage=run) as mgr:
            names = [mgr.save(s, epoch=1, num_updates=u)
                     for s, u in zip(states, steps, strict=True)]
        with CheckpointManager(cfg, storage=run) as mgr:
            got = mgr.restore()
    assert names == ["checkpoint_1_10", "checkpoint_1_20", "checkpoint_1_30"]
    assert got.checkpoint == "checkpoint_1_30"
    assert torch.equal(got.state["w"], torch.full((5,), 30.0)) and got.state["step"] == 30
    lost = [r for r in fault_proxy.records() if r.fault == "lost_answer"]
    kinds = {(r.method, r.object_name.rsplit("/", 1)[-1]) for r in lost}
    assert ("POST", "lease.json") in kinds                 # the lease (compare-and-swap)
    assert ("POST", "manifest.json") in kinds              # the commit markers (create-only)
    assert ("DELETE", "manifest.json") in kinds            # rotation's pinned delete
    assert any(name.startswith("checkpoint_last") for _, name in kinds)   # the pointer
    left = {n.split("/")[2] for n in gcs_emulator.object_names(f"{stem}/run/")
            if n.count("/") >= 3}
    assert left == {"checkpoint_1_30"}
