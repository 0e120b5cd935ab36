"""A local GCS for tests and demos: gcp-storage-emulator as a subprocess on a free loopback port.

::

    with GCSEmulator() as emu:
        os.environ.update(emu.env())            # or pass emu.env() to child processes
        xla_ckpt.save(state, emu.uri("run/checkpoint_1"))

The emulator serves the GCS JSON API in memory (ranged reads, multipart and
resumable uploads, compose, listing); the real ``google-cloud-storage`` client
talks to it through ``STORAGE_EMULATOR_HOST``.  It is one single-threaded
Python process: put :class:`xla_ckpt.testing.fault_proxy.FaultProxy` in front
of it for latency, per-stream throughput caps and injected faults.

Its bucket is created with soft delete off (``retentionDurationSeconds: 0``),
so deleted objects free their memory at once.

Object generations behave as on GCS (:mod:`xla_ckpt.testing.gcs_semantics`, installed in the
emulator process): every write makes a new, larger generation; a read pinned to a
generation that is no longer live answers 404; ``ifGenerationMatch`` & co. answer 412 (304
for ``...NotMatch``) on uploads, compose, copy, delete and reads; media answers carry
``x-goog-generation``.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

if TYPE_CHECKING:
    from xla_ckpt.storage.base import StorageConfig
    from xla_ckpt.storage.gcs import GCSStorage

logger = logging.getLogger(__name__)

DEFAULT_BUCKET = "xla-ckpt-test"
DEFAULT_PROJECT = "xla-ckpt-test"

# Runs in the emulator process: a deeper listen backlog than socketserver's 5 (many parallel
# connections would otherwise wait for SYN retransmits), port 0 -> the real port is written
# to a file once the server listens; exits by itself when its parent process dies.  A request
# whose body ends before its Content-Length (the client died mid-upload) is dropped: the
# emulator would store the truncated bytes as an object, real GCS never does.  Then
# gcs_semantics.py (argv[3], loaded by path: importing the xla_ckpt package would load torch)
# makes it keep GCS's generation semantics.
_SERVE = r"""
import logging, os, socketserver, sys, threading, time
socketserver.TCPServer.request_queue_size = 256
parent = os.getppid()
def _orphan_watch():  # exit when the process that started us is gone (even after SIGKILL)
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)
threading.Thread(target=_orphan_watch, daemon=True).start()
logging.disable(logging.CRITICAL)
import gcp_storage_emulator.server as _server
from gcp_storage_emulator.server import create_server
_read_raw = _server._read_raw_data
def _read_whole_body(handler):  # real GCS never stores an upload whose body ended early
    want = handler.headers.get("Content-Length")
    data = _read_raw(handler)
    if want and len(data or b"") < int(want):
        handler.close_connection = True
        raise ConnectionAbortedError(f"request body ended after {len(data or b'')} of {want} bytes")
    return data
_server._read_raw_data = _read_whole_body
import importlib.util
_spec = importlib.util.spec_from_file_location("_xla_ckpt_gcs_semantics", sys.argv[3])
_semantics = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_semantics)
_semantics.install()  # generations, pinned reads, preconditions, x-goog-generation: as GCS
srv = create_server(sys.argv[1], 0, in_memory=True)
srv.start()
port = srv._api._httpd.server_address[1]
with open(sys.argv[2] + ".tmp", "w") as f:
    f.write(str(port))
import os
os.replace(sys.argv[2] + ".tmp", sys.argv[2])
while True:
    time.sleep(3600)
"""


_SEMANTICS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gcs_semantics.py")


class EmulatorError(RuntimeError):
    """The emulator did not start or answered an admin request with an error."""


class GCSEmulator:
    """``gcp-storage-emulator`` in a subprocess, with one bucket (see module docstring).

    Args:
        bucket: bucket created at start.
        project: project id the clients use (``GOOGLE_CLOUD_PROJECT`` in :meth:`env`).
        host: loopback address to bind.
        startup_timeout_s: how long to wait for the emulator to listen.

    Attributes:
        host: ``http://127.0.0.1:PORT``: the value for ``STORAGE_EMULATOR_HOST``.
        port: the TCP port.
        bucket: the bucket name.
    """

    def __init__(self, *, bucket: str = DEFAULT_BUCKET, project: str = DEFAULT_PROJECT,
                 host: str = "127.0.0.1", startup_timeout_s: float = 60.0) -> None:
        self.bucket = bucket
        self.project = project
        self._bind = host
        self.startup_timeout_s = startup_timeout_s
        self.port: int | None = None
        self._proc: subprocess.Popen | None = None
        self._tmpdir: tempfile.TemporaryDirectory | None = None
        self._finalizer: weakref.finalize | None = None

    # ---- lifecycle ---------------------------------------------------------------------
    @property
    def host(self) -> str:
        if self.port is None:
            raise EmulatorError("the emulator is not running; call start() or use `with`")
        return f"http://{self._bind}:{self.port}"

    def start(self) -> "GCSEmulator":
        """Start the subprocess, wait until it answers, create the bucket.

        Raises:
            EmulatorError: it exited or did not listen within ``startup_timeout_s``
                (the message carries the end of its log).
        """
        if self._proc is not None:
            return self
        self._tmpdir = tempfile.TemporaryDirectory(prefix="xla-ckpt-gcs-emulator-")
        port_file = os.path.join(self._tmpdir.name, "port")
        log_path = os.path.join(self._tmpdir.name, "emulator.log")
        log = open(log_path, "wb")
        env = dict(os.environ)
        env.pop("STORAGE_EMULATOR_HOST", None)
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVE, self._bind, port_file,
                                       _SEMANTICS_PATH],
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                      start_new_session=True)
        log.close()
        self._finalizer = weakref.finalize(self, _kill, self._proc)
        deadline = time.monotonic() + self.startup_timeout_s
        while not os.path.exists(port_file):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                tail = _tail(log_path)
                self.stop()
                raise EmulatorError(f"gcp-storage-emulator did not start (exit code "
                                    f"{self._proc.returncode if self._proc else None}); its log "
                                    f"ends with:\n{tail}")
            time.sleep(0.02)
        with open(port_file) as f:
            self.port = int(f.read().strip())
        self._request("GET", "/")
        self.create_bucket(self.bucket)
        logger.info("gcp-storage-emulator listening on %s (bucket %s)", self.host, self.bucket)
        return self

    def stop(self) -> None:
        """Stop the subprocess (SIGTERM, then SIGKILL after 5 s) and remove its files."""
        if self._proc is not None:
            _kill(self._proc)
            if self._finalizer is not None:
                self._finalizer.detach()
        self._proc = None
        self.port = None
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> "GCSEmulator":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- use ---------------------------------------------------------------------------
    def uri(self, path: str = "") -> str:
        """``gs://<bucket>/<path>``."""
        return f"gs://{self.bucket}/{path.strip('/')}" if path.strip("/") else f"gs://{self.bucket}"

    def unique_uri(self, stem: str = "t") -> str:
        """A fresh ``gs://<bucket>/<stem>-<random>`` prefix."""
        return self.uri(f"{stem}-{uuid.uuid4().hex[:12]}")

    def env(self) -> dict[str, str]:
        """Environment variables a process (or child process) needs to use this emulator."""
        return {"STORAGE_EMULATOR_HOST": self.host, "GOOGLE_CLOUD_PROJECT": self.project,
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def storage(self, path: str = "", config: "StorageConfig | None" = None) -> "GCSStorage":
        """A :class:`~xla_ckpt.storage.gcs.GCSStorage` rooted at ``gs://<bucket>/<path>``."""
        # Lazy: the GCS client stack (requests, google-auth) is for callers that talk GCS.
        from xla_ckpt.storage.gcs import GCSStorage  # noqa: PLC0415 - heavy, needed here only

        return GCSStorage(self.uri(path), config, endpoint=self.host, project=self.project)

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (if absent) with soft delete off."""
        status, _ = self._request("POST", f"/storage/v1/b?project={self.project}",
                                  {"name": name}, ok=(200, 409))
        self._request("PATCH", f"/storage/v1/b/{name}",
                      {"softDeletePolicy": {"retentionDurationSeconds": "0"}})

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object whose name starts with ``prefix`` (in-flight parts too); count."""
        names: list[str] = []
        token = None
        while True:
            q = f"/storage/v1/b/{self.bucket}/o?prefix={quote(prefix, safe='')}"
            if token:
                q += f"&pageToken={quote(token, safe='')}"
            _, doc = self._request("GET", q)
            names += [o["name"] for o in (doc or {}).get("items", [])]
            token = (doc or {}).get("nextPageToken")
            if not token:
                break
        for n in names:
            self._request("DELETE", f"/storage/v1/b/{self.bucket}/o/{quote(n, safe='')}",
                          ok=(200, 204, 404))
        return len(names)

    def object_names(self, prefix: str = "") -> list[str]:
        """Every object name under ``prefix``, in-flight parts included (for assertions)."""
        q = quote(prefix, safe="")
        _, doc = self._request("GET", f"/storage/v1/b/{self.bucket}/o?prefix={q}")
        return sorted(o["name"] for o in (doc or {}).get("items", []))

    def _request(self, method: str, path: str, body: dict | None = None,
                 ok: tuple[int, ...] = (200, 204)) -> tuple[int, Any]:
        conn = http.client.HTTPConnection(self._bind, self.port, timeout=30)
        try:
            data = json.dumps(body).encode() if body is not None else None
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        if resp.status not in ok:
            raise EmulatorError(f"emulator {method} {path} -> HTTP {resp.status}: {raw[:300]!r}")
        try:
            return resp.status, json.loads(raw) if raw else None
        except ValueError:
            return resp.status, None

    def __repr__(self) -> str:
        where = self.host if self.port else "stopped"
        return f"GCSEmulator({where}, bucket={self.bucket!r})"


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            return f.read()[-n:].decode("utf-8", "replace")
    except OSError:
        return "(no log)"
