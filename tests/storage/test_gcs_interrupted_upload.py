"""Interrupted composite uploads on gs:// (the emulator): Ctrl-C at the set-up point, while
parts upload, a second Ctrl-C during the cleanup, a storage closed under a running write, and
real processes stopped by SIGINT (once, twice; a save on the main thread, an async manager save
with and without its ``with`` block).  Each leaves no ``.tmp-`` object, and the process stops
promptly (a generous no-hang bound, not a speed figure)."""

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from xla_ckpt.errors import StorageError
from xla_ckpt.storage import StorageConfig
from xla_ckpt.storage.gcs import TMP_MARK, in_flight, writes
from xla_ckpt.testing.fault_proxy import FaultProxy
from xla_ckpt.testing.fault_proxy.shaping import Shaping

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "interrupted_upload_worker.py")

FAST: dict[str, Any] = dict(initial_backoff_s=0.001, max_backoff_s=0.01, retry_deadline_s=20.0)
SMALL_PARTS = StorageConfig(max_workers=4, slice_size_bytes=64 * 1024, max_attempts=3,
                            parallel_upload_threshold_bytes=100_000,
                            upload_part_size_bytes=32 * 1024, **FAST)
NO_HANG_S = 5.0  # a bound that only catches a hang (the stop itself takes well under 1 s)
PROCESS_EXIT_S = 20.0
"""A bound on a real worker process exiting after SIGINT that only catches a hang: the library's
part (interrupt, parts deleted, close) is done within 0.1 s, but Python and torch tearing the
process down took 5.6-6.3 s on a loaded 2-core VM (2 of 30 runs over the 5 s NO_HANG_S)."""



def tmp_objects(emu, stem):
    return [n for n in emu.object_names(stem + "/") if TMP_MARK in n]


def settle_tmp_objects(emu, stem, within_s=2.0):
    """The in-flight objects under ``stem`` once none is left, or after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        left = tmp_objects(emu, stem)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt here, as at an interactive prompt, whatever this process
    inherited.  A suite started in the background of a non-interactive shell (as a CI script
    may start it) inherits SIGINT ignored: Python then installs no handler, the kernel drops
    the signal these tests send, and the write (rightly) finishes instead of raising.  The
    previous disposition is put back afterwards."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def interrupt_main_thread():
    """A real SIGINT to the main thread (wakes it from a blocking wait, as Ctrl-C does)."""
    ident = threading.main_thread().ident
    assert ident is not None
    signal.pthread_kill(ident, signal.SIGINT)


@pytest.fixture
def slow_bodies(monkeypatch):
    """Part bodies go out in 8 KiB blocks with a pause before each (an upload in progress)."""
    read = writes._BodyReader.read

    def slow(self, n=-1):
        time.sleep(0.02)
        return read(self, n)

    monkeypatch.setattr(writes._BodyReader, "read", slow)
    monkeypatch.setattr(writes, "SEND_BLOCK_BYTES", 8 * 1024)


@pytest.mark.parametrize("where", ["creating-the-pool", "third-submit"])
def test_interrupt_at_the_set_up_point_leaves_no_parts(gcs_emulator, stem, monkeypatch, where):
    old, new = os.urandom(150_000), os.urandom(300_000)   # new: 10 parts of 32 KiB
    with gcs_emulator.storage(stem, SMALL_PARTS) as st:
        st.write_atomic("obj", [old])
        if where == "creating-the-pool":
            def uploads(self):
                raise KeyboardInterrupt

            monkeypatch.setattr(in_flight._GCSInFlight, "_uploads", uploads)
        else:
            submit = in_flight._DaemonPool.submit
            calls = []

            def third_raises(self, fn, *args):
                calls.append(fn)
                if len(calls) == 3:
                    raise KeyboardInterrupt  # two parts are on their way up already
                return submit(self, fn, *args)

            monkeypatch.setattr(in_flight._DaemonPool, "submit", third_raises)
        with pytest.raises(KeyboardInterrupt):
            st.write_atomic("obj", [new])
        monkeypatch.undo()
        assert settle_tmp_objects(gcs_emulator, stem) == []
        assert st.read_bytes("obj") == old
        st.write_atomic("obj", [new])  # the storage still works
        assert st.read_bytes("obj") == new
    assert gcs_emulator.object_names(stem + "/") == [f"{stem}/obj"]


def _interrupt_after_parts(monkeypatch, k, also_during_cleanup=False):
    """SIGINT the main thread once ``k`` parts were uploaded; optionally again from the cleanup.
    Returns a dict receiving the time of the first signal.

    The signal goes out from inside the k-th part upload, before its future resolves: the
    write has parts in flight then and cannot have composed, whatever the load."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # ctrl_c_raises
    upload_part = writes._GCSWrites._upload_part
    delete_one = in_flight._GCSInFlight._delete_one_quietly
    done: list[str] = []
    lock = threading.Lock()
    marks: dict[str, float] = {}

    def counting(self, part, up=None):
        crc = upload_part(self, part, up)
        with lock:
            done.append(part.name)
            if len(done) == k:
                marks["signal"] = time.monotonic()
                interrupt_main_thread()
        return crc

    def deleting(self, full):
        with lock:
            second = also_during_cleanup and "second" not in marks
            if second:
                marks["second"] = time.monotonic()
        if second:
            interrupt_main_thread()  # Ctrl-C again while the parts are being deleted
        return delete_one(self, full)

    monkeypatch.setattr(writes._GCSWrites, "_upload_part", counting)
    monkeypatch.setattr(in_flight._GCSInFlight, "_delete_one_quietly", deleting)
    return marks


@pytest.mark.parametrize("how", ["bodies-being-sent", "answers-pending", "second-ctrl-c"])
def test_ctrl_c_while_parts_upload_deletes_them_and_raises(gcs_emulator, stem, monkeypatch,
                                                         request, how):
    old, new = os.urandom(150_000), os.urandom(40 * 32 * 1024)   # new: 40 parts
    proxy = None
    if how == "answers-pending":  # bodies are sent at once, each answer comes 0.1 s later
        proxy = FaultProxy(gcs_emulator.host, shaping=Shaping(first_byte_latency_s=0.1)).start()
        request.addfinalizer(proxy.stop)
        st = proxy.storage(gcs_emulator.uri(stem), SMALL_PARTS)
    else:
        request.getfixturevalue("slow_bodies")
        st = gcs_emulator.storage(stem, SMALL_PARTS)
    with st:
        st.write_atomic("obj", [old])
        marks = _interrupt_after_parts(monkeypatch, 6, also_during_cleanup=how == "second-ctrl-c")
        with pytest.raises(KeyboardInterrupt):
            st.write_atomic("obj", [new])
        stopped_after_s = time.monotonic() - marks["signal"]
        monkeypatch.undo()
        assert stopped_after_s < NO_HANG_S
        if how == "second-ctrl-c":
            assert "second" in marks  # it came during the cleanup, which still finished
        assert settle_tmp_objects(gcs_emulator, stem) == []
        assert st.read_bytes("obj") == old   # the previous object is untouched
        st.write_atomic("obj", [new])
        assert st.read_bytes("obj") == new
    assert gcs_emulator.object_names(stem + "/") == [f"{stem}/obj"]


def _write_in_background(st, gcs_emulator, stem):
    """Start a composite write of 40 small parts in a thread; return once at least 3 of its
    parts are in flight.  Returns the thread and the list its exception (if any) lands in."""
    data = os.urandom(40 * 32 * 1024)
    failure: list[BaseException] = []

    def write():
        try:
            st.write_atomic("ck/data", [data])
        except BaseException as e:  # noqa: BLE001 - checked by the caller
            failure.append(e)

    t = threading.Thread(target=write)
    t.start()
    deadline = time.monotonic() + 30
    while len(tmp_objects(gcs_emulator, stem)) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(tmp_objects(gcs_emulator, stem)) >= 3
    return t, failure


def test_closing_the_storage_abandons_a_running_write_and_deletes_its_parts(
        gcs_emulator, stem, slow_bodies):
    st = gcs_emulator.storage(stem, SMALL_PARTS)
    t, failure = _write_in_background(st, gcs_emulator, stem)
    t0 = time.monotonic()
    st.close()
    assert time.monotonic() - t0 < NO_HANG_S
    t.join(NO_HANG_S)
    assert not t.is_alive()
    assert len(failure) == 1 and isinstance(failure[0], StorageError)
    assert "abandoned, the storage was closed while it ran" in str(failure[0])
    assert settle_tmp_objects(gcs_emulator, stem) == []
    assert gcs_emulator.object_names(stem + "/") == []
    with pytest.raises(StorageError, match="the storage was closed"):
        st.write_atomic("other", [b"x"])


@pytest.mark.parametrize("handler", ["default", "own"])
def test_ctrl_c_while_closing_under_a_running_write_is_raised_after_the_cleanup(
        gcs_emulator, stem, slow_bodies, monkeypatch, handler):
    """A Ctrl-C that lands while ``close()`` abandons a running write is not lost: the parts
    are still deleted and the storage released, then ``close()`` raises KeyboardInterrupt
    (with Python's handler, and with one of the program's own that raises it)."""
    if handler == "own":
        def own(_signum, _frame):
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, own)   # ctrl_c_raises puts the previous one back
    st = gcs_emulator.storage(stem, SMALL_PARTS)
    delete_one = in_flight._GCSInFlight._delete_one_quietly
    sent = threading.Event()

    def deleting(self, full):
        # only close()'s cleanup threads, which live while close() waits for them: the signal
        # lands in that wait, never before or after it
        if threading.current_thread().name.startswith("xla_ckpt-cleanup") \
                and not sent.is_set():
            sent.set()
            interrupt_main_thread()  # Ctrl-C while the abandoned write's parts are deleted
        return delete_one(self, full)

    t, failure = _write_in_background(st, gcs_emulator, stem)
    monkeypatch.setattr(in_flight._GCSInFlight, "_delete_one_quietly", deleting)
    # no cut-off of the cleanup under load: close() waits until its cleanup threads are done
    monkeypatch.setattr(in_flight, "CLEANUP_ON_INTERRUPT_S", 60.0)
    with pytest.raises(KeyboardInterrupt):
        st.close()
    monkeypatch.undo()
    assert sent.is_set()
    t.join(NO_HANG_S)
    assert not t.is_alive()
    assert len(failure) == 1 and isinstance(failure[0], StorageError)
    assert settle_tmp_objects(gcs_emulator, stem) == []
    assert gcs_emulator.object_names(stem + "/") == []
    with pytest.raises(StorageError, match="the storage was closed"):
        st.write_atomic("other", [b"x"])   # the close itself was finished


def test_list_in_flight_reports_parts_with_target_id_size_and_time(gcs_emulator, stem):
    t0 = time.time()
    with gcs_emulator.storage(stem) as st:
        st.write_atomic("ck/data-0123456789ab-state.safetensors", [b"d" * 10])
        st.write_atomic(f"ck/data-0123456789ab-state.safetensors{TMP_MARK}aaaaaaaaaaaa-part-00000",
                        [b"p" * 7])
        st.write_atomic(f"ck/data-0123456789ab-state.safetensors{TMP_MARK}aaaaaaaaaaaa-part-00001",
                        [b"p" * 5])
        st.write_atomic(f"ck/x{TMP_MARK}aaaaaaaaaaaa-compose-0-00000", [b"c" * 3])
        st.write_atomic(f"ck/notes{TMP_MARK}1", [b"n"])            # not this backend's mark
        st.write_atomic(f"ckx/y{TMP_MARK}bbbbbbbbbbbb-part-00000", [b"o"])   # another folder
        got = st.list_in_flight("ck")
        assert [(o.name, o.target, o.upload_id, o.size) for o in got] == [
            (f"ck/data-0123456789ab-state.safetensors{TMP_MARK}aaaaaaaaaaaa-part-00000",
             "ck/data-0123456789ab-state.safetensors", "aaaaaaaaaaaa", 7),
            (f"ck/data-0123456789ab-state.safetensors{TMP_MARK}aaaaaaaaaaaa-part-00001",
             "ck/data-0123456789ab-state.safetensors", "aaaaaaaaaaaa", 5),
            (f"ck/x{TMP_MARK}aaaaaaaaaaaa-compose-0-00000", "ck/x", "aaaaaaaaaaaa", 3)]
        assert all(o.created_unix_s is not None and t0 - 5 < o.created_unix_s < time.time() + 5
                   for o in got)
        assert [o.name for o in st.child("ck").list_in_flight()] == [
            o.name[len("ck/"):] for o in got]
        assert len(st.list_in_flight()) == 4
        assert st.lists_in_flight


def _start_worker(mode, uri, env, log_path):
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, WORKER, mode, uri], env=env,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    log.close()
    return proc


def _wait_for_parts(proc, emu, stem, n, log_path, timeout_s=90.0):
    deadline = time.monotonic() + timeout_s
    while len(tmp_objects(emu, stem)) < n:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            with open(log_path) as f:
                pytest.fail(f"the worker did not start uploading (rc {proc.poll()}):\n{f.read()}")
        time.sleep(0.02)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode, signals", [("save", 1), ("save", 2), ("manager", 1),
                                           ("manager", 2), ("manager-no-close", 1)])
def test_sigint_stops_a_real_process_promptly_and_leaves_no_parts(
        gcs_emulator, gcs_env, stem, tmp_path, mode, signals):
    uri = gcs_emulator.uri(f"{stem}/run")
    log_path = tmp_path / "worker.log"
    proc = _start_worker(mode, uri, gcs_env, log_path)
    try:
        _wait_for_parts(proc, gcs_emulator, stem, 3, log_path)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        if signals == 2:
            time.sleep(0.05)
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        rc = proc.wait(30)
        exited_after_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = log_path.read_text()
    assert rc == -signal.SIGINT, log  # an uncaught KeyboardInterrupt, not a crash or a hang
    assert "KeyboardInterrupt" in log
    assert exited_after_s < PROCESS_EXIT_S, log
    assert settle_tmp_objects(gcs_emulator, stem, within_s=0.5) == []
    # nothing was committed, and no half object is visible
    assert [n for n in gcs_emulator.object_names(stem + "/") if "/manifest.json" in n
            or n.endswith(".safetensors")] == []
    if mode.startswith("manager"):  # the save given up is named (C27), however the loop ended
        assert f"[rank 0] abandoned the save of checkpoint {uri}/checkpoint_1_1: " in log, log
