"""The local tier: each host's own part of the newest checkpoints, in a folder that outlives
the training process (``/dev/shm`` on a TPU VM, an ``emptyDir`` with ``medium: Memory`` on
GKE, a local SSD), saved far more often than the durable run folder (DESIGN "tiers").

Layout, under ``local_dir`` (the same path on every host; each host sees its own)::

    <local_dir>/<run key>/                   one folder per durable run folder (two jobs on
                                             one host with different save_dir never meet)
        checkpoint_E_U/
            data-<save id>-*.safetensors     this host's data files: the bytes its ranks
                                             wrote, the same bytes the durable copy holds
            manifest.json                    the checkpoint's manifest (every host's files)
            host-<h>.commit.json             host h's commit marker, written LAST
            untrusted-<h>.json               a check of host h's copy failed: never chosen
            replica-<g>.commit.json          a replica of host g's part (its data files are
                                             here too), written LAST once every byte of
                                             them was received and checked (issue 26)
            untrusted-replica-<g>.json       a check of that replica failed: never chosen
        .spare/<file key>                    data files of the step keep-last-K evicted last,
                                             recycled as the next save's pages (no faults on
                                             the save's copy: :mod:`xla_ckpt.io.mapped_writer`)

The format is the durable one (:mod:`xla_ckpt.io.writer`): every blob has its crc32c
chunks in the manifest, so every local byte is checked when read.  A host's part of a step
is committed when its marker is there; the marker names the save id, the lease epoch of
the incarnation that wrote it (:mod:`xla_ckpt.run.fencing`), ``num_updates``, the ranks of
the host and every file it holds with its size.

:func:`choose_local` is the decision across tiers (rank 0, from every host's
:meth:`LocalTier.inventory`): the newest step that every host committed under this job's
lineage, never older than the newest durable step.  Which rank calls what: the host leader
(local rank 0) writes the marker, lists the inventory and prunes; any rank of the host may
mark a step untrusted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from xla_ckpt.errors import ConfigError
from xla_ckpt.format.manifest import MANIFEST_NAME
from xla_ckpt.storage.local import LocalStorage

logger = logging.getLogger(__name__)

MARKER_FORMAT = "xla_ckpt-local-tier"
MARKER_VERSION = 1
_MARKER_RE = re.compile(r"^host-(\d+)\.commit\.json$")
_REPLICA_RE = re.compile(r"^replica-(\d+)\.commit\.json$")
_TMP_MARK = ".tmp-"
SPARE_FOLDER = ".spare"
"""Where pruned data files wait to be recycled (a dot name: never a checkpoint's)."""
_DATA_FILE_RE = re.compile(r"^data-[0-9a-f]+-(?P<key>.+)$")
#: What a step takes beyond its tensor bytes, as :meth:`LocalTier.make_room` counts it (file
#: headers, the manifest and marker, filesystem pages).
ROOM_SLACK_BYTES = 64 * 1024


def run_key(run_uri: str) -> str:
    """The folder name of a durable run folder's local tier: its last path segment (readable)
    and a digest of the whole URI (two runs named alike on one host never share a folder)."""
    tail = re.sub(r"[^A-Za-z0-9_.-]+", "_", run_uri.rstrip("/").rsplit("/", 1)[-1])[:40]
    digest = hashlib.sha256(run_uri.rstrip("/").encode("utf-8")).hexdigest()[:12]
    return f"{tail or 'run'}-{digest}"


def marker_name(host: int) -> str:
    return f"host-{host}.commit.json"


def replica_marker_name(source: int) -> str:
    """The marker of a replica of host ``source``'s part, in the holding host's step folder."""
    return f"replica-{source}.commit.json"


def untrusted_replica_name(source: int) -> str:
    return f"untrusted-replica-{source}.json"


def untrusted_name(host: int) -> str:
    return f"untrusted-{host}.json"


@dataclass(frozen=True)
class LocalStep:
    """One host's committed part of a checkpoint in its local tier (its marker's fields).

    Attributes:
        name: checkpoint folder name (``checkpoint_1_12``).
        save_id: the save's id (its data files carry it).
        host: host index (``Topology.host_id``).
        ranks: the ranks of that host when it was written.
        world_size: the job's world size then.
        lease_epoch: the writing incarnation's lease epoch (0: none taken).
        epoch / num_updates: the training position.
        files: every data file the host holds, with its size in bytes.
        complete: the host holds every file its ranks need for a restore on the same mesh.
        missing: files of ``files`` that are gone or have another size now.
    """

    name: str
    save_id: str
    host: int
    ranks: tuple[int, ...]
    world_size: int
    lease_epoch: int
    epoch: int
    num_updates: int
    files: Mapping[str, int]
    complete: bool
    missing: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(self.files.values())

    def to_json(self) -> dict[str, Any]:
        return {"format": MARKER_FORMAT, "version": MARKER_VERSION, "name": self.name,
                "save_id": self.save_id, "host": self.host, "ranks": list(self.ranks),
                "world_size": self.world_size, "lease_epoch": self.lease_epoch,
                "epoch": self.epoch, "num_updates": self.num_updates,
                "files": dict(self.files), "complete": self.complete,
                "missing": list(self.missing)}

    @classmethod
    def from_json(cls, doc: Any, where: str) -> LocalStep:
        """Raises ValueError naming ``where`` and the field when ``doc`` is not a marker."""
        if not isinstance(doc, dict) or doc.get("format") != MARKER_FORMAT:
            raise ValueError(f"{where}: not a local-tier commit marker")

        def get(k: str, t: type | tuple[type, ...]) -> Any:
            v = doc.get(k)
            if not isinstance(v, t) or isinstance(v, bool) and t is not bool:
                raise ValueError(f"{where}: field {k!r} must be {t}, got {v!r}")
            return v
        files = get("files", dict)
        if not all(isinstance(k, str) and isinstance(v, int) for k, v in files.items()):
            raise ValueError(f"{where}: field 'files' must map names to sizes")
        return cls(name=get("name", str), save_id=get("save_id", str), host=get("host", int),
                   ranks=tuple(get("ranks", list)), world_size=get("world_size", int),
                   lease_epoch=get("lease_epoch", int), epoch=get("epoch", int),
                   num_updates=get("num_updates", int), files=files,
                   complete=bool(doc.get("complete")),
                   missing=tuple(doc.get("missing") or ()))


@dataclass
class LocalTier:
    """One host's local tier of one run folder (see the module docstring).

    Args:
        root: ``local_dir`` (a folder on this host; created when missing).
        run_uri: the durable run folder's URI (``save_dir``); names the run key.
        host: this host's index.
        keep_last: committed steps kept (the newest; at least 1).
        max_bytes: at most this many bytes in this run's local folder (0: no limit).

    Raises:
        ConfigError: ``root`` is not a usable folder (names it).
    """

    root: str
    run_uri: str
    host: int = 0
    keep_last: int = 2
    max_bytes: int = 0
    folder: str = field(init=False)
    protected: set[str] = field(default_factory=set, init=False)
    """Checkpoint folders that pruning never removes (a replica being received into)."""

    def __post_init__(self) -> None:
        self.folder = os.path.join(os.path.abspath(self.root), run_key(self.run_uri))
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"checkpoint.local_dir {self.root!r}: cannot create "
                              f"{self.folder}: {e.strerror or e}; pass a writable folder on "
                              "this host (/dev/shm/..., an emptyDir, a local SSD)") from None

    # ---- paths -------------------------------------------------------------------------
    def path(self, name: str) -> str:
        """The folder of checkpoint ``name`` in this host's tier."""
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"local tier: bad checkpoint name {name!r}")
        return os.path.join(self.folder, name)

    def step_storage(self, name: str) -> LocalStorage:
        """A :class:`LocalStorage` rooted at checkpoint ``name``'s folder (created)."""
        p = self.path(name)
        os.makedirs(p, exist_ok=True)
        return LocalStorage(p)

    # ---- spare pages -------------------------------------------------------------------
    def spare_path(self, fname: str) -> str:
        """Where a data file named like ``fname`` (any save id) waits to be recycled: the
        rank that writes such a file takes it (:func:`~xla_ckpt.io.mapped_writer.stage_file`
        renames it into its new step's folder; a miss makes a fresh file)."""
        m = _DATA_FILE_RE.match(fname)
        return os.path.join(self.folder, SPARE_FOLDER, m.group("key") if m else fname)

    def spare_bytes(self) -> int:
        """Bytes of the spare files held now (outside :meth:`used_bytes`)."""
        return _folder_bytes(os.path.join(self.folder, SPARE_FOLDER))

    def drop_spares(self) -> int:
        """Delete every spare file (room is short); returns the bytes freed."""
        n = self.spare_bytes()
        shutil.rmtree(os.path.join(self.folder, SPARE_FOLDER), ignore_errors=True)
        return n

    def _keep_spares(self, step: LocalStep) -> None:
        """Host leader, pruning: keep ``step``'s own data files as the spares (replacing the
        spares kept before) when ``max_bytes`` leaves room for them next to what stays."""
        folder = os.path.join(self.folder, SPARE_FOLDER)
        nbytes = sum(step.files.values())
        if self.max_bytes > 0 and self.used_bytes(exclude=[step.name]) + nbytes > self.max_bytes:
            self.drop_spares()
            return
        os.makedirs(folder, exist_ok=True)
        keep = set()
        for fn in step.files:
            dst = self.spare_path(fn)
            with contextlib.suppress(OSError):
                os.replace(os.path.join(self.path(step.name), fn), dst)
                keep.add(os.path.basename(dst))
        for fn in _listdir(folder):  # spares of files no save writes any more
            if fn not in keep:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, fn))

    # ---- commit ------------------------------------------------------------------------
    def commit(self, step: LocalStep, manifest_bytes: bytes | None) -> None:
        """Host leader: write the manifest (None: it is there already), then this host's
        commit marker (last).  Each is written to a temporary name and renamed, so a crash
        leaves no marker half written.

        Raises:
            OSError: the write failed (ENOSPC); the marker is absent, so the step does not
                count, and nothing earlier is touched.
        """
        p = self.path(step.name)
        if manifest_bytes is not None:
            _write_file(os.path.join(p, MANIFEST_NAME), manifest_bytes)
        _write_file(os.path.join(p, marker_name(step.host)),
                    json.dumps(step.to_json(), sort_keys=True).encode("utf-8"))

    def untrust(self, name: str, save_id: str, reason: str) -> None:
        """Any rank of this host: never choose this host's copy of ``name`` again (a check of
        its bytes failed).  Logged at WARNING; a failure to write it is logged too."""
        try:
            doc = {"save_id": save_id, "reason": reason, "unix_s": time.time()}
            _write_file(os.path.join(self.path(name), untrusted_name(self.host)),
                        json.dumps(doc).encode("utf-8"))
            logger.warning("host %d: local copy of %s (save %s) is not trusted from now on: %s",
                           self.host, name, save_id, reason)
        except OSError as e:
            logger.warning("host %d: could not mark the local copy of %s untrusted (%s); %s",
                           self.host, name, e, reason)

    def commit_replica(self, step: LocalStep, manifest_bytes: bytes | None = None) -> None:
        """This host's leader, once every data file of ``step`` (another host's part,
        ``step.host``) is in ``name``'s folder here and checked: the manifest (when given and
        this host has none there yet), then the replica's marker (last).

        Raises:
            ValueError: ``step`` is this host's own part.
            OSError: the write failed; the marker is absent, so the replica does not count.
        """
        if step.host == self.host:
            raise ValueError(f"host {self.host}: a replica of its own part of {step.name}")
        p = self.path(step.name)
        if manifest_bytes is not None and not os.path.exists(os.path.join(p, MANIFEST_NAME)):
            _write_file(os.path.join(p, MANIFEST_NAME), manifest_bytes)
        doc = {**step.to_json(), "missing": []}
        _write_file(os.path.join(p, replica_marker_name(step.host)),
                    json.dumps(doc, sort_keys=True).encode("utf-8"))

    def untrust_replica(self, name: str, source: int, save_id: str, reason: str) -> None:
        """Never choose the replica of host ``source``'s part of ``name`` held here again (a
        check of its bytes failed).  Logged at WARNING, as :meth:`untrust`."""
        try:
            doc = {"save_id": save_id, "reason": reason, "unix_s": time.time()}
            _write_file(os.path.join(self.path(name), untrusted_replica_name(source)),
                        json.dumps(doc).encode("utf-8"))
            logger.warning("host %d: replica of host %d's part of %s (save %s) is not trusted "
                           "from now on: %s", self.host, source, name, save_id, reason)
        except OSError as e:
            logger.warning("host %d: could not mark the replica of host %d's part of %s "
                           "untrusted (%s); %s", self.host, source, name, e, reason)

    # ---- what is here --------------------------------------------------------------------
    def inventory(self) -> list[LocalStep]:
        """This host's committed, trusted steps of this run, oldest first (by num_updates).

        A marker that is unreadable is skipped with a WARNING; a file that vanished or
        changed size is listed in ``missing`` (its bytes then come from durable storage).
        """
        return self._steps(marker_name(self.host), untrusted_name(self.host))

    def replicas(self) -> list[LocalStep]:
        """The replicas of other hosts' parts held here, committed and trusted, oldest first;
        each :class:`LocalStep` is the source host's (``host`` is the source's index), with
        ``missing`` and ``complete`` as :meth:`inventory` judges them here."""
        out: list[LocalStep] = []
        for source in sorted(self._replica_sources()):
            out += self._steps(replica_marker_name(source), untrusted_replica_name(source),
                               source=source)
        out.sort(key=lambda s: (s.lease_epoch, s.num_updates, s.name, s.host))
        return out

    def _replica_sources(self) -> set[int]:
        found: set[int] = set()
        for name in self._folders():
            for fn in _listdir(os.path.join(self.folder, name)):
                m = _REPLICA_RE.match(fn)
                if m:
                    found.add(int(m.group(1)))
        return found

    def _steps(self, marker: str, untrusted: str, source: int | None = None
               ) -> list[LocalStep]:
        out: list[LocalStep] = []
        for name in self._folders():
            p = os.path.join(self.folder, name)
            mp = os.path.join(p, marker)
            if not os.path.exists(mp):
                continue
            try:
                with open(mp, "rb") as f:
                    step = LocalStep.from_json(json.loads(f.read()), where=mp)
                if source is not None and step.host != source:
                    raise ValueError(f"{mp}: names host {step.host}, not {source}")
            except (OSError, ValueError) as e:
                logger.warning("host %d: skipping local checkpoint %s: %s", self.host, p, e)
                continue
            if _untrusted(os.path.join(p, untrusted), step.save_id):
                continue
            missing = []
            for fn, size in step.files.items():
                try:
                    if os.stat(os.path.join(p, fn)).st_size != size:
                        missing.append(fn)
                except OSError:
                    missing.append(fn)
            if not os.path.exists(os.path.join(p, MANIFEST_NAME)):
                continue
            out.append(LocalStep(**{**step.__dict__, "missing": tuple(missing),
                                    "complete": step.complete and not missing}))
        out.sort(key=lambda s: (s.lease_epoch, s.num_updates, s.name))
        return out

    def manifest_bytes(self, name: str) -> bytes:
        with open(os.path.join(self.path(name), MANIFEST_NAME), "rb") as f:
            return f.read()

    def used_bytes(self, exclude: Iterable[str] = ()) -> int:
        """Bytes under this run's local folder (every file), except folders ``exclude``."""
        skip = set(exclude)
        total = 0
        for name in self._folders():
            if name in skip:
                continue
            for dirpath, _, files in os.walk(os.path.join(self.folder, name)):
                for fn in files:
                    try:
                        total += os.stat(os.path.join(dirpath, fn)).st_size
                    except OSError:
                        pass
        return total

    def room_for(self, nbytes: int, name: str) -> tuple[bool, int]:
        """Whether a new step of ``nbytes`` on this host fits ``max_bytes`` once pruning keeps
        ``keep_last - 1`` older steps: ``(fits, bytes those older steps hold)``."""
        if self.max_bytes <= 0:
            return True, 0
        keep = self.newest(self.keep_last - 1, exclude=name)
        files = {(s.name, f): n for s in [*self.inventory(), *self.replicas()]
                 if s.name in keep for f, n in s.files.items()}
        held = sum(files.values())
        return held + nbytes <= self.max_bytes, held

    def newest(self, k: int, exclude: str | None = None) -> set[str]:
        """What keep-last-K keeps: the folders of this host's newest ``k`` own committed
        steps (with any replicas they hold), and the folders holding only replicas (this
        host has no part of that step) that are among the newest ``k`` steps here (by lease
        epoch, then ``num_updates``).  So an older replica ages out as newer steps commit
        and never pins the tier's room, and a host keeps ``k`` own steps, not more."""
        if k <= 0:
            return set()
        own = [s for s in self.inventory() if s.name != exclude]
        order: dict[str, tuple[int, int, str]] = {}
        for s in [*own, *self.replicas()]:
            if s.name != exclude:
                order[s.name] = max(order.get(s.name, (0, 0, "")),
                                    (s.lease_epoch, s.num_updates, s.name))
        mine = {s.name for s in own}
        top = sorted(order, key=order.__getitem__)[-k:]
        return {s.name for s in own[-k:]} | {n for n in top if n not in mine}

    def make_room(self, nbytes: int) -> list[str]:
        """Host leader, before the writes of a new step of about ``nbytes``: when it would
        not fit next to everything held now (over ``max_bytes``, or more than the free space
        of the folder's filesystem: a full tmpfs), delete the oldest committed steps down to
        the ``keep_last - 1`` that :meth:`room_for` counts, and uncommitted leftovers, if
        that makes the room.  Pruning otherwise follows a commit only, so a tier without
        room for ``keep_last + 1`` steps would never commit again.  Returns the folders
        removed."""
        need = nbytes + ROOM_SLACK_BYTES
        keep = self.newest(self.keep_last - 1) | self.protected
        gone = [name for name in self._folders() if name not in keep]
        spare = self.spare_bytes()  # the new step's files recycle them: they count once
        if spare and self.max_bytes > 0 and self.used_bytes() + max(spare, need) > \
                self.max_bytes:
            spare -= self.drop_spares()  # the spares go first
        # Over max_bytes: room_for found that it fits once only ``keep`` is left.
        if not (self.max_bytes > 0 and self.used_bytes() + need > self.max_bytes):
            try:
                st = os.statvfs(self.folder)
            except OSError:
                return []
            free = st.f_bavail * st.f_frsize
            # Nothing is removed unless that makes the room (a step larger than the whole
            # filesystem fails its write with ENOSPC, and the kept steps stay).  The spares
            # go first: a save recycles at most its own files' worth of them.
            if free + min(spare, need) >= need:  # recycled pages need no free ones
                return []
            if free + spare + self.used_bytes(exclude=keep) < need:
                return []
            free += self.drop_spares()
            if free >= need:
                return []
        for name in gone:
            shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
        if gone:
            logger.info("host %d: made room for a new local step of %d bytes in %s: removed %s",
                        self.host, nbytes, self.folder, ", ".join(gone))
        return gone

    def prune(self, *, protect: Sequence[str] = ()) -> list[str]:
        """Host leader: delete every folder but the newest ``keep_last`` committed steps and
        ``protect`` (a save in flight); uncommitted leftovers of earlier saves go too."""
        keep = self.newest(self.keep_last) | set(protect) | self.protected
        evicted = [s for s in self.inventory() if s.name not in keep and not s.missing]
        if evicted:
            self._keep_spares(evicted[-1])
        gone = []
        for name in self._folders():
            if name not in keep:
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
                gone.append(name)
        return gone

    def discard(self, name: str, save_id: str | None = None) -> None:
        """Remove checkpoint ``name``'s local folder (a failed or skipped save).

        With ``save_id`` (the failed save's): when this host committed another save in that
        folder (an incarnation that trained to the same update: a successor, or a fenced
        predecessor still running), only the failed save's data files go, never the
        committed step.  Replicas of other hosts' parts committed there stay (with the
        manifest): only this host's own files of that save go."""
        p = self.path(name)
        held: set[str] = set()  # files a committed replica of another host's part lists
        for fn in _listdir(p):
            if _REPLICA_RE.match(fn):
                try:
                    with open(os.path.join(p, fn), "rb") as f:
                        held |= set(json.loads(f.read()).get("files") or ())
                except (OSError, ValueError, AttributeError, TypeError):
                    pass
        if save_id is None and not held:
            shutil.rmtree(p, ignore_errors=True)
            return
        try:
            with open(os.path.join(p, marker_name(self.host)), "rb") as f:
                other = json.loads(f.read()).get("save_id")
        except (OSError, ValueError, AttributeError):
            other = None
        if not held and not (isinstance(other, str) and other != save_id):
            shutil.rmtree(p, ignore_errors=True)
            return
        # Something committed stays here: only the failed save's own files go (and this
        # host's marker, when it is that save's).
        for fn in _listdir(p):
            mine = save_id in fn if save_id is not None else fn.startswith("data-")
            if mine and fn not in held:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(p, fn))
        if other is not None and (save_id is None or other == save_id):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(p, marker_name(self.host)))

    def discard_foreign(self, lease_epoch: int) -> list[str]:
        """Host leader, when this job takes lease epoch ``lease_epoch`` of the run folder:
        remove every step of that epoch or later.  The epoch is new, so no incarnation of
        this run folder wrote them: they are another job's, whose run folder at the same URI
        was deleted and made anew (logged at WARNING)."""
        gone = sorted({s.name for s in [*self.inventory(), *self.replicas()]
                       if s.lease_epoch >= lease_epoch})
        for name in gone:  # replicas of such steps too: the whole folder
            shutil.rmtree(self.path(name), ignore_errors=True)
        if gone:
            logger.warning("host %d: removed %s from the local tier %s: written under lease "
                           "epoch %d or later, which this job has just taken (another job's, "
                           "from before the run folder was made anew)", self.host,
                           ", ".join(gone), self.folder, lease_epoch)
        return gone

    def folders(self) -> list[str]:
        """Every checkpoint folder name in this run's local folder (committed or not)."""
        return self._folders()

    def _folders(self) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.folder)
                          if e.is_dir() and not e.name.startswith("."))
        except FileNotFoundError:
            return []


def _untrusted(path: str, save_id: str) -> bool:
    """Whether the untrusted marker at ``path`` condemns save ``save_id``: it names that save
    (a later save committed in the same folder is not condemned), or cannot be read."""
    try:
        with open(path, "rb") as f:
            named = json.loads(f.read()).get("save_id")
    except FileNotFoundError:
        return False
    except (OSError, ValueError, AttributeError):
        return True
    return not isinstance(named, str) or named == save_id


def _folder_bytes(folder: str) -> int:
    total = 0
    for fn in _listdir(folder):
        with contextlib.suppress(OSError):
            total += os.stat(os.path.join(folder, fn)).st_size
    return total


def _write_file(path: str, data: bytes) -> None:
    tmp = f"{path}{_TMP_MARK}{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ---- the decision across tiers (rank 0) ---------------------------------------------------


@dataclass(frozen=True)
class DurableLatest:
    """The newest committed durable checkpoint, as the decision compares it: its folder name,
    save id, lease epoch and num_updates."""

    name: str
    save_id: str
    lease_epoch: int
    num_updates: int


@dataclass(frozen=True)
class LocalChoice:
    """The local step a restore reads: ``name`` / ``save_id``, and whether the durable run
    folder holds the same save (then a bad or missing local byte comes from there)."""

    name: str
    save_id: str
    num_updates: int
    durable: bool
    reason: str
    replaced: tuple[tuple[int, int], ...] = ()
    """``(host, holder)`` pairs: ``host`` has no copy of its part (a replaced host), and
    ``holder`` keeps a replica of it (the first of them)."""
    sources: Mapping[str, tuple[int, ...]] | None = None
    """A replaced host or a restore onto another mesh (issue 26): ``{data file: hosts of the
    job whose tier holds it}`` (a part's own host first, then the holders of its replicas),
    for every data file of the save the hosts hold; None when every host reads its own part.
    A rank reads a byte range from its own host's tier when its host is listed, else from a
    listed peer's tier over the network, else from the durable tier."""


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _holders(own: Mapping[int, LocalStep], reps: Sequence[tuple[int, LocalStep]], save_id: str
             ) -> tuple[dict[str, list[int]], set[int]]:
    """``({data file: hosts holding it}, saved ranks covered)`` from the hosts' own parts and
    the replicas they hold of ``save_id`` (a part's own host first, then holders by index);
    a part with a file gone counts for nothing."""
    holders: dict[str, list[int]] = {}
    covered: set[int] = set()
    for holder, s in sorted([(h, s) for h, s in own.items()] +
                            [(h, s) for h, s in reps if s.save_id == save_id],
                            key=lambda x: (x[1].host != x[0], x[0])):
        if s.missing:
            continue
        covered.update(s.ranks)
        for f in s.files:
            if holder not in holders.setdefault(f, []):
                holders[f].append(holder)
    return holders, covered


def choose_local(inventories: Mapping[int, Sequence[LocalStep]], *, world_size: int,
                 lease_epoch: int, durable: DurableLatest | None,
                 durable_save_id: Callable[[str], str | None],
                 replicas: Mapping[int, Sequence[LocalStep]] | None = None,
                 ) -> tuple[LocalChoice | None, str]:
    """Rank 0: the newest local step to restore, or None, with the reason (logged).

    Args:
        inventories: every host's :meth:`LocalTier.inventory`, by host index (every host of
            the job must be there, an empty list for a host without a tier or a step).
        world_size: the job's world size now.
        lease_epoch: the run folder's lease epoch now (0: none).
        durable: the newest committed durable checkpoint (None: none).
        durable_save_id: the save id of the durable run folder's committed checkpoint of a
            folder name, None when it has none (asked only of candidates).
        replicas: every host's :meth:`LocalTier.replicas` (other hosts' parts it holds), by
            the holding host's index.

    The rules (DESIGN "tiers"):

    * lineage: only parts of the run folder's lease epoch (the newest incarnation that
      saved).  A part of an older epoch is a fenced incarnation's (or one a successor has
      since moved past), never chosen; a part of a newer epoch than the run folder's lease
      (or of any epoch when it has none) is another job's, whose run folder at the same URI
      was deleted and made anew (a lease epoch never goes down), never chosen;
    * the same mesh (the saved world size): every host committed the step, with the same
      save id, or a host of the job now holds a committed replica of that host's part with
      every file there (issue 26: a replaced host, whose ranks read their boxes from the
      holders' tiers, :attr:`LocalChoice.sources`); a host that lacks a file its ranks
      need is acceptable only if the durable tier holds the same save (what it lacks comes
      from there, by byte range);
    * another mesh (issue 26, resharding from the tiers: another world size, hosts gone or
      new): the hosts of the job hold, as own parts or committed replicas, the part of every
      saved rank with every file, or the durable tier holds the same save; each rank then
      reads every box from its own host's tier, a peer's (:attr:`LocalChoice.sources`) or
      the durable tier, in that order;
    * never older than the newest durable step (same step and save: the local tier).
    """
    if not inventories:
        return None, "no host has a local tier"
    lineage = lease_epoch
    by_name: dict[str, dict[int, LocalStep]] = {}
    for host, inv in inventories.items():
        for s in inv:
            by_name.setdefault(s.name, {})[host] = s
    held: dict[str, list[tuple[int, LocalStep]]] = {}  # name: (holder, replica)
    for holder, inv in (replicas or {}).items():
        for s in inv:
            if holder in inventories and s.host != holder and not s.missing:
                held.setdefault(s.name, []).append((holder, s))
    candidates: list[tuple[int, str, LocalStep, bool, tuple[tuple[int, int], ...],
                           dict[str, tuple[int, ...]] | None]] = []
    skipped: list[str] = []
    for name in sorted(set(by_name) | set(held)):
        own = by_name.get(name, {})
        # a replica of another lineage (a stale incarnation's, another job's) never counts
        reps = [(h, r) for h, r in held.get(name, []) if r.lease_epoch == lineage]
        if not own and not reps:
            skipped.append(f"{name}: only replicas of another lease epoch than {lineage}")
            continue
        ref = next(iter(own.values()), None) or reps[0][1]
        parts = list(own.values()) + [s for _, s in reps if s.save_id == ref.save_id]
        if any(s.save_id != ref.save_id for s in own.values()):
            skipped.append(f"{name}: hosts hold different saves")
            continue
        if any(s.lease_epoch > lineage for s in parts):
            skipped.append(f"{name}: written by lease epoch {max(s.lease_epoch for s in parts)}"
                           f", the run folder's lease is at epoch {lineage} (the run folder "
                           "was made anew: another job's copy)")
            continue
        if any(s.lease_epoch != lineage for s in parts):
            skipped.append(f"{name}: written by lease epoch {ref.lease_epoch}, the lineage "
                           f"is epoch {lineage} (a stale incarnation's copy)")
            continue
        in_durable = durable_save_id(name) == ref.save_id
        if ref.world_size == world_size:
            hosts = dict(own)
            via: list[tuple[int, int]] = []  # a replaced host: (host, holder of its replica)
            for g in sorted(set(inventories) - set(hosts)):
                ok = sorted(((h, s) for h, s in reps
                             if s.host == g and s.save_id == ref.save_id), key=lambda x: x[0])
                if ok:
                    hosts[g] = ok[0][1]
                    via.append((g, ok[0][0]))
            if len(hosts) != len(inventories):
                skipped.append(f"{name}: committed on hosts {sorted(hosts)} of "
                               f"{sorted(inventories)}")
                continue
            if not in_durable and not all(s.complete for s in hosts.values()):
                bad = [s.host for s in hosts.values() if not s.complete]
                skipped.append(f"{name}: hosts {bad} lack files and the durable tier does "
                               "not hold this save")
                continue
            sources = None
            if via:  # a replaced host reads its boxes from the holders' tiers
                holders, _ = _holders(own, reps, ref.save_id)
                sources = {f: tuple(h) for f, h in sorted(holders.items())}
            candidates.append((ref.num_updates, name, ref, in_durable, tuple(via), sources))
            continue
        # Another mesh: each saved part from whichever host of the job holds it.
        holders, covered = _holders(own, reps, ref.save_id)
        lacking = sorted(set(range(ref.world_size)) - covered)
        if lacking and not in_durable:
            skipped.append(f"{name}: saved by {ref.world_size} ranks, the job has "
                           f"{world_size}; no host of the job holds the part of saved ranks "
                           f"{lacking[:8]} and the durable tier does not hold this save")
            continue
        candidates.append((ref.num_updates, name, ref, in_durable, (),
                           {f: tuple(h) for f, h in sorted(holders.items())}))
    if durable is not None and durable.lease_epoch > lineage:
        return None, (f"the durable {durable.name} is of a newer lease epoch "
                      f"({durable.lease_epoch})")
    if not candidates:
        return None, "; ".join(skipped) or "no committed local step"
    candidates.sort(key=lambda c: (c[0], c[1]))
    n, name, first, in_durable, replaced, sources = candidates[-1]
    if durable is not None and durable.num_updates > n and durable.lease_epoch >= lineage:
        return None, (f"the durable {durable.name} (update {durable.num_updates}) is newer "
                      f"than every local step (newest {name}, update {n})")
    from_replicas = "".join(f"; host {g}'s part from host {h}'s replica" for g, h in replaced)
    if sources is not None and first.world_size != world_size:
        reason = (f"the hosts' tiers hold {name} (update {n}, lease epoch {lineage}, saved by "
                  f"{first.world_size} ranks, restored onto {world_size}): each rank reads "
                  "its boxes from its own host's tier, a peer's, or the durable tier")
    else:
        reason = (f"every host committed {name} (update {n}, lease epoch {lineage}) in its "
                  f"local tier{from_replicas}")
    return LocalChoice(name=name, save_id=first.save_id, num_updates=n, durable=in_durable,
                       reason=reason, replaced=replaced, sources=sources), ""
