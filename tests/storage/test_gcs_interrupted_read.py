"""Ctrl-C during a large parallel read stops it at once (issue 25, defect 9: "Ctrl-C during a
large read waits for in-flight slices"; CASES C19 asks the same of uploads).

A checkpoint is read through the fault proxy throttled to a crawl (each 4 MiB slice would take
about 75 s), so the slices are in flight when SIGINT arrives.  The interrupt cancels them: their
connections are shut down (the proxy served only part of each slice, and no slice is asked for
again), and ``KeyboardInterrupt`` leaves the library promptly -- in this process, and in a real
worker process, which then exits.  The same cancellation stops the other slices when one fails.
The time bounds only catch a hang (waiting for the slices would take over a minute).
"""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import xla_ckpt
from xla_ckpt.errors import StoragePermissionError
from xla_ckpt.storage import StorageConfig
from xla_ckpt.storage.base import RangeRead
from xla_ckpt.testing.fault_proxy import Fault, Shaping, downloads

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "interrupted_read_worker.py")

SLICE = 4 << 20  # a checkpoint's crc32c chunk (slices are whole chunks)
CRAWL = Shaping(stream_mib_s=0.05)  # 256 KiB at once, then 256 KiB every 5 s per stream
CONFIG = StorageConfig(max_workers=4, slice_size_bytes=SLICE, initial_backoff_s=0.001,
                       max_backoff_s=0.01, retry_deadline_s=60.0)
NO_HANG_S = 5.0  # the library's part: an interrupt is raised within ~0.5 s; the slices: ~75 s
PROCESS_EXIT_S = 20.0  # a worker's exit after SIGINT (Python and torch tearing down, loaded VM)



@pytest.fixture(autouse=True)
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt here whatever this process inherited (see
    test_gcs_interrupted_upload.py); the previous disposition is put back afterwards."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def crawling_proxy(fault_proxy):
    fault_proxy.shaping = CRAWL
    yield fault_proxy
    fault_proxy.shaping = Shaping()


def _checkpoint(gcs_emulator, stem, mib=16):
    """A committed checkpoint of one ``mib`` MiB tensor, written straight to the emulator."""
    state = {"w": torch.arange(mib * SLICE // 4, dtype=torch.float32)}
    uri = gcs_emulator.uri(f"{stem}/ck")
    with gcs_emulator.storage() as direct:
        xla_ckpt.save(state, uri, storage=direct.child(f"{stem}/ck"))
    return uri, state


def _data_gets(proxy):
    return proxy.records(downloads("data-"))


def _when_slices_flow(proxy, n, then):
    """In a thread: once ``n`` data slices have started to arrive, call ``then()``."""
    def watch():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if sum(1 for r in _data_gets(proxy) if r.body_bytes > 0) >= n:
                then()
                return
            time.sleep(0.01)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _interrupt_main_thread(marks):
    marks["signal"] = time.monotonic()
    ident = threading.main_thread().ident
    assert ident is not None
    signal.pthread_kill(ident, signal.SIGINT)


def _assert_slices_stopped(proxy):
    """At least 4 data slices (one per I/O thread) were in flight, each was asked for once, and
    none was served whole: the reads stopped, and none was retried."""
    gets = _data_gets(proxy)
    ranges = [r.range for r in gets]
    assert len(gets) >= 4 and len(set(ranges)) == len(ranges), ranges  # no slice asked again
    assert all(r.body_bytes < SLICE for r in gets), [(r.range, r.body_bytes) for r in gets]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["load", "read_ranges"])
def test_ctrl_c_during_a_parallel_read_stops_the_slices_in_flight(
        crawling_proxy, gcs_emulator, stem, monkeypatch, how):
    uri, _ = _checkpoint(gcs_emulator, stem)
    marks: dict[str, float] = {}
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", crawling_proxy.url)
    watcher = _when_slices_flow(crawling_proxy, 4, lambda: _interrupt_main_thread(marks))
    with pytest.raises(KeyboardInterrupt):
        if how == "load":
            xla_ckpt.load(uri, config=CONFIG)
        else:
            with crawling_proxy.storage(uri, CONFIG) as st:
                name = next(n for n in st.list("") if n.startswith("data-"))
                info = st.stat(name)
                buf = bytearray(info.size)
                st.read_ranges([RangeRead(name, 0, memoryview(buf), info.generation)])
    stopped_after_s = time.monotonic() - marks["signal"]
    watcher.join(5)
    assert stopped_after_s < NO_HANG_S
    _assert_slices_stopped(crawling_proxy)


@pytest.mark.timeout(120)
def test_a_failing_slice_stops_the_others_and_its_error_is_raised_at_once(
        crawling_proxy, gcs_emulator, stem):
    """The third slice is refused (403, never retried) while the others crawl: the error is
    raised without waiting for them, and they stop."""
    uri, _ = _checkpoint(gcs_emulator, stem)
    third = f"bytes={2 * SLICE}-"

    def refused(r):
        return r.is_download and "data-" in r.object_name and (r.range or "").startswith(third)

    crawling_proxy.inject(Fault.error(403), match=refused)
    with crawling_proxy.storage(uri, CONFIG) as st:
        name = next(n for n in st.list("") if n.startswith("data-"))
        info = st.stat(name)
        buf = bytearray(info.size)
        t0 = time.monotonic()
        with pytest.raises(StoragePermissionError) as ei:
            st.read_ranges([RangeRead(name, 0, memoryview(buf), info.generation)])
        assert time.monotonic() - t0 < NO_HANG_S
    assert "access denied (HTTP 403)" in str(ei.value)
    assert f"bytes [{2 * SLICE}, {3 * SLICE})" in str(ei.value)
    _assert_slices_stopped(crawling_proxy)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigint_stops_a_real_process_reading_a_checkpoint_promptly(
        crawling_proxy, gcs_emulator, gcs_env, stem, tmp_path):
    uri, _ = _checkpoint(gcs_emulator, stem)
    env = dict(gcs_env, STORAGE_EMULATOR_HOST=crawling_proxy.url)
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, WORKER, uri], env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 90
        while sum(1 for r in _data_gets(crawling_proxy) if r.body_bytes > 0) < 4:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the worker did not start reading (rc {proc.poll()}):\n"
                            f"{log_path.read_text()}")
            time.sleep(0.02)
        t_signal = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
        exited_after_s = time.monotonic() - t_signal
    finally:
        if proc.poll() is None:
            proc.kill()
    log = log_path.read_text()
    assert rc == -signal.SIGINT, log   # an uncaught KeyboardInterrupt, not a crash or a hang
    assert "KeyboardInterrupt" in log and "FINISHED" not in log
    (line,) = [x for x in log.splitlines() if x.startswith("INTERRUPTED ")]
    assert float(line.split()[1]) - t_signal < NO_HANG_S, log   # the library let go promptly
    assert exited_after_s < PROCESS_EXIT_S, log
    gets = _data_gets(crawling_proxy)
    assert len(gets) == 4 and all(r.body_bytes < SLICE for r in gets)
