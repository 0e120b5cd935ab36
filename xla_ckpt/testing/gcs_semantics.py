"""Object generations and request preconditions, as GCS has them, for ``gcp-storage-emulator``.

The emulator stores a ``generation`` on each object but ignores it everywhere else: it
answers a read pinned to a generation that was overwritten, applies writes and deletes
whatever their preconditions say, and sends no ``x-goog-generation``.  A client that
relies on generations (pinned ranged reads, create-only writes) could then pass its tests
and fail on GCS.  :func:`install` patches the emulator in its own process (the
:class:`~xla_ckpt.testing.gcs_emulator.GCSEmulator` launcher calls it before the server
starts), so every client -- direct, or through
:class:`~xla_ckpt.testing.fault_proxy.FaultProxy` -- sees the behaviour below.

Documented GCS behaviour implemented here (bucket without Object Versioning):

* **Generations** (https://cloud.google.com/storage/docs/metadata#generation-number,
  https://cloud.google.com/storage/docs/object-versioning): every write of an object
  (simple, multipart or resumable upload, compose, copy, rewrite, restore) makes a new
  generation, a number larger than any before it (a microsecond time stamp, as on GCS);
  its ``metageneration`` starts at 1 and grows with each metadata update (``PATCH``).
  The generation is fixed when the object is written -- for a resumable upload when the
  last byte arrives, not when the session starts -- and ``id`` and ``mediaLink`` carry it.
* **Reads pinned to a generation** (``?generation=N`` on a metadata or media ``GET``,
  ``DELETE``, ``PATCH``; ``sourceGeneration`` on copy/rewrite; ``sourceObjects[].generation``
  on compose): without versioning only the live generation exists, so any other ``N``
  (overwritten, deleted) answers **404 Not Found**.  Soft-deleted reads
  (``softDeleted=true``) keep the emulator's own handling.
* **Preconditions** (https://cloud.google.com/storage/docs/request-preconditions,
  https://cloud.google.com/storage/docs/generations-preconditions): the query parameters
  ``ifGenerationMatch``, ``ifGenerationNotMatch``, ``ifMetagenerationMatch``,
  ``ifMetagenerationNotMatch`` on uploads (``/upload/storage/v1/b/<b>/o``, media, multipart
  and resumable), compose (destination), copy/rewrite (destination; the source ones are
  ``ifSource...``), delete, patch, metadata ``GET`` and media ``GET``; the XML API headers
  ``x-goog-if-generation-match`` / ``x-goog-if-metageneration-match`` on the XML routes
  (``PUT``/``GET /<bucket>/<object>``); and ``sourceObjects[].objectPreconditions
  .ifGenerationMatch`` on compose.  As documented:

  - a ``...Match`` precondition that does not hold answers **412 Precondition Failed**
    (``reason: conditionNotMet``); ``ifGenerationMatch=0`` holds only when there is no
    live object ("create only");
  - a ``...NotMatch`` precondition whose value equals the object's answers
    **304 Not Modified** (empty body) -- the request-preconditions page gives 304, not 412,
    for these two; ``ifGenerationNotMatch=0`` holds only when a live object exists, and
    with no live object a ``NotMatch`` precondition does not hold (412), as the JSON API
    reference says ("If no live object exists, the precondition fails");
  - a write's preconditions are judged against the live object just before it is
    replaced: an absent object has generation 0 and fails any metageneration
    precondition; a resumable upload is checked when its session starts (POST) *and* when
    its last byte arrives (the object may have changed meanwhile), and a failure there
    ends the session;
  - a read, delete or patch of an absent object answers 404 before any precondition;
  - a value that is not a non-negative integer answers 400.

  Checks follow RFC 9110's order: ``Match`` (412) before ``NotMatch`` (304).
* **Media answers** (``alt=media`` / ``/download/`` / XML ``GET``, 200 and 206) carry
  ``x-goog-generation`` and ``x-goog-metageneration`` of the object served
  (https://cloud.google.com/storage/docs/xml-api/reference-headers), the headers the Python
  client reads to pin the generation of a resumed download.  JSON metadata answers carry
  the same values in their ``generation`` / ``metageneration`` fields.  GCS also sends
  ``x-goog-stored-content-length`` / ``-encoding``; the emulator still does not (tests that
  model it add it themselves).

Not covered: batch requests (their query strings are dropped by the emulator's batch
parser), ETag preconditions, ``If-Modified-Since``.  The check and the write happen in one
request of the emulator's single-threaded server, so they are atomic, as on GCS.

This module is loaded by file path into the emulator process (``GCSEmulator`` does not
import the ``xla_ckpt`` package there, which would load torch): it imports only the
standard library and ``gcp_storage_emulator``.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from dataclasses import dataclass, fields
from http import HTTPStatus
from typing import Any, Callable

import gcp_storage_emulator.server as _server
from gcp_storage_emulator import settings as _settings
from gcp_storage_emulator.handlers import objects as _objects
from gcp_storage_emulator.storage import RESUMABLE_DIR as _RESUMABLE_DIR
from gcp_storage_emulator.storage import Storage as _Storage

__all__ = ["Preconditions", "install", "installed"]

Handler = Callable[..., Any]
ObjectResource = dict[str, Any]

PRECONDITION_FAILED_MESSAGE = "At least one of the pre-conditions you specified did not hold."


@dataclass(frozen=True)
class Preconditions:
    """The four generation preconditions of one request (None: not given)."""

    generation_match: int | None = None
    generation_not_match: int | None = None
    metageneration_match: int | None = None
    metageneration_not_match: int | None = None

    def given(self) -> bool:
        """Whether the request gave any of them."""
        return any(getattr(self, f.name) is not None for f in fields(self))

    @classmethod
    def from_request(cls, request: Any, source: bool = False, xml: bool = False) -> Preconditions:
        """From the query (``if[Source]GenerationMatch`` ...), or the XML API headers."""
        if xml:
            return cls(generation_match=_header_int(request, "x-goog-if-generation-match"),
                       metageneration_match=_header_int(request, "x-goog-if-metageneration-match"))
        s = "Source" if source else ""
        q = request.query
        return cls(generation_match=_query_int(q, f"if{s}GenerationMatch"),
                   generation_not_match=_query_int(q, f"if{s}GenerationNotMatch"),
                   metageneration_match=_query_int(q, f"if{s}MetagenerationMatch"),
                   metageneration_not_match=_query_int(q, f"if{s}MetagenerationNotMatch"))

    def check(self, live: ObjectResource | None) -> None:
        """Raise the GCS answer (412 / 304) if these do not hold for ``live`` (None: absent)."""
        gen = _generation(live)  # 0 when absent: ifGenerationMatch=0 is "create only"
        meta = int(live["metageneration"]) if live is not None else None
        if self.generation_match is not None and self.generation_match != gen:
            raise _precondition_failed("ifGenerationMatch", self.generation_match,
                                       gen if live is not None else None)
        if self.metageneration_match is not None and self.metageneration_match != meta:
            raise _precondition_failed("ifMetagenerationMatch", self.metageneration_match, meta)
        if self.generation_not_match is not None:
            if live is None:
                raise _precondition_failed("ifGenerationNotMatch", self.generation_not_match, None)
            if self.generation_not_match == gen:
                raise _Answer(HTTPStatus.NOT_MODIFIED, None)
        if self.metageneration_not_match is not None:
            if meta is None:
                raise _precondition_failed("ifMetagenerationNotMatch",
                                           self.metageneration_not_match, None)
            if self.metageneration_not_match == meta:
                raise _Answer(HTTPStatus.NOT_MODIFIED, None)


class _Answer(Exception):
    """Replaces the handler's answer with ``status`` and the JSON ``body`` (None: empty)."""

    def __init__(self, status: HTTPStatus, body: dict[str, Any] | None) -> None:
        super().__init__(status.value)
        self.status = status
        self.body = body


def _error(status: HTTPStatus, reason: str, message: str, **extra: str) -> _Answer:
    detail = {"domain": "global", "reason": reason, "message": message, **extra}
    return _Answer(status, {"error": {"code": status.value, "message": message,
                                      "errors": [detail]}})


def _precondition_failed(name: str, wanted: int, actual: int | None) -> _Answer:
    have = "no live object" if actual is None else f"the object has {actual}"
    return _error(HTTPStatus.PRECONDITION_FAILED, "conditionNotMet",
                  f"{PRECONDITION_FAILED_MESSAGE} ({name}={wanted}; {have})",
                  locationType="header", location="If-Match")


def _not_found(bucket: str, name: str, generation: int | None = None) -> _Answer:
    gen = f" (generation {generation})" if generation is not None else ""
    return _error(HTTPStatus.NOT_FOUND, "notFound", f"No such object: {bucket}/{name}{gen}")


def _bad_value(name: str, value: object) -> _Answer:
    return _error(HTTPStatus.BAD_REQUEST, "invalid",
                  f"Invalid argument: {name}={value!r} is not a non-negative integer")


def _as_int(name: str, value: object) -> int:
    text = str(value).strip()
    if not text.isdigit():
        raise _bad_value(name, value)
    return int(text)


def _query_int(query: dict[str, list[str]], name: str) -> int | None:
    values = query.get(name)
    return _as_int(name, values[0]) if values else None


def _header_int(request: Any, name: str) -> int | None:
    value = request.get_header(name)
    return _as_int(name, value) if value is not None else None


def _generation(obj: ObjectResource | None) -> int:
    return int(obj["generation"]) if obj is not None else 0


# ---- generations ---------------------------------------------------------------------------
class _GenerationClock:
    """Microsecond time stamps, each larger than the one before (and than ``after``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0

    def next(self, after: int = 0) -> int:
        with self._lock:
            self._last = max(time.time_ns() // 1000, self._last + 1, after + 1)
            return self._last


_clock = _GenerationClock()
_MEDIA_LINK_GENERATION = re.compile(r"([?&])generation=\d+")


def _stamp(obj: ObjectResource, bucket: str, name: str, generation: int) -> None:
    """Give ``obj`` (about to be stored as the live object) a new generation, metageneration 1."""
    obj["generation"] = str(generation)
    obj["metageneration"] = "1"
    obj["id"] = f"{bucket}/{name}/{generation}"
    link = obj.get("mediaLink")
    if isinstance(link, str):
        obj["mediaLink"] = _MEDIA_LINK_GENERATION.sub(rf"\g<1>generation={generation}", link)


# ---- per-request state ---------------------------------------------------------------------
class _Context(threading.local):
    write: Preconditions | None = None  # the running request's preconditions on what it writes


_ctx = _Context()
_sessions: dict[str, Preconditions] = {}  # resumable upload id -> its initial POST's preconditions


def _live(storage: Any, bucket: str, name: str) -> ObjectResource | None:
    obj = storage.objects.get(bucket, {}).get(name)
    return obj if isinstance(obj, dict) else None


# ---- storage hooks: every new live object passes through create_file ------------------------
_orig_create_file: Handler = _Storage.create_file
_orig_create_resumable_upload: Handler = _Storage.create_resumable_upload


def _create_file(self: Any, bucket_name: str, file_name: str, content: bytes,
                 file_obj: ObjectResource, file_id: str | None = None) -> Any:
    pre = _sessions.pop(file_id, None) if file_id else None
    if pre is None:
        pre = _ctx.write
    if bucket_name in self.buckets:  # else the original raises NotFound (404)
        live = _live(self, bucket_name, file_name)
        if pre is not None:
            try:
                pre.check(live)
            except _Answer:
                if file_id:  # a resumable upload whose precondition failed at the end is over
                    self.resumable.pop(file_id, None)
                    self._delete_file(_RESUMABLE_DIR, self.safe_id(file_id))
                raise
        # In place: the handler answers with this same dict.
        _stamp(file_obj, bucket_name, file_name, _clock.next(after=_generation(live)))
    return _orig_create_file(self, bucket_name, file_name, content, file_obj, file_id)


def _create_resumable_upload(self: Any, bucket_name: str, file_name: str,
                             file_obj: ObjectResource) -> Any:
    pre = _ctx.write
    if pre is not None and pre.given() and bucket_name in self.buckets:
        pre.check(_live(self, bucket_name, file_name))  # fail fast; checked again at the end
    upload_id = _orig_create_resumable_upload(self, bucket_name, file_name, file_obj)
    if pre is not None and pre.given():
        _sessions[upload_id] = pre
    return upload_id


# ---- route wrappers ------------------------------------------------------------------------
def _pinned_target(request: Any, storage: Any, bucket: str, name: str, *, generation_key: str,
                   pre: Preconditions) -> ObjectResource | None:
    """The live object a read/delete/patch/copy source names, after its pin and preconditions.

    None when there is no live object: the emulator's handler then answers 404.
    """
    live = _live(storage, bucket, name)
    if live is None:
        return None
    pinned = _query_int(request.query, generation_key)
    if pinned is not None and pinned != _generation(live):
        raise _not_found(bucket, name, pinned)
    pre.check(live)
    return live


def _is_xml_route(request: Any) -> bool:
    path = request.path
    return not any(path.startswith(p + "/") for p in (
        _settings.API_ENDPOINT, _settings.UPLOAD_API_ENDPOINT, _settings.DOWNLOAD_API_ENDPOINT,
        _settings.BATCH_API_ENDPOINT, "/b"))


def _soft_deleted(request: Any) -> bool:
    values = request.query.get("softDeleted")
    return bool(values) and values[0].lower() in ("1", "true", "yes")


def _media_headers(response: Any, live: ObjectResource) -> None:
    response["x-goog-generation"] = str(live["generation"])
    response["x-goog-metageneration"] = str(live["metageneration"])


def _existing(media: bool | None) -> Callable[[Handler], Handler]:
    """Wrapper for handlers of an existing object: GET (media when ``media``, or by ``alt``),
    DELETE and PATCH (``media`` None)."""

    def wrap(orig: Handler) -> Handler:
        @functools.wraps(orig)
        def handler(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
            if _soft_deleted(request):
                return orig(request, response, storage, *args, **kwargs)
            bucket, name = request.params["bucket_name"], request.params["object_id"]
            xml = _is_xml_route(request)
            is_media = media if media is not None else (request.query.get("alt") or [""])[0] \
                == "media"
            try:
                live = _pinned_target(request, storage, bucket, name, generation_key="generation",
                                      pre=Preconditions.from_request(request, xml=xml))
            except _Answer as answer:
                return _respond(request, response, answer)
            result = orig(request, response, storage, *args, **kwargs)
            if is_media and live is not None and response.status in (HTTPStatus.OK,
                                                                     HTTPStatus.PARTIAL_CONTENT):
                _media_headers(response, live)
            return result

        return handler

    return wrap


def _writing(before: Callable[[Any, Any], Preconditions]) -> Callable[[Handler], Handler]:
    """Wrapper for handlers that write an object: ``before(request, storage)`` checks what
    they read and returns the preconditions on what they write (checked in create_file)."""

    def wrap(orig: Handler) -> Handler:
        @functools.wraps(orig)
        def handler(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                _ctx.write = before(request, storage)
                return orig(request, response, storage, *args, **kwargs)
            except _Answer as answer:
                return _respond(request, response, answer)
            finally:
                _ctx.write = None

        return handler

    return wrap


def _before_upload(request: Any, storage: Any) -> Preconditions:
    return Preconditions.from_request(request, xml=_is_xml_route(request))


def _before_compose(request: Any, storage: Any) -> Preconditions:
    pre = Preconditions.from_request(request)
    bucket = request.params["bucket_name"]
    data = request.data
    for src in (data.get("sourceObjects") or []) if isinstance(data, dict) else []:
        if not isinstance(src, dict) or not src.get("name"):
            continue
        live = _live(storage, bucket, src["name"])
        if live is None:
            continue  # the handler answers 404
        if src.get("generation") is not None:
            pinned = _as_int("sourceObjects[].generation", src["generation"])
            if pinned != _generation(live):
                raise _not_found(bucket, src["name"], pinned)
        match = (src.get("objectPreconditions") or {}).get("ifGenerationMatch")
        if match is not None:
            Preconditions(generation_match=_as_int(
                "sourceObjects[].objectPreconditions.ifGenerationMatch", match)).check(live)
    return pre


def _before_copy(request: Any, storage: Any) -> Preconditions:
    pre = Preconditions.from_request(request)
    _pinned_target(request, storage, request.params["bucket_name"], request.params["object_id"],
                   generation_key="sourceGeneration",
                   pre=Preconditions.from_request(request, source=True))
    return pre


def _respond(request: Any, response: Any, answer: _Answer) -> None:
    try:  # read any body left, or the next request on this connection would start inside it
        request.data  # noqa: B018 - the property reads (and caches) the body
    except OSError:
        raise  # the body ended early: the connection is dropped without an answer
    except Exception:  # noqa: BLE001 - an unparsable body changes nothing about the answer
        pass
    response.status = answer.status
    response._headers = {}
    response._content = ""
    if answer.body is not None:
        response.json(answer.body)


# ---- install -------------------------------------------------------------------------------
_installed = False


def installed() -> bool:
    """Whether :func:`install` ran in this process."""
    return _installed


def install() -> None:
    """Patch ``gcp_storage_emulator`` in this process (idempotent); call before it serves."""
    global _installed
    if _installed:
        return
    o = _objects
    wrappers: dict[Handler, Handler] = {
        o.get: _existing(None)(o.get),
        o.download: _existing(True)(o.download),
        o.delete: _existing(None)(o.delete),
        o.patch: _existing(None)(o.patch),
        o.insert: _writing(_before_upload)(o.insert),
        o.upload_partial: _writing(_before_upload)(o.upload_partial),
        o.xml_upload: _writing(_before_upload)(o.xml_upload),
        o.restore: _writing(_before_upload)(o.restore),
        o.compose: _writing(_before_compose)(o.compose),
        o.copy: _writing(_before_copy)(o.copy),
        o.rewrite: _writing(_before_copy)(o.rewrite),
    }
    _server.HANDLERS = tuple((regex, {m: wrappers.get(h, h) for m, h in methods.items()})
                             for regex, methods in _server.HANDLERS)
    # The router falls back to ``objects.insert`` for uploads POSTed without ``/upload``.
    _objects.insert = wrappers[o.insert]
    _Storage.create_file = _create_file
    _Storage.create_resumable_upload = _create_resumable_upload
    _installed = True
