"""Short and range-ignoring answers to GCS reads are transient faults, never data.

Issue "Ranged reads answered 200 and short": a ranged GET answered ``200``
without ``Content-Range`` and 7 bytes short was a ``StorageError`` at once
("the service ignored the Range header"), or at byte 0 a false
``CheckpointCorruptError`` ("truncated ... object has 65529 bytes" for a
196,609-byte object just stat'ed); an un-ranged ``read_bytes`` of a 1,000-byte
object answered with 993 bytes and no ``X-Goog-Hash`` returned the 993 bytes.

The emulator answers every ranged GET with a right ``206`` and every un-ranged
one with ``X-Goog-Hash``, and the fault proxy keeps both (its ``Fault.short``
cuts ``Content-Length`` only).  So the answers of the issue are made by
:class:`_Mangler`: a forwarding proxy in front of the real emulator that
rewrites the answer to chosen media GETs; stats and every other request are
the emulator's own.
"""

from __future__ import annotations

import http.client
import http.server
import logging
import random
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit

import pytest

from xla_ckpt.errors import CheckpointCorruptError, StorageError
from xla_ckpt.storage import StorageConfig
from xla_ckpt.storage.gcs import GCSStorage
from xla_ckpt.testing.fault_proxy import Fault, downloads

pytestmark = pytest.mark.timeout(60)

SLICE = 64 * 1024
MAX_ATTEMPTS = 4
CFG = StorageConfig(max_workers=4, slice_size_bytes=SLICE, max_attempts=MAX_ATTEMPTS,
                    initial_backoff_s=0.001, max_backoff_s=0.01, retry_deadline_s=10.0)

BIG = random.Random(196_609).randbytes(196_609)   # 3 slices and 1 byte
SMALL = random.Random(1000).randbytes(1000)       # one un-ranged GET (smaller than a slice)

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
               "trailers", "transfer-encoding", "upgrade", "content-length"}


@dataclass(frozen=True)
class Answer:
    """What :class:`_Mangler` sends instead of the emulator's answer to one media GET.

    Always HTTP 200 without ``Content-Range``.  ``whole``: the whole object
    (the ``Range`` header is not forwarded: a service that ignores it), else
    the asked bytes (a ``206`` sent as ``200``).  ``drop``: bytes left off the
    end, ``Content-Length`` cut to match.  ``hash``: keep ``X-Goog-Hash``.
    ``stored_length``: send ``x-goog-stored-content-length`` (the object's
    size) as real GCS does; the emulator does not.
    """

    whole: bool = True
    drop: int = 0
    hash: bool = True
    stored_length: bool = False


@dataclass(frozen=True)
class Seen:
    """One request the mangler served."""

    method: str
    path: str
    query: str
    range: str | None
    status: int
    body_bytes: int
    mangled: bool

    @property
    def is_media(self) -> bool:
        return self.method == "GET" and "alt=media" in self.query

    @property
    def is_stat(self) -> bool:
        return self.method == "GET" and "/o/" in self.path and not self.is_media


class _QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass   # the client drops connections on purpose (a 200 it does not read to the end)


class _Mangler:
    """Forwarding proxy on 127.0.0.1 (free port) in front of the emulator; see the module doc."""

    def __init__(self, upstream: str) -> None:
        u = urlsplit(upstream)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.log: list[Seen] = []
        self._rules: list[tuple[Answer, Callable[[str | None], bool], int]] = []
        self._lock = threading.Lock()
        mangler = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format, *args):  # noqa: A002 - stdlib signature
                pass

            def do_GET(self):
                mangler._serve(self)

            do_POST = do_PUT = do_DELETE = do_PATCH = do_GET

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def inject(self, answer: Answer, *, times: int = 1,
               match: Callable[[str | None], bool] = lambda rng: True) -> None:
        """Send ``answer`` to the next ``times`` media GETs whose Range header ``match`` accepts."""
        with self._lock:
            self._rules.append((answer, match, times))

    def media(self) -> list[Seen]:
        with self._lock:
            return [s for s in self.log if s.is_media]

    def stats(self) -> list[Seen]:
        with self._lock:
            return [s for s in self.log if s.is_stat]

    def _choose(self, asked: str | None) -> Answer | None:
        with self._lock:
            for i, (answer, match, times) in enumerate(self._rules):
                if match(asked):
                    if times <= 1:
                        del self._rules[i]
                    else:
                        self._rules[i] = (answer, match, times - 1)
                    return answer
        return None

    def _serve(self, h: http.server.BaseHTTPRequestHandler) -> None:
        n = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(n) if n else b""
        split = urlsplit(h.path)
        asked = h.headers.get("Range")
        answer = self._choose(asked) \
            if h.command == "GET" and "alt=media" in split.query else None
        headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP_BY_HOP}
        if answer is not None and answer.whole:
            headers.pop("Range", None)
        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        try:
            conn.request(h.command, h.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            status, reason, out_headers, payload = (resp.status, resp.reason, resp.getheaders(),
                                                    resp.read())
        finally:
            conn.close()
        object_size: int | None = len(payload) if status == 200 else None
        if answer is not None and status in (200, 206):
            kept = []
            for k, v in out_headers:
                if k.lower() == "content-range":
                    object_size = int(v.rsplit("/", 1)[1])
                elif k.lower() != "x-goog-hash" or answer.hash:
                    kept.append((k, v))
            if answer.stored_length and object_size is not None:
                kept.append(("x-goog-stored-content-length", str(object_size)))
            out_headers, status, reason = kept, 200, "OK"
            payload = payload[:max(0, len(payload) - answer.drop)]
        with self._lock:   # logged before it is sent: the client may act on it at once
            self.log.append(Seen(h.command, split.path, split.query, asked, status, len(payload),
                                 answer is not None))
        h.send_response_only(status, reason)
        for k, v in out_headers:
            if k.lower() not in _HOP_BY_HOP:
                h.send_header(k, v)
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        h.wfile.write(payload)
        h.wfile.flush()


@pytest.fixture
def stem(gcs_emulator):
    s = f"t-{uuid.uuid4().hex[:12]}"
    with gcs_emulator.storage(s, CFG) as direct:
        direct.write_atomic("big", [BIG])
        direct.write_atomic("small", [SMALL])
    yield s
    gcs_emulator.delete_prefix(s + "/")


@pytest.fixture
def mangler(gcs_emulator):
    m = _Mangler(gcs_emulator.host)
    yield m
    m.close()


@pytest.fixture
def st(mangler, gcs_emulator, stem):
    with GCSStorage(gcs_emulator.uri(stem), CFG, endpoint=mangler.url) as s:
        yield s


def _unranged(rng):
    return rng is None


def _ranges(seen):
    return [(s.range, s.status, s.body_bytes, s.mangled) for s in seen]


# ---- a ranged GET answered 200, 7 bytes short -----------------------------------------------
@pytest.mark.parametrize("pinned", [True, False], ids=["stat-first", "no-stat"])
def test_ranged_200_seven_bytes_short_at_byte_0_resumes_from_the_last_good_byte(
        st, mangler, caplog, pinned):
    caplog.set_level(logging.INFO, logger="xla_ckpt.storage.gcs.reads")
    gen = st.stat("big").generation if pinned else None
    assert len(mangler.stats()) == int(pinned)
    mangler.inject(Answer(whole=False, drop=7))
    out = bytearray(SLICE)
    st.read_range("big", 0, memoryview(out), gen)
    assert bytes(out) == BIG[:SLICE]
    assert _ranges(mangler.media()) == [(f"bytes=0-{SLICE - 1}", 200, SLICE - 7, True),
                                        (f"bytes={SLICE - 7}-{SLICE - 1}", 206, 7, False)]
    # Without a stat before, the read asked for the object's size (not the short answer's).
    assert len(mangler.stats()) == 1
    # The answer said it was short (Content-Length): the rest is asked for at once, no retry.
    assert st.retries.total == 0
    (note,) = [r.getMessage() for r in caplog.records if "short answer" in r.getMessage()]
    assert (f"{SLICE - 7} of the {SLICE} bytes asked for from byte 0 of an object of 196609 "
            "bytes (stat)") in note


@pytest.mark.parametrize("answer", [Answer(whole=False, drop=7), Answer(whole=True, drop=7),
                                    Answer(whole=True)], ids=["range-7", "whole-7", "whole"])
def test_ranged_200_at_a_middle_offset_is_retried_never_taken_as_the_bytes(st, mangler, answer):
    """A 200 to a read from byte > 0 is re-asked for, even when it carries the whole object."""
    gen = st.stat("big").generation
    mangler.inject(answer)
    out = bytearray(SLICE)
    st.read_range("big", SLICE, memoryview(out), gen)
    assert bytes(out) == BIG[SLICE:2 * SLICE]
    sent = {Answer(whole=False, drop=7): SLICE - 7, Answer(whole=True, drop=7): len(BIG) - 7,
            Answer(whole=True): len(BIG)}[answer]
    rng = f"bytes={SLICE}-{2 * SLICE - 1}"
    assert _ranges(mangler.media()) == [(rng, 200, sent, True), (rng, 206, SLICE, False)]
    (event,) = st.retries.events()
    assert "ignored the Range header" in event.cause and f"sent {sent} bytes" in event.cause


def test_ranged_200_with_the_whole_object_at_byte_0_is_used_without_a_retry(st, mangler):
    gen = st.stat("big").generation
    mangler.inject(Answer(whole=True))
    out = bytearray(SLICE)
    st.read_range("big", 0, memoryview(out), gen)
    assert bytes(out) == BIG[:SLICE]
    assert _ranges(mangler.media()) == [(f"bytes=0-{SLICE - 1}", 200, len(BIG), True)]
    assert st.retries.total == 0


def test_every_slice_of_a_sliced_read_answered_200_short_is_completed(st, mangler):
    """read_bytes of the 196,609-byte object: 4 slices, each first answered 200, 7 short."""
    for first in range(0, len(BIG), SLICE):    # the first request of each slice
        rng = f"bytes={first}-{min(first + SLICE, len(BIG)) - 1}"
        mangler.inject(Answer(whole=False, drop=7), match=lambda r, rng=rng: r == rng)
    assert st.read_bytes("big") == BIG
    media = mangler.media()
    # One un-ranged GET (too large for one request: not read), 4 bad answers, one more request each.
    assert media[0].range is None and not media[0].mangled
    ranged = sorted(_ranges(media[1:]))
    assert ranged == sorted([
        ("bytes=0-65535", 200, SLICE - 7, True), ("bytes=65529-65535", 206, 7, False),
        ("bytes=65536-131071", 200, SLICE - 7, True), ("bytes=65536-131071", 206, SLICE, False),
        ("bytes=131072-196607", 200, SLICE - 7, True), ("bytes=131072-196607", 206, SLICE, False),
        ("bytes=196608-196608", 200, 0, True), ("bytes=196608-196608", 206, 1, False)])
    # Slice 0 resumed at once (its answer said it was short); the 3 others retried once each.
    assert st.retries.total == 3


# ---- an un-ranged read answered 993 of 1,000 bytes without X-Goog-Hash ---------------------------
@pytest.mark.parametrize("stored_length", [False, True], ids=["stat", "stored-length-header"])
def test_whole_read_short_without_hash_is_checked_against_the_size_and_read_again(
        st, mangler, stored_length):
    mangler.inject(Answer(drop=7, hash=False, stored_length=stored_length), match=_unranged)
    assert st.read_bytes("small") == SMALL
    assert _ranges(mangler.media()) == [(None, 200, 993, True), ("bytes=0-999", 206, 1000, False)]
    # Without x-goog-stored-content-length the size comes from one stat, reused by the re-read;
    # with it, the re-read's own stat is the only one.
    assert len(mangler.stats()) == 1


def test_whole_read_without_hash_of_the_right_size_is_used_after_a_stat(st, mangler):
    mangler.inject(Answer(hash=False), match=_unranged)
    assert st.read_bytes("small") == SMALL
    assert _ranges(mangler.media()) == [(None, 200, 1000, True)]
    assert len(mangler.stats()) == 1


# ---- short on every attempt: the error names the real sizes, no hang --------------------------
def test_ranged_read_short_on_every_attempt_fails_with_the_real_sizes(st, mangler, gcs_emulator,
                                                                      stem):
    gen = st.stat("big").generation
    mangler.inject(Answer(whole=True, drop=7), times=1000)
    out = bytearray(len(BIG))
    t0 = time.monotonic()
    with pytest.raises(StorageError) as ei:
        st.read_range("big", 0, memoryview(out), gen)
    assert time.monotonic() - t0 < 5
    assert not isinstance(ei.value, CheckpointCorruptError)   # the object is whole
    msg = str(ei.value)
    uri = f"gs://{gcs_emulator.bucket}/{stem}/big"
    assert msg.startswith(f"read {uri} bytes [0, 196609) (generation {gen}): gave up after "
                          f"{MAX_ATTEMPTS} failed attempts")
    assert msg.endswith(f". Expected 196609 bytes [0, 196609) of {uri}, got 196602; the object has "
                        "196609 bytes (stat).")
    assert "sent 196602 bytes from byte 0 of an object of 196609 bytes" in msg
    # First answer: 196,602 good bytes; then 200s to "bytes=196602-196608", none used.
    assert _ranges(mangler.media()) == (
        [("bytes=0-196608", 200, 196602, True)]
        + [("bytes=196602-196608", 200, 196602, True)] * MAX_ATTEMPTS)
    assert st.retries.total == MAX_ATTEMPTS - 1   # the last failure is the error


def test_whole_read_short_without_hash_on_every_attempt_fails_with_the_real_sizes(
        st, mangler, gcs_emulator, stem):
    mangler.inject(Answer(drop=7, hash=False), times=1000)
    with pytest.raises(StorageError) as ei:
        st.read_bytes("small")
    assert not isinstance(ei.value, CheckpointCorruptError)
    uri = f"gs://{gcs_emulator.bucket}/{stem}/small"
    assert str(ei.value).endswith(f". Expected 1000 bytes [0, 1000) of {uri}, got 993; the object "
                                  "has 1000 bytes (stat).")
    assert _ranges(mangler.media()) == (
        [(None, 200, 993, True), ("bytes=0-999", 200, 993, True)]
        + [("bytes=993-999", 200, 993, True)] * MAX_ATTEMPTS)


def test_206_short_on_every_attempt_fails_with_the_real_sizes(fault_proxy, gcs_emulator, stem):
    """The fault proxy's own short answers (Content-Length cut, Content-Range kept), every time."""
    with fault_proxy.storage(gcs_emulator.uri(stem), CFG) as st:
        gen = st.stat("small").generation
        fault_proxy.reset_log()
        fault_proxy.inject(Fault.short(7), match=downloads("small"), times=1000)
        with pytest.raises(StorageError) as ei:
            st.read_range("small", 0, memoryview(bytearray(1000)), gen)
    uri = f"gs://{gcs_emulator.bucket}/{stem}/small"
    assert str(ei.value).endswith(f". Expected 1000 bytes [0, 1000) of {uri}, got 993; the object "
                                  "has 1000 bytes (stat).")
    recs = fault_proxy.records(downloads("small"))
    assert [(r.range, r.body_bytes) for r in recs] == (
        [("bytes=0-999", 993)] + [("bytes=993-999", 0)] * MAX_ATTEMPTS)


# ---- a 200 that shows the object really is shorter: corrupt at once, no retry -------------------
@pytest.mark.parametrize("offset", [0, 500])
def test_range_ignored_on_a_truly_short_object_is_truncation_named_by_stat(
        st, mangler, gcs_emulator, stem, offset):
    mangler.inject(Answer(whole=True), times=1000)
    with pytest.raises(CheckpointCorruptError) as ei:
        st.read_range("small", offset, memoryview(bytearray(1500)))
    assert str(ei.value) == (f"read gs://{gcs_emulator.bucket}/{stem}/small bytes [{offset}, "
                             f"{offset + 1500}): truncated: expected at least {offset + 1500} "
                             "bytes, object has 1000 bytes")
    assert len(mangler.media()) == 1 and len(mangler.stats()) == 1


def test_one_request_read_cut_short_on_every_attempt_fails_with_the_real_size(
        fault_proxy, gcs_emulator, stem):
    """A body that ends (FIN) after 993 of its 1,000 bytes every time: re-fetched, then an error."""
    with fault_proxy.storage(gcs_emulator.uri(stem), CFG) as st:
        fault_proxy.inject(Fault.reset(after_bytes=993, rst=False), match=downloads("small"),
                           times=1000)
        with pytest.raises(StorageError) as ei:
            st.read_bytes("small")
    assert not isinstance(ei.value, CheckpointCorruptError)
    msg = str(ei.value)
    uri = f"gs://{gcs_emulator.bucket}/{stem}/small"
    assert msg.startswith(f"read {uri}: gave up after {MAX_ATTEMPTS} failed attempts")
    assert "last error: body ended after 993 of 1000 bytes" in msg
    assert msg.endswith(". The object has 1000 bytes (stat).")
    recs = fault_proxy.records(downloads("small"))
    assert [(r.range, r.body_bytes) for r in recs] == [(None, 993)] * MAX_ATTEMPTS
