"""GCS preconditions beyond the conformance suite: what goes over the wire, 412 never retried,
and a 412 to a retried write whose earlier attempt did land (the answer was lost)."""

import os
import re
from typing import Any

import pytest

from xla_ckpt.errors import PreconditionFailedError
from xla_ckpt.storage import StorageConfig
from xla_ckpt.storage.gcs import writes
from xla_ckpt.testing.fault_proxy import Fault

FAST: dict[str, Any] = dict(initial_backoff_s=0.001, max_backoff_s=0.01, retry_deadline_s=20.0)
SMALL_PARTS = StorageConfig(max_workers=4, slice_size_bytes=64 * 1024, max_attempts=4,
                            parallel_upload_threshold_bytes=100_000,
                            upload_part_size_bytes=32 * 1024, **FAST)
TINY_PARTS = StorageConfig(max_workers=4, max_attempts=4, parallel_upload_threshold_bytes=1000,
                           upload_part_size_bytes=1000, **FAST)  # 40 kB: 40 parts, a compose tree



def _final_write(r) -> bool:
    """A request (or its record) making the final object: a POST carrying a precondition."""
    return r.method == "POST" and "ifGenerationMatch" in r.query


def _generation_match(record) -> str | None:
    m = re.search(r"(?:^|&)ifGenerationMatch=(\d+)", record.query)
    return m.group(1) if m else None


@pytest.mark.parametrize("n", [100, 300_000])
def test_only_the_request_making_the_object_carries_the_precondition(fault_proxy, gcs_emulator,
                                                                    stem, n):
    with fault_proxy.storage(gcs_emulator.uri(stem), SMALL_PARTS) as st:
        old = st.write_atomic("o", [b"old"])
        before = len(fault_proxy.records())
        new = st.write_atomic("o", [os.urandom(n)], if_generation_match=old.generation)
        posts = [r for r in fault_proxy.records()[before:] if r.method == "POST"]
    conditional = [r for r in posts if _generation_match(r) is not None]
    assert [_generation_match(r) for r in conditional] == [str(old.generation)]
    (final,) = conditional
    assert final.status == 200 and new.generation != old.generation
    if n > SMALL_PARTS.parallel_upload_threshold_bytes:
        assert final.path.endswith("/compose")
        assert len(posts) == 1 + 10  # ten unconditional part uploads, then the compose
    else:
        assert len(posts) == 1 and "/upload/" in final.path


def test_a_compose_tree_keeps_intermediate_composes_unconditional(fault_proxy, gcs_emulator, stem):
    data = os.urandom(40_000)  # 40 parts: two intermediate composes, then the final one
    with fault_proxy.storage(gcs_emulator.uri(stem), TINY_PARTS) as st:
        info = st.write_atomic("tree", [data], if_generation_match=0)
        assert st.read_bytes("tree") == data and st.stat("tree").generation == info.generation
        assert st.list_in_flight("") == []
    composes = [r for r in fault_proxy.records() if r.path.endswith("/compose")]
    assert len(composes) == 3
    assert [_generation_match(r) for r in composes] == [None, None, "0"]
    assert composes[-1].path.endswith("/o/" + f"{stem}/tree/compose")


@pytest.mark.parametrize("n", [100, 300_000])
def test_a_412_is_never_retried(fault_proxy, gcs_emulator, stem, n):
    with fault_proxy.storage(gcs_emulator.uri(stem), SMALL_PARTS) as st:
        st.write_atomic("o", [b"there"])
        before = len(fault_proxy.records())
        with pytest.raises(PreconditionFailedError) as ei:
            st.write_atomic("o", [os.urandom(n)], if_generation_match=1)
        assert st.read_bytes("o") == b"there"
        assert st.list_in_flight("") == []
        retried = [e for e in st.retries.events() if "412" in e.cause]
    assert ei.value.expected_generation == 1 and ei.value.actual_generation is not None
    assert retried == []
    answered = [r for r in fault_proxy.records()[before:] if _final_write(r)]
    # The multipart upload is refused once; the composite write stops at its stat, before parts.
    assert [r.status for r in answered] == ([412] if n < 100_000 else [])


@pytest.mark.parametrize("n, which", [(100, "upload"), (300_000, "compose")])
def test_a_412_after_a_lost_answer_is_success_when_the_live_object_is_ours(
        fault_proxy, gcs_emulator, stem, n, which):
    """The first attempt lands but its answer is cut (a reset after the service applied it);
    the retry is refused with 412 as the object now exists: it has our bytes, so success."""
    data = os.urandom(n)
    with fault_proxy.storage(gcs_emulator.uri(stem), SMALL_PARTS) as st:
        fault_proxy.inject(Fault.reset(after_bytes=0), match=_final_write)
        info = st.write_atomic("o", [data], if_generation_match=0)
        assert st.read_bytes("o") == data
        assert info.generation == st.stat("o").generation and info.size == n
        assert st.list_in_flight("") == []
    answered = [r for r in fault_proxy.records() if _final_write(r)]
    assert [r.fault for r in answered] == ["reset", ""]
    assert answered[1].status == 412
    assert (which == "compose") == answered[0].path.endswith("/compose")


def test_a_412_after_a_retry_is_a_failure_when_the_live_object_is_another(fault_proxy,
                                                                         gcs_emulator, stem):
    with fault_proxy.storage(gcs_emulator.uri(stem), SMALL_PARTS) as st:
        theirs = st.write_atomic("o", [b"theirs"])
        # A 503 the service never saw, then the retry finds the object: not ours -> refused.
        fault_proxy.inject(Fault.error(503), match=_final_write)
        with pytest.raises(PreconditionFailedError) as ei:
            st.write_atomic("o", [b"ours!!"], if_generation_match=0)
        assert st.read_bytes("o") == b"theirs"
    assert ei.value.actual_generation == theirs.generation
    answered = [r.status for r in fault_proxy.records() if _final_write(r)]
    assert answered == [503, 412]


def test_a_composite_write_raced_at_its_compose_deletes_its_parts(gcs_emulator, stem,
                                                                  monkeypatch):
    """The object is replaced between the write's own check and its final compose."""
    compose_tree = writes._GCSWrites._compose_tree

    def raced(self, full, sources, uid, up, expected=None):
        with gcs_emulator.storage(stem) as other:
            other.write_atomic("o", [b"another writer"])
        return compose_tree(self, full, sources, uid, up, expected)

    with gcs_emulator.storage(stem, SMALL_PARTS) as st:
        old = st.write_atomic("o", [b"old"])
        monkeypatch.setattr(writes._GCSWrites, "_compose_tree", raced)
        with pytest.raises(PreconditionFailedError) as ei:
            st.write_atomic("o", [os.urandom(300_000)], if_generation_match=old.generation)
        monkeypatch.undo()
        assert st.read_bytes("o") == b"another writer"
        assert ei.value.actual_generation == st.stat("o").generation
        assert st.list_in_flight("") == []
    assert gcs_emulator.object_names(stem + "/") == [f"{stem}/o"]


def test_delete_sends_its_precondition_and_maps_412(fault_proxy, gcs_emulator, stem):
    with fault_proxy.storage(gcs_emulator.uri(stem), SMALL_PARTS) as st:
        live = st.write_atomic("o", [b"x"])
        with pytest.raises(PreconditionFailedError) as ei:
            st.delete("o", if_generation_match=live.generation + 1)
        assert ei.value.actual_generation == live.generation
        st.delete("o", if_generation_match=live.generation)
        assert not st.exists("o")
    deletes = [r for r in fault_proxy.records() if r.method == "DELETE"]
    assert [(_generation_match(r), r.status < 300) for r in deletes] == [
        (str(live.generation + 1), False), (str(live.generation), True)]
    assert deletes[0].status == 412

