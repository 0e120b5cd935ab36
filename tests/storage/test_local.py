"""Local backend specifics beyond the conformance suite: what a killed write leaves and how
``list_in_flight`` reports it, the folder lock, and local generations."""

import errno
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import xla_ckpt.storage.local as local
import xla_ckpt.storage.local_lock as local_lock
from xla_ckpt.errors import PreconditionFailedError, StorageError
from xla_ckpt.run.prune import in_flight_uploads
from xla_ckpt.storage import StorageConfig
from xla_ckpt.storage.base import InFlightObject
from xla_ckpt.storage.local import IN_FLIGHT_NAME, TMP_MARK, LocalStorage
from xla_ckpt.storage.local_lock import LOCK_NAME, folder_lock

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "local_write_worker.py")
CFG = StorageConfig(max_workers=2)


def _put(root, rel: str, data: bytes = b"x") -> None:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _all_files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _dirs, files in os.walk(root) for f in files)


def _wait_for_temp_file(proc, folder, nbytes, log_path, timeout_s=60.0) -> str:
    """The path of the first temporary file under ``folder`` once it holds ``nbytes``."""
    deadline = time.monotonic() + timeout_s
    while True:
        for d, _dirs, files in os.walk(folder):
            for f in files:
                path = os.path.join(d, f)
                try:
                    if TMP_MARK in f and os.path.getsize(path) >= nbytes:
                        return path
                except FileNotFoundError:  # renamed into place meanwhile
                    continue
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the worker wrote no temporary file (rc {proc.poll()}):\n"
                        f"{log_path.read_text()}")
        time.sleep(0.01)


@pytest.mark.timeout(120)
def test_a_killed_local_save_leaves_its_temp_file_and_list_in_flight_reports_exactly_it(
        tmp_path):
    root = str(tmp_path / "root")
    decoys = ["decoys/foo.tmp", "decoys/notes.tmp-1", "decoys/x.tmp-0123456789AB",
              "decoys/y.tmp-0123456789ab-part-00000", "decoys/z.tmp-0123456789abc",
              "run/other.bin", "run/foo.tmp"]
    for d in decoys:
        _put(root, d)
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, WORKER, os.path.join(root, "run")],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        tmp = _wait_for_temp_file(proc, os.path.join(root, "run"), 2 << 20, log_path)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    name = os.path.relpath(tmp, root)
    target, upload_id = name.split(TMP_MARK)
    assert name.startswith("run/checkpoint_1_1/data-") and target.endswith(".safetensors")
    st = os.stat(tmp)
    assert 0 < st.st_size < 32 << 20  # killed mid-write
    expected = InFlightObject(name=name, target=target, upload_id=upload_id, size=st.st_size,
                              created_unix_s=st.st_mtime)
    with LocalStorage(root, CFG) as storage:
        assert storage.lists_in_flight
        assert storage.list_in_flight() == [expected]
        assert storage.list_in_flight("run") == [expected]
        assert storage.list_in_flight("run/checkpoint_1_1") == [expected]
        assert storage.list_in_flight("decoys") == []
        assert storage.list_in_flight("absent") == []
        with storage.child("run") as run:
            ((obj,),) = [run.list_in_flight("checkpoint_1_1")]
            assert (obj.name, obj.target) == (name[len("run/"):], target[len("run/"):])
            (upload,) = in_flight_uploads(run)  # what `xla-ckpt ls` / `gc --in-flight` see
            assert (upload.target, upload.upload_id) == (obj.target, upload_id)
        # list() shows the committed objects only; the temp file is deleted by its name
        assert name not in storage.list("")
        assert "run/other.bin" in storage.list("run")
        storage.delete(name)
        assert storage.list_in_flight() == []
    assert not [f for f in _all_files(root) if LOCK_NAME in f]


def test_in_flight_names_are_this_backends_mark_exactly():
    ok = IN_FLIGHT_NAME.fullmatch("data-0123456789ab-state.safetensors.tmp-00112233aabb")
    assert ok is not None and (ok["target"], ok["upload_id"]) == (
        "data-0123456789ab-state.safetensors", "00112233aabb")
    for other in ["foo.tmp", "foo.tmp-", "foo.tmp-1", "foo.tmp-00112233AABB",
                  "foo.tmp-00112233aabb-part-00000", "foo.tmp-00112233aabbc", ".tmp-00112233aabb"]:
        assert IN_FLIGHT_NAME.fullmatch(other) is None, other


def test_the_temp_file_of_a_write_carries_a_twelve_hex_upload_id(tmp_path, monkeypatch):
    seen = []
    real_open = os.open

    def spy(path, flags, mode=0o777, **kw):
        seen.append(os.fspath(path))
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(local.os, "open", spy)
    with LocalStorage(str(tmp_path), CFG) as st:
        st.write_atomic("ck/obj", [b"payload"])
    monkeypatch.undo()
    (tmp,) = [p for p in seen if TMP_MARK in p]
    m = IN_FLIGHT_NAME.fullmatch(os.path.basename(tmp))
    assert m is not None and m["target"] == "obj"


def test_no_lock_file_is_left_or_listed_and_deleted_folders_go(tmp_path):
    root = str(tmp_path)
    with LocalStorage(root, CFG) as st:
        st.write_atomic("run/ck/a", [b"1"])
        st.write_atomic("run/ck/b", [b"2"], if_generation_match=0)
        st.write_atomic("run/p", [b"3"])
        assert _all_files(root) == ["run/ck/a", "run/ck/b", "run/p"]
        st.delete("run/ck/a")
        st.delete("run/ck/b", if_generation_match=st.stat("run/ck/b").generation)
        assert not os.path.exists(os.path.join(root, "run", "ck"))  # its folder went too
        assert _all_files(root) == ["run/p"]


def test_a_lock_file_left_by_a_killed_process_is_taken_over_and_removed(tmp_path):
    root = str(tmp_path)
    _put(root, f"ck/{LOCK_NAME}", b"")
    with LocalStorage(root, CFG) as st:
        assert st.list("") == [] and st.list_in_flight("") == []
        st.write_atomic("ck/obj", [b"data"], if_generation_match=0)
        assert st.list("") == ["ck/obj"]
    assert _all_files(root) == ["ck/obj"]


def test_the_lock_name_is_reserved(tmp_path):
    with LocalStorage(str(tmp_path), CFG) as st:
        with pytest.raises(ValueError, match="reserved"):
            st.write_atomic(f"ck/{LOCK_NAME}", [b"x"])
        with pytest.raises(ValueError, match="reserved"):
            st.delete(LOCK_NAME)


@pytest.mark.parametrize("condition", ["none", "cas"])
def test_a_write_waits_while_another_holds_the_folder_lock(tmp_path, condition):
    """Between another writer's check and its rename nobody else replaces the object, with a
    precondition or without one."""
    with LocalStorage(str(tmp_path), CFG) as st:
        gen = st.write_atomic("ck/obj", [b"v1"]).generation
        expected = gen if condition == "cas" else None
        done = threading.Event()

        def write():
            st.write_atomic("ck/obj", [b"v2"], if_generation_match=expected)
            done.set()

        with folder_lock(os.path.join(str(tmp_path), "ck"), required=True):
            t = threading.Thread(target=write)
            t.start()
            assert not done.wait(0.5)             # its bytes are written, its rename waits
            assert st.read_bytes("ck/obj") == b"v1"
        t.join(10)
        assert done.is_set() and st.read_bytes("ck/obj") == b"v2"


def test_a_delete_waits_while_another_holds_the_folder_lock(tmp_path):
    with LocalStorage(str(tmp_path), CFG) as st:
        st.write_atomic("ck/obj", [b"v1"])
        t = threading.Thread(target=st.delete, args=("ck/obj",))
        with folder_lock(os.path.join(str(tmp_path), "ck"), required=True):
            t.start()
            t.join(0.5)
            assert t.is_alive() and st.exists("ck/obj")
        t.join(10)
        assert not st.exists("ck/obj")


def test_generations_come_from_stat_and_change_on_every_replace(tmp_path):
    with LocalStorage(str(tmp_path), CFG) as st:
        infos = [st.write_atomic("o", [b"same bytes"]) for _ in range(50)]
        gens = [i.generation or 0 for i in infos]
        assert all(gens)
        assert all(a < b for a, b in zip(gens, gens[1:], strict=False))  # within one clock tick
        assert st.stat("o").generation == gens[-1] == st.stat("o").generation
        assert st.stat("o").generation == os.stat(tmp_path / "o").st_mtime_ns


def test_a_replace_gives_a_later_generation_even_when_the_live_one_is_in_the_future(tmp_path):
    """The new file's own time would be earlier: it is set past the live one's."""
    with LocalStorage(str(tmp_path), CFG) as st:
        st.write_atomic("o", [b"1"])
        future = time.time_ns() + 3600 * 10**9
        os.utime(tmp_path / "o", ns=(future, future))
        assert st.stat("o").generation == future
        new = st.write_atomic("o", [b"2"], if_generation_match=future)
        assert new.generation is not None and new.generation > future
        assert st.stat("o").generation == new.generation
        with pytest.raises(PreconditionFailedError):
            st.write_atomic("o", [b"3"], if_generation_match=future)


def test_create_only_without_hard_links_still_refuses_an_existing_object(tmp_path, monkeypatch):
    def no_link(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(local.os, "link", no_link)
    with LocalStorage(str(tmp_path), CFG) as st:
        first = st.write_atomic("o", [b"first"], if_generation_match=0)
        with pytest.raises(PreconditionFailedError) as ei:
            st.write_atomic("o", [b"second"], if_generation_match=0)
        assert ei.value.actual_generation == first.generation
        assert st.read_bytes("o") == b"first"
    assert _all_files(str(tmp_path)) == ["o"]


def test_create_only_refuses_a_file_a_writer_without_the_lock_made_meanwhile(tmp_path,
                                                                              monkeypatch):
    """Another tool writes the file between the check and the publish: the hard link fails."""
    real_stamp = local.stamp

    def stamp_then_foreign_write(tmp, after):
        _put(str(tmp_path), "o", b"foreign")
        return real_stamp(tmp, after)

    monkeypatch.setattr(local, "stamp", stamp_then_foreign_write)
    with LocalStorage(str(tmp_path), CFG) as st:
        with pytest.raises(PreconditionFailedError) as ei:
            st.write_atomic("o", [b"ours"], if_generation_match=0)
        assert ei.value.actual_generation == st.stat("o").generation
        assert st.read_bytes("o") == b"foreign"
    assert _all_files(str(tmp_path)) == ["o"]


def test_without_file_locks_plain_writes_go_on_and_conditional_ones_are_refused(tmp_path,
                                                                                monkeypatch):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(local_lock.fcntl, "flock", no_locks)
    with LocalStorage(str(tmp_path), CFG) as st:
        info = st.write_atomic("ck/o", [b"plain"])
        assert st.read_bytes("ck/o") == b"plain"
        with pytest.raises(StorageError, match="no file locks") as ei:
            st.write_atomic("ck/o", [b"cas"], if_generation_match=info.generation)
        assert not isinstance(ei.value, PreconditionFailedError)
        with pytest.raises(StorageError, match="no file locks"):
            st.delete("ck/o", if_generation_match=info.generation)
        assert st.read_bytes("ck/o") == b"plain"
        st.delete("ck/o")
    assert _all_files(str(tmp_path)) == []


def test_a_write_goes_out_in_large_writes_with_small_buffers_gathered(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "WRITE_GROUP_BYTES", 4096)
    monkeypatch.setattr(local, "GATHER_BELOW_BYTES", 100)
    sizes: list[int] = []
    real_write = os.write

    def write(fd, data):
        if TMP_MARK in os.readlink(f"/proc/self/fd/{fd}"):
            sizes.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    data = os.urandom(10_000)
    pieces: list[memoryview | bytes] = [data[:1], b"", data[1:50], memoryview(data)[50:9000],
                                        memoryview(bytearray(data[9000:]))]
    info = LocalStorage(str(tmp_path)).write_atomic("a/b", pieces)
    assert info.size == len(data)
    with open(tmp_path / "a" / "b", "rb") as f:
        assert f.read() == data
    # two small buffers in one write; a large one cut into groups; then the last one
    assert sizes == [50, 4096, 4096, 8950 - 8192, 1000]
    assert not [t for t in threading.enumerate() if t.name == "xla_ckpt-writeback"]
