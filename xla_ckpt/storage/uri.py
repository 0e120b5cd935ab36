"""The one parser of storage URIs: a local path, ``file:///abs/path`` or ``gs://bucket/path``.

Every entry point (``xla_ckpt.save``/``load``, :func:`~xla_ckpt.storage.open_storage`, both
backends, :func:`~xla_ckpt.storage.is_gcs_uri`, the CLI) classifies a URI here and nowhere
else, so a typo such as ``gs:/bucket/run`` is refused instead of becoming a local folder
``./gs:/bucket/run`` (which on a TPU VM vanishes with the machine).  Pure: no filesystem or
environment access; ``~`` and relative paths are resolved by
:class:`~xla_ckpt.storage.local.LocalStorage`.

Accepted:

* ``gs://BUCKET`` and ``gs://BUCKET/PATH``: the scheme exactly ``gs://`` (lowercase);
  ``BUCKET`` follows the GCS naming rules (3-63 characters of ``a-z 0-9 - _ .``, starting and
  ending with a letter or digit; with dots up to 222 characters, each dot-separated part at
  most 63; not an IPv4 address); ``PATH`` is the object prefix.
* ``file:///ABS/PATH``: the local absolute path ``/ABS/PATH``.
* a plain local path, relative (``runs/a``, ``./gs:``) or absolute (``/data/run``), ``~``
  allowed.

Normalised, the same way for every scheme: trailing slashes are dropped (``gs://b/run/`` is
``gs://b/run``, ``gs://b/`` is ``gs://b``, ``runs//`` is ``runs``; ``/`` stays ``/``).  Nothing
else is rewritten: a local path keeps its ``./``, ``..`` and inner ``//``, which the OS resolves.

Refused with :class:`~xla_ckpt.errors.StorageURIError` (a ``ConfigError``, so a
``ValueError``), whose message names the URI and the form expected:

* an empty URI, one with leading or trailing whitespace, a non-string;
* an unknown scheme ``X://...`` (``s3://``, ``hdfs://``, ``http://``, ...), and a scheme not in
  lowercase (``GS://b/x``, ``File:///x``);
* malformed ``gs`` forms: ``gs:/b/x``, ``gs:b/x``, ``gs//b/x``, ``gs://`` or ``gs:///x`` (no
  bucket), an invalid bucket name (``gs://Bad_Bucket``);
* an empty, ``.`` or ``..`` segment inside a ``gs://`` object path (``gs://b//x``,
  ``gs://b/a//x``, ``gs://b/a/../x``): GCS object names are literal, so ``a//x`` and ``a/x`` are
  different objects, and refusing is the only choice that cannot write where a later read does
  not look (the same rule the GCS backend applies to object names);
* ``file://`` not followed by an absolute path (``file://rel``, ``file://host/x``, ``file:/x``);
* a relative local path that looks like a mangled URI: one starting with ``word:``
  (``gs:/b/x``, ``gs:b``, ``foo:bar``), or a scheme name followed by ``//`` (``gs//b/x``,
  ``s3//b``); and ``://`` anywhere inside a local path.  To mean a local folder of such a name,
  write it as ``./gs:`` (or an absolute path).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from xla_ckpt.errors import CheckpointNotFoundError, StorageURIError

GS = "gs"
FILE = "file"

EXPECTED = "a local path, file:///ABS/PATH or gs://BUCKET/PATH"
"""The forms every refusal names."""

# RFC 3986 scheme: a letter, then letters, digits, '+', '-', '.'; followed by ':'.
_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_BUCKET_RE = re.compile(r"[a-z0-9](?:[a-z0-9_.-]*[a-z0-9])?")
_IPV4_RE = re.compile(r"\d{1,3}(?:\.\d{1,3}){3}")
# Scheme names that, followed by '//' with the ':' missing, start a relative local path that is
# refused as a mangled URI ("gs//b/x").  Other first components followed by '//' stay local.
_SCHEME_NAMES = frozenset({"gs", "gcs", "file", "s3", "s3a", "s3n", "hdfs", "http", "https",
                           "az", "abfs", "abfss", "wasb", "wasbs", "adl", "ftp", "sftp", "oss"})


@dataclass(frozen=True)
class StorageURI:
    """A parsed storage URI; :func:`parse_uri` makes them, ``str()`` gives the canonical text.

    Attributes:
        scheme: ``"gs"`` or ``"file"`` (every local path, plain or ``file://``).
        bucket: the GCS bucket; ``""`` for ``file``.
        path: ``gs``: the object prefix, without leading or trailing ``/`` (``""`` for the bucket
            root).  ``file``: the local path as written (``file://`` removed, ``~`` not
            expanded, relative paths kept relative), without trailing ``/`` except ``"/"``.

    Constructing one directly validates it like :func:`parse_uri` does, so
    ``parse_uri(str(u)) == u`` holds for every instance.

    Raises:
        StorageURIError: the parts do not form a valid URI.
    """

    scheme: str
    bucket: str = ""
    path: str = ""

    def __post_init__(self) -> None:
        if self.scheme == GS:
            problem = _gs_problem(self.bucket, self.path)
        elif self.scheme == FILE:
            problem = (f"a local path has no bucket, got {self.bucket!r}" if self.bucket
                       else _local_problem(self.path))
        else:
            problem = f"scheme must be {GS!r} or {FILE!r}, got {self.scheme!r}"
        if problem:
            text = str(self) if self.scheme in (GS, FILE) else repr(self)
            raise StorageURIError(f"{text!r}: {problem}", uri=text)

    @property
    def is_gcs(self) -> bool:
        return self.scheme == GS

    @property
    def is_local(self) -> bool:
        return self.scheme == FILE

    def __str__(self) -> str:
        if self.scheme == GS:
            return f"gs://{self.bucket}" + (f"/{self.path}" if self.path else "")
        return self.path

    def join(self, *names: str) -> StorageURI:
        """This URI with ``names`` appended as ``/``-separated segments (empty names skipped).

        ``parse_uri("gs://b/run").join("ck_1", "manifest.json")`` is
        ``gs://b/run/ck_1/manifest.json``.  The result is validated like a parse, so a name
        with an empty, ``.`` or ``..`` segment is refused under ``gs://``.
        """
        extra = "/".join(n.strip("/") for n in names if n and n.strip("/"))
        if not extra:
            return self
        base = self.path.rstrip("/") if self.scheme == FILE else self.path
        joined = f"{base}/{extra}" if base or self.scheme == FILE else extra
        return StorageURI(self.scheme, self.bucket, joined)


def parse_uri(uri: str) -> StorageURI:
    """Classify and split a storage URI; the rules are in the module docstring.

    ``"gs://b/run/ck/"`` -> ``StorageURI("gs", "b", "run/ck")``;
    ``"file:///data/x"`` -> ``StorageURI("file", "", "/data/x")``;
    ``"runs/a"`` -> ``StorageURI("file", "", "runs/a")``.

    Raises:
        StorageURIError: empty, unknown scheme, malformed ``gs://`` or ``file://`` form, bad
            bucket name, empty/``.``/``..`` segment in a ``gs://`` path, or a local path that
            looks like a mangled URI.  The message names ``uri`` and the form expected.
    """
    if not isinstance(uri, str):
        raise StorageURIError(f"a storage URI must be a string ({EXPECTED}), got {uri!r}",
                              uri=repr(uri))
    problem: str | None
    m = _SCHEME_RE.match(uri)
    if not uri.strip():
        problem = f"empty storage URI; expected {EXPECTED}"
    elif uri != uri.strip():
        problem = f"leading or trailing whitespace; expected {EXPECTED}"
    elif m and uri[m.end():].startswith("//"):
        scheme, rest = m.group(1), uri[m.end() + 2:]
        if scheme == GS:
            bucket, _, path = rest.partition("/")
            path = path.rstrip("/")
            problem = _gs_problem(bucket, path)
            if not problem:
                return StorageURI(GS, bucket, path)
        elif scheme == FILE:
            path = rest.rstrip("/") or "/"
            problem = (_local_problem(path) if rest.startswith("/") else
                       "a file:// URI takes an absolute path: file:///ABS/PATH (three slashes); "
                       "write a relative path without file://")
            if not problem:
                return StorageURI(FILE, "", path)
        elif scheme.lower() in (GS, FILE):
            problem = (f"URI schemes are lowercase: write {scheme.lower()}:// "
                       f"(expected {EXPECTED})")
        else:
            problem = f"unsupported URI scheme {scheme + '://'!r}; expected {EXPECTED}"
    else:
        path = uri.rstrip("/") or "/"
        problem = _local_problem(path)
        if not problem:
            return StorageURI(FILE, "", path)
    raise StorageURIError(f"{uri!r}: {problem}", uri=uri)


def split_uri(uri: str) -> tuple[str, str]:
    """``(folder URI, object name)`` of a file URI.

    ``gs://b/run/x.pt`` -> ``("gs://b/run", "x.pt")``; ``/data/x.pt`` -> ``("/data", "x.pt")``
    (a local path made absolute, ``~`` expanded).

    Raises:
        CheckpointNotFoundError: a ``gs://`` URI naming a bucket, not an object.
        StorageURIError: what :func:`parse_uri` refuses.
    """
    target = parse_uri(uri)
    if target.is_gcs:
        if not target.path:
            raise CheckpointNotFoundError(f"{uri}: names a bucket, not an object")
        folder, _, name = target.path.rpartition("/")
        return str(StorageURI("gs", target.bucket, folder)), name
    path = os.path.abspath(os.path.expanduser(target.path))
    return os.path.dirname(path) or ".", os.path.basename(path)


def _gs_problem(bucket: str, path: str) -> str | None:
    """Why ``gs://bucket/path`` (path already without trailing ``/``) is invalid, or None."""
    if not bucket:
        return "no bucket name; expected gs://BUCKET/PATH"
    why = _bucket_problem(bucket)
    if why:
        return f"invalid bucket name {bucket!r}: {why}; expected gs://BUCKET/PATH"
    if path and any(seg in ("", ".", "..") for seg in path.split("/")):
        return ("empty, '.' or '..' segment in the object path (GCS names are literal: "
                "gs://b/a//x and gs://b/a/x are different objects); expected gs://BUCKET/PATH "
                "with single slashes")
    return None


def _bucket_problem(bucket: str) -> str | None:
    if not _BUCKET_RE.fullmatch(bucket):
        return ("bucket names use only lowercase letters, digits, '-', '_' and '.', and start "
                "and end with a letter or digit")
    if len(bucket) < 3:
        return "bucket names have at least 3 characters"
    if "." not in bucket and len(bucket) > 63:
        return "bucket names without dots have at most 63 characters"
    if len(bucket) > 222:
        return "bucket names have at most 222 characters"
    if any(not 1 <= len(part) <= 63 for part in bucket.split(".")):
        return "each dot-separated part of a bucket name has 1 to 63 characters"
    if _IPV4_RE.fullmatch(bucket):
        return "a bucket name cannot be an IP address"
    return None


def _local_problem(path: str) -> str | None:
    """Why ``path`` (trailing ``/`` already dropped) is not an acceptable local path, or None."""
    if not path:
        return f"empty storage URI; expected {EXPECTED}"
    if path != "/" and path.endswith("/"):
        return "trailing '/' (a StorageURI path is stored without it)"
    m = _SCHEME_RE.match(path)
    if m:
        name = m.group(1).lower()
        if name == GS:
            return f"malformed gs:// URI; expected gs://BUCKET/PATH{_did_you_mean(path)}"
        if name == FILE:
            return "malformed file:// URI; expected file:///ABS/PATH"
        return (f"starts with {m.group(0)!r} like a URI, but {m.group(1)}: is not a supported "
                f"scheme; expected {EXPECTED} (write ./{path} for a local folder so named)")
    first = path.partition("/")[0]
    if first.lower() in _SCHEME_NAMES and path[len(first):len(first) + 2] == "//":
        if first.lower() == GS:
            return ("malformed gs:// URI (the ':' is missing); expected gs://BUCKET/PATH"
                    f"{_did_you_mean(path)}")
        return (f"looks like a {first}:// URI with its ':' missing; expected {EXPECTED} "
                f"(write ./{path} for a local folder so named)")
    if "://" in path:
        return f"unsupported URI scheme: '://' inside a local path; expected {EXPECTED}"
    return None


def _did_you_mean(mangled: str) -> str:
    """`` (did you mean 'gs://b/x'?)`` for ``gs:/b/x``, ``gs//b/x``, ``gs:b/x``; or ``""``."""
    candidate = "gs://" + mangled[2:].lstrip(":/")
    try:
        parse_uri(candidate)
    except StorageURIError:
        return ""
    return f" (did you mean {candidate!r}?)"
