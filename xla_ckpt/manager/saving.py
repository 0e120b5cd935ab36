"""The save path of :class:`~xla_ckpt.manager.CheckpointManager`: write, upload, agree, commit.

A save (:meth:`SavePath.save`, or a scheduled one from ``after_update``) writes
this rank's items, from the training thread (sync) or from a host snapshot on
the save thread (async); :meth:`SavePath._sync`, at update boundaries, lets the
ranks agree on its progress and, once every rank's upload is done, starts the
coordinator's commit: manifest, ``checkpoint_last`` / ``checkpoint_best``
pointers (best-N comparison), rotation.  A failure on any rank is raised on
every rank (:meth:`SavePath._fail`).

A save takes the steps of :mod:`xla_ckpt.restore.save_steps`, as
:func:`~xla_ckpt.restore.save_distributed` does.  Before anything is written the ranks agree
on the save (one exchange that also carries rank 0's save id, whether a newer lease fences
it, and its best score): different checkpoint folders, states holding different tensors, or
``shards`` passed on some ranks only, are refused on every rank.  A state holding sharded
tensors (DTensor, XLA SPMD) takes the chunked path:
:func:`~xla_ckpt.restore.owners.plan_chunked_save` (collective, on the training thread)
decides who writes which box; each rank's boxes go into its one data file as item
``chunks/<r>`` with its ``rank/<r>`` and ``shard/<r>`` items (an async save first copies
them to reused host buffers, :func:`~xla_ckpt.manager.staging.stage_payload`, or, with a
local tier, straight into the pages of its local data file,
:func:`~xla_ckpt.manager.local_save.stage_local`); rank 0 commits
the state tree as a chunked item plus the global tensors' chunk tables
(:func:`~xla_ckpt.restore.save_steps.commit_save`).

Ctrl-C in the training thread while an async save uploads: on a backend that lists
what interrupted writes leave (``Storage.lists_in_flight``: gs://) the upload runs on
a daemon thread, so the process never waits for it at exit; closing the manager
(its ``with`` block, or :meth:`close` interrupted) closes the save's storage, which
abandons the upload and deletes its parts within a bound, and whatever is left
(SIGKILL) is listed by ``xla-ckpt ls`` and collected by ``xla-ckpt gc --in-flight``.
On other backends (a local folder, whose writes leave nothing the tools can list)
the upload runs on the manager's save thread as before, and exit waits for it.

Fencing (:mod:`xla_ckpt.run.fencing`): every save runs under this incarnation's lease
epoch, recorded in the manifest metadata (``lease_epoch``).  Rank 0 looks at the lease
before any rank writes (a fenced save writes nothing); the commit job checks it again
right before the commit marker, before the pointers and before rotation.  The commit
marker is created with ``if_generation_match=0`` (only a newer incarnation replaces an
older one's checkpoint of the same name, by compare-and-swap on its generation); the
pointers move by compare-and-swap and never backwards in ``(lease_epoch, num_updates)``;
rotation deletes nothing of a newer epoch.  A newer lease, or a pointer or manifest of a
newer epoch, raises :class:`~xla_ckpt.errors.FencedError` on every rank (through
:meth:`SavePath._fail`), and the manager refuses every later save at once.  What the one
step after a passed check can still do is the residual window described in
:mod:`xla_ckpt.run.fencing`.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import math
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, SupportsFloat

from xla_ckpt.errors import CheckpointSaveError, FencedError
from xla_ckpt.io.writer import discard, remove_other_data_files
from xla_ckpt.manager import local_save, lockstep
from xla_ckpt.manager.base import InFlightSave, ManagerBase, logger
from xla_ckpt.manager.best import RESERVED_METADATA
from xla_ckpt.manager.naming import preemption_name
from xla_ckpt.manager.rotation import rotate
from xla_ckpt.manager.staging import stage_payload
from xla_ckpt.restore import save_steps as steps
from xla_ckpt.run.catalog import LEASE_EPOCH_KEY, epoch_of, read_pointer_doc, write_pointer
from xla_ckpt.run.fencing import Lease, check_lease, fenced_error
from xla_ckpt.run.local_tier import LocalStep

StateArg = Any  # a state, or a zero-argument callable returning it
MetricValues = Mapping[str, SupportsFloat]  # numbers, numpy scalars, one-element tensors


def _status(fut: cf.Future | None) -> str:
    if fut is None:
        return ""
    if not fut.done():
        return "pending"
    exc = fut.exception()
    return "done" if exc is None else f"error:{type(exc).__name__}: {exc}"


def _done_future(value: Any) -> cf.Future:
    f: cf.Future = cf.Future()
    f.set_result(value)
    return f


def _failed_future(exc: BaseException) -> cf.Future:
    f: cf.Future = cf.Future()
    f.set_exception(exc)
    return f


def _on_daemon_thread(name: str, fn: Any, *args: Any, started: list | None = None) -> cf.Future:
    """Run ``fn(*args)`` on a new daemon thread (never joined at exit); its future (also
    appended to ``started`` before the thread starts, so a Ctrl-C that lands while it starts
    still finds it)."""
    fut: cf.Future = cf.Future()
    fut.set_running_or_notify_cancel()
    if started is not None:
        started.append(fut)

    def work() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the future's owner
            fut.set_exception(e)
        else:
            fut.set_result(result)

    threading.Thread(target=work, name=name, daemon=True).start()
    return fut


def _register_exit_hook(fn: Any, *args: Any) -> None:
    """Run ``fn(*args)`` at interpreter exit while thread pools still take work.

    ``threading._register_atexit`` hooks run before ``concurrent.futures`` shuts its pools
    down (that module registers its own hook the same way, at import, and the hooks run in
    reverse order), so a save finished at exit can still submit its commit; plain ``atexit``
    runs after the pools are closed.  Falls back to ``atexit`` where the hook is missing."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(fn, *args)
        return
    register(fn, *args)


def _report_at_exit(ref: weakref.ref) -> None:
    mgr = ref()
    if mgr is not None:
        mgr._report_unclosed_at_exit()


class SavePath(ManagerBase):
    """Saving: :meth:`save`, :meth:`wait`, and the upload/commit machinery behind them."""

    _committed_before: str | None = None  # the newest checkpoint this manager saw commit
    _exit_hook: bool = False  # _report_at_exit is registered for this manager

    @property
    def in_flight(self) -> str | None:
        """Name of the save being uploaded or committed, or None."""
        return self._inflight.name if self._inflight else None

    @property
    def lease(self) -> Lease | None:
        """This incarnation's lease of the run folder (every rank), once it saved or called
        ``take_over()``; None before.  Pass it to :func:`~xla_ckpt.restore.save_distributed`
        (``lease=``) to commit a save of its own under this manager's fencing; it names this
        manager's run folder (:attr:`Lease.run`), so such a save must go directly under it."""
        return dataclasses.replace(self._lease, run=self.run.uri) if self._lease else None

    def save(self, state: StateArg, *, epoch: int, num_updates: int, name: str | None = None,
             rank_state: StateArg = None, shards: StateArg = None, end_of_epoch: bool = False,
             metrics: MetricValues | None = None, block: bool | None = None) -> str:
        """Save now, outside the schedule.  Collective: every rank calls it.

        ``state``, ``rank_state``, ``shards`` as :meth:`after_update`: a state holding
        DTensors (FSDP2 / tensor parallel) is saved chunked, each rank writing the boxes
        it owns; an async save (``block=False``) returns once this rank's boxes (and its
        other items) are copied to host buffers, so later in-place updates of the
        parameters and optimizer state do not reach the checkpoint (CASES C20).

        Args:
            name: checkpoint folder name (default: the preemption-style
                ``checkpoint_<epoch>_<updates>``, or ``checkpoint<epoch>`` at an
                epoch end that the schedule saves).
            block: wait until committed (default: ``not config.async_save``).

        Returns:
            The checkpoint folder name.

        Raises:
            CheckpointSaveError: this or the previous save failed on some rank; or the
                ranks hold different state (refused on every rank before anything is
                written, naming the rank and the key).
            FencedError: a newer incarnation of the job took the run folder over (every
                rank; this and every later save of this manager).
        """
        self._check_open()
        name = name or preemption_name(self.config, epoch=epoch, num_updates=num_updates,
                                       end_of_epoch=end_of_epoch)
        with self._at(lockstep.position("save", name=name, epoch=epoch, num_updates=num_updates,
                                        end_of_epoch=end_of_epoch, metrics=metrics)):
            self._save(state, rank_state, shards, name=name, epoch=epoch,
                       num_updates=num_updates, end_of_epoch=end_of_epoch, metrics=metrics,
                       preempted=False,
                       block=(not self.config.async_save) if block is None else block)
        return name

    def wait(self) -> tuple[str, ...]:
        """Block until the in-flight save (if any) committed on every rank.  Collective.

        Every rank calls it, with or without a save in flight (so a rank that skipped a save
        the others started is caught here: :class:`~xla_ckpt.errors.ScheduleMismatchError`).

        Returns:
            Names of checkpoints whose commit was confirmed during this call.

        Raises:
            CheckpointSaveError: the save failed on some rank (every rank raises it).
            ScheduleMismatchError: the ranks are at different points of the schedule (one
                saves or updates while another waits; every rank, naming each one's position).
            CollectiveTimeoutError: another rank did not reach this call in time (named).
        """
        if self._inflight is None and (self._collective_broken or self._closed):
            return ()  # the group is unusable: no collective to agree on nothing
        with self._at(lockstep.position("wait")):
            return tuple(self._sync(block=True))

    # ---- leaving with a save in flight (CASES C27) -------------------------------------------
    def _finish_on_exit(self, exc: BaseException | None) -> None:
        """Every rank, leaving ``with manager:`` with an exception (Ctrl-C, ``SystemExit``, an
        error in the loop): commit the save already handed off within ``exit_grace_s``, or
        name it as abandoned (ERROR).  Collective as :meth:`wait` is, run on a helper thread
        that this thread waits for at most the grace; a second Ctrl-C abandons at once.
        Never raises for the save (the exception leaving the block is the one that counts),
        except a second ``KeyboardInterrupt``, re-raised after the ERROR line.
        """
        fl = self._inflight
        if fl is None:
            return
        why = type(exc).__name__ if exc is not None else "exit"
        grace = float(self.config.exit_grace_s)
        if grace <= 0:
            self._abandon(fl, f"leaving on {why} with exit_grace_s=0")
            return
        if self._collective_broken:
            self._abandon(fl, f"leaving on {why}; the ranks' group is broken, so no rank can "
                              "agree on the commit")
            return
        logger.warning("[rank %d] leaving on %s: finishing the save of %s before exiting (up "
                       "to exit_grace_s=%g s; Ctrl-C again abandons it)", self.rank, why,
                       fl.storage.uri, grace)
        outcome: dict[str, Any] = {}

        def finish() -> None:
            try:
                outcome["committed"] = self.wait()
            except BaseException as e:  # noqa: BLE001 - reported by the waiting thread
                outcome["error"] = e

        t = threading.Thread(target=finish, name=f"xla_ckpt-exit-r{self.rank}", daemon=True)
        t.start()
        try:
            t.join(grace)
        except KeyboardInterrupt:
            self._abandon(fl, f"Ctrl-C again while finishing it (leaving on {why})")
            raise
        if fl.name in outcome.get("committed", ()):
            logger.warning("[rank %d] committed %s on the way out (leaving on %s)", self.rank,
                           fl.storage.uri, why)
        elif "error" in outcome:
            err = outcome["error"]
            self._abandon(fl, f"leaving on {why}, finishing it failed: "
                              f"{type(err).__name__}: {err}")
        else:
            self._abandon(fl, f"leaving on {why}, it did not commit within exit_grace_s="
                              f"{grace:g} s")

    def _abandon(self, fl: InFlightSave, reason: str) -> None:
        """Give ``fl`` up (rank 0's commit job will not write its commit marker) and say so
        in one ERROR line naming the checkpoint, the reason and what stays."""
        with fl.gate:  # a commit marker being written now is let finish: then it counts
            fl.abandoned = True
            committed = fl.manifest_written
        if committed:
            logger.warning("[rank %d] committed %s on the way out (%s; its pointers may not "
                           "name it yet)", self.rank, fl.storage.uri, reason)
            return
        last = self._last_committed_name()
        logger.error("[rank %d] abandoned the save of checkpoint %s: %s.  It is not committed "
                     "(never restored; `xla-ckpt gc --incomplete` removes what it wrote); the "
                     "previous checkpoint%s and the pointers are unchanged", self.rank,
                     fl.storage.uri, reason, f" {last}" if last else "s")

    def _last_committed_name(self) -> str | None:
        """This rank's view of the newest checkpoint committed before the one in flight."""
        if self._committed_before is not None:
            return self._committed_before
        return self.run.url(self.restored_from) if self.restored_from else None

    def _report_unclosed_at_exit(self) -> None:
        """At interpreter exit, for a manager never closed (no ``with manager:``, no
        :meth:`close`): with one process the save in flight is finished within
        ``exit_grace_s`` as leaving ``with manager:`` would (no other rank has to agree);
        with several ranks it is named as abandoned, since the other ranks may be gone and
        the commit is collective."""
        fl = self._inflight
        if fl is None or self._closed or fl.abandoned:
            return
        if self.world_size == 1:
            self._finish_on_exit(None)
            return
        self._abandon(fl, "the process is exiting and the manager was never closed (use "
                          "`with manager:` or close() to commit a save in flight)")

    @contextlib.contextmanager
    def _at(self, pos: lockstep.Position) -> Iterator[None]:
        """This rank's schedule position for the exchanges of one collective call
        (:mod:`~xla_ckpt.manager.lockstep`); a call made inside another keeps the outer one."""
        if self._where is not None:
            yield
            return
        self._where = pos
        try:
            yield
        finally:
            self._where = None

    # ---- internals ----------------------------------------------------------------------
    def _metadata(self, *, epoch: int, num_updates: int, end_of_epoch: bool, preempted: bool,
                  metrics: MetricValues | None) -> dict:
        md: dict[str, Any] = {"epoch": epoch, "num_updates": num_updates,
                              "end_of_epoch": end_of_epoch, "preempted": preempted,
                              "world_size": self.world_size}
        for k, v in (metrics or {}).items():
            if k in RESERVED_METADATA:
                raise ValueError(f"metric name {k!r} is reserved for checkpoint metadata "
                                 f"({', '.join(RESERVED_METADATA)}); rename it")
            try:
                md[k] = float(v.item() if hasattr(v, "item") else v)
            except (TypeError, ValueError):
                raise ValueError(f"metric {k!r} must be a number, got {v!r}") from None
        return md

    def _check_lease_later(self, fence: steps.SaveFence) -> None:
        """Rank 0, after a local-only save's agreement: read the run folder's lease on a
        background thread (:meth:`SaveFence.newer`), unless such a read is still running; the
        next local-only save's agreement carries its answer to every rank."""
        if self._lease_check is not None:
            return
        fut: cf.Future = cf.Future()

        def check() -> None:
            try:
                fut.set_result(fence.newer())  # logs and answers None when unreadable
            except BaseException as e:  # noqa: BLE001 - handed to the next save
                fut.set_exception(e)
        self._lease_check = fut
        threading.Thread(target=check, name="xla_ckpt-lease-check", daemon=True).start()

    def _lease_checked(self) -> tuple[int, dict] | None:
        """Rank 0: the background lease read's answer once it is in (then a new one may
        start), else None (still running, or none started)."""
        fut = self._lease_check
        if fut is None or not fut.done():
            return None
        self._lease_check = None
        try:
            return fut.result()
        except Exception as e:  # noqa: BLE001 - the durable saves check the lease anyway
            logger.warning("[rank 0] the background read of the lease of %s failed: %s",
                           self.run.uri, e)
            return None

    def _save(self, state: StateArg, rank_state: StateArg, shards: StateArg, *, name: str,
              epoch: int, num_updates: int, end_of_epoch: bool, metrics: MetricValues | None,
              preempted: bool, block: bool, durable: bool = True) -> list[str]:
        self._raise_if_fenced()
        committed = list(self._sync(block=True))  # at most one save in flight
        metadata = self._metadata(epoch=epoch, num_updates=num_updates,
                                  end_of_epoch=end_of_epoch, preempted=preempted, metrics=metrics)
        lease = self._ensure_lease()
        metadata[LEASE_EPOCH_KEY] = lease.epoch
        t0 = time.perf_counter()
        url = self.run.url(name)
        # Every rank evaluates its inputs (the callables may run collectives, e.g. optimizer
        # consolidation), then one exchange carries rank 0's save id (one for every rank's data
        # files, so a failed save's files can be found and removed, and a commit removes the
        # files of earlier saves), whether a newer incarnation holds the lease (then nobody
        # writes), rank 0's score of the checkpoint (a best_fn that raises fails the save on
        # every rank before anything is written), and every rank's save agreement message
        # (restore.save_steps: input failures, URI, sharded or not, tensor and shard layout).
        inputs = steps.evaluate_inputs(state, rank_state, shards)
        fence = steps.SaveFence(self.run, lease)

        def head() -> dict[str, Any]:  # rank 0's, in the agreement exchange
            # A durable save reads the lease now; a local-only save does not wait for GCS on
            # the training thread: it takes the answer of the read the previous local-only
            # save started in the background (a fenced incarnation's local steps are never
            # restored anyway: their lease epoch is not the run folder's).
            newer = fence.newer() if durable else self._lease_checked()
            return {"newer": newer, "score": self._score(name, metadata)}

        got, agreed = steps.agree_on_save(self._exchange, self.rank, inputs, url, head=head)
        save_id, newer, scored = got["save_id"], got["newer"], got["score"]
        if newer is not None:
            self._fenced = fenced_error(self.run, lease, newer[0], newer[1],
                                        what=f"to save {name}")
            self._raise_if_fenced()
        if scored[0] == "error":
            raise CheckpointSaveError(f"saving checkpoint {url} failed: best_fn "
                                      "raised on its metrics (nothing was written)",
                                      {0: scored[1]})
        what = "saving checkpoint {uri}"
        steps.refuse(agreed, inputs, exchange=self._exchange, what=what,
                     error=CheckpointSaveError, defer_input_errors=True)
        plan = steps.plan(self.dist, agreed, inputs, what=what, error=CheckpointSaveError)
        storage = self.run.child(name)
        buffers: list = []
        nbytes = 0
        # The local tier (manager.local_save): every save writes there first when every host
        # has room; a local-only save without room is skipped (agreed by every rank).
        tier = self._tier
        own_copy = (tier is not None and plan is None and self.rank != 0 and self._host_leader
                    and not agreed.input_errors)  # this host's own copy of the replicated state
        local, host_ranks = False, dict[int, list[int]]()
        if tier is not None:
            self._pages.forget_unlinked()  # pruned files' pages freed before the room check
            chunk = plan.chunk_item() if plan is not None else None
            est = local_save.nbytes_of([inputs.state if plan is None and (
                self.rank == 0 or own_copy) else None, inputs.rank_state, inputs.flat,
                list(chunk[1]) if chunk is not None else None]) \
                if not agreed.input_errors else 0
            local, host_ranks = local_save.agree_on_room(self._exchange, tier, host=self._host,
                                                         name=name, nbytes=est,
                                                         leader=self._host_leader)
            if not local and not durable:
                storage.close()
                return committed
        own_copy = own_copy and local

        def in_flight(upload: cf.Future) -> InFlightSave:
            keep_plan = self.rank == 0 or local
            return InFlightSave(name=name, save_id=save_id, metadata=metadata, storage=storage,
                             upload=upload, staged_bytes=nbytes, t0=t0, buffers=buffers,
                             score=scored[1], plan=plan if keep_plan else None, local=local,
                             durable=durable, host_ranks=host_ranks,
                             local_storage=tier.step_storage(name) if local and tier else None)

        started: list[cf.Future] = []  # the upload, once it runs
        try:
            if agreed.input_errors:
                # Some rank's inputs failed: nobody writes; every rank raises it in _sync.
                upload = (_failed_future(inputs.error) if inputs.error is not None
                          else _done_future([]))
            else:
                mine = steps.payload(inputs, agreed, plan, self.rank)
                if block and local:
                    assert tier is not None
                    upload = _done_future(local_save.write_local(
                        tier, name, save_id, mine, self.rank, pages=self._pages,
                        own_state=inputs.state if own_copy else None,
                        direct=storage if durable else None))
                elif block:
                    # The caller waits anyway: write the live state from this thread, no copy.
                    upload = _done_future(steps.write_payload(storage, save_id, mine, self.rank))
                else:
                    staged_local, local_error = None, ""
                    if local:
                        assert tier is not None
                        try:  # straight into the tier's pages: the save's one copy
                            staged_local = local_save.stage_local(
                                tier, name, save_id, mine, self.rank, pages=self._pages,
                                own_state=inputs.state if own_copy else None)
                            nbytes = staged_local.nbytes
                        except OSError as e:
                            local_error = repr(e)
                            local_save.failed(tier, name, self.rank, local_error,
                                              durable=durable)
                    fn: Any
                    args: tuple
                    if staged_local is not None:
                        fn, args = local_save.finish_local, (staged_local, tier, name, self.rank)
                        if durable:
                            fn = functools.partial(fn, direct=storage)
                    elif local and not durable:  # dropped; the previous local step stays
                        fn, args = local_save.LocalPart, ([], [], local_error)
                    else:
                        host, buffers, nbytes = stage_payload(mine, self._pool)
                        fn, args = steps.write_payload, (storage, save_id, host, self.rank)
                        if local:  # the local copy failed: a durable save goes direct
                            fn, args = local_save.direct_part, (local_error, *args)
                        del host
                    if not self._exit_hook:  # a save handed off is never lost unsaid
                        _register_exit_hook(_report_at_exit, weakref.ref(self))
                        self._exit_hook = True
                    if storage.lists_in_flight:
                        # Ctrl-C must not wait for the upload (see the module docstring).
                        upload = _on_daemon_thread(f"xla_ckpt-upload-r{self.rank}",
                                                   fn, *args, started=started)
                    else:
                        upload = self._executor.submit(fn, *args)
                    del staged_local, args
                del mine
        except Exception as e:  # noqa: BLE001 - agreed on with the other ranks in _sync
            upload = _failed_future(e)
        except BaseException:
            # Ctrl-C while the upload thread starts: it runs, so the save is in flight (the
            # way out commits it or names it: _finish_on_exit).
            if started:
                self._inflight = in_flight(started[0])
                if durable:
                    self._last_saved = (name, num_updates)
            raise
        self._inflight = in_flight(upload)
        del inputs
        if self.rank == 0 and not durable:
            # Once the staging copy is over (the read and the emulator's or network's work
            # never share the CPU with the training thread's copy).
            self._check_lease_later(fence)
        if durable:  # a local-only save never stands in for a durable one (preemption)
            self._last_saved = (name, num_updates)
        if local and self.rank == 0:
            self._local_started = t0
        if durable and self.rank == 0:
            self._durable_started = t0
        logger.debug("[rank %d] %s %s: %d bytes in %.3f s", self.rank,
                     "wrote" if block else "staged", name, nbytes, time.perf_counter() - t0)
        if block:
            committed += self._sync(block=True)
        return committed

    def _commit_local(self, fl: InFlightSave, parts: list, errors: dict[int, str],
                      own_state: list) -> LocalStep | None:
        """Each host's leader, once every rank wrote: the host commit (manifest, marker,
        keep-last-K), or the removal of a failed local save.  Never raises: the local tier
        is a copy, and the durable schedule goes on.  Returns the step committed here."""
        tier = self._tier
        if tier is None or not self._host_leader:
            return None
        # A durable save's copy (phase "copy") still reads the local files of the ranks whose
        # write succeeded: an uncommitted folder is removed once every rank copied
        # (_drop_uncommitted_local), not here.
        if errors:
            if not fl.durable:
                tier.discard(fl.name, fl.save_id)
            logger.warning("[rank %d] host %d: %s not committed in the local tier (rank(s) %s "
                           "failed: %s)", self.rank, self._host, fl.name,
                           sorted(errors), "; ".join(sorted(set(errors.values()))))
            return None
        try:
            assert self._lease is not None  # _save took it
            step = local_save.commit_host(
                tier, name=fl.name, save_id=fl.save_id, gathered=parts, own_state=own_state,
                host_ranks=fl.host_ranks.get(self._host, [self.rank]),
                world_size=self.world_size, plan=fl.plan, metadata=fl.metadata,
                lease_epoch=self._lease.epoch, single_host=len(fl.host_ranks) == 1)
        except Exception as e:  # noqa: BLE001 - the local tier is a copy; logged, training goes on
            if not fl.durable:
                tier.discard(fl.name, fl.save_id)
            logger.warning("[rank %d] host %d: the local commit of %s failed: %s: %s",
                           self.rank, self._host, fl.name, type(e).__name__, e)
            return None
        self.local_committed.append(fl.name)
        logger.info("[rank %d] host %d: committed %s in the local tier %s (%.2f s after "
                    "staging)", self.rank, self._host, fl.name, tier.folder,
                    time.perf_counter() - fl.t0)
        return step

    def _drop_uncommitted_local(self, fl: InFlightSave) -> None:
        """Each host's leader, once every rank's durable copy is over (collective point):
        remove the save's local folder if this host did not commit it."""
        if self._tier is not None and self._host_leader and fl.local \
                and fl.name not in self.local_committed:
            self._tier.discard(fl.name, fl.save_id)

    def _commit_job(self, fl: InFlightSave, every: list[bytes]) -> None:
        """Coordinator only: manifest (commit marker), then pointers, then rotation.

        ``every``: each rank's written items (:func:`~xla_ckpt.restore.save_steps.parts_json`).
        Each step runs only after a check that this incarnation still holds the lease.
        """
        lease = self._lease
        assert lease is not None  # _save took it
        parts = steps.parts_from_json(every, fl.save_id)
        files = {f for p in parts for f in p.files}

        @contextlib.contextmanager
        def gate() -> Iterator[None]:
            with fl.gate:  # never after the save was reported abandoned (_finish_on_exit)
                if fl.abandoned:
                    raise CheckpointSaveError(f"saving checkpoint {fl.storage.uri} was "
                                              "abandoned on the way out; not committed")
                yield
                fl.manifest_written = True

        steps.commit_save(fl.storage, fl.save_id, parts, name=fl.name, plan=fl.plan,
                          metadata=fl.metadata, world_size=self.world_size,
                          fence=steps.SaveFence(self.run, lease), cleanup=False, guard=gate)
        md = fl.metadata
        check_lease(self.run, lease, what=f"to move the pointers to {fl.name} (it is committed, "
                    "but nothing points to it)")
        remove_other_data_files(fl.storage, files)
        if not write_pointer(self.run, "last", fl.name, lease_epoch=lease.epoch,
                             epoch=md["epoch"], num_updates=md["num_updates"]):
            self._pointer_kept("last", fl.name, lease)
        value = fl.score
        if value is not None and math.isfinite(value) and self._is_better(value):
            if write_pointer(self.run, "best", fl.name, lease_epoch=lease.epoch,
                             num_updates=md["num_updates"], metric=self._scorer.label,
                             value=value):
                self._best = value
            else:
                self._pointer_kept("best", fl.name, lease)
        check_lease(self.run, lease, what="to delete old checkpoints")
        try:
            # Only the checkpoint just committed is protected beyond rotation's own rules
            # (pointer targets, the newest committed).  The one this job restored from is
            # rotated like any other: a newer one has committed, so keep-N still means N
            # after a resume (protecting it kept N + 1).
            rotate(self.run, self.config, protect={fl.name}, own_epoch=lease.epoch,
                   scorer=self._scorer)
        except Exception as e:  # noqa: BLE001 - rotation failing must not fail training
            logger.warning("[rank %d] could not delete old checkpoints under %s: %s (will retry "
                           "after the next save)", self.rank, self.run.uri, e)

    def _pointer_kept(self, which: str, name: str, lease: Lease) -> None:
        """A pointer move refused because it names something newer: fenced, if a newer epoch."""
        doc, _ = read_pointer_doc(self.run, which)
        epoch = epoch_of(doc)
        named = doc.get("checkpoint") if isinstance(doc, dict) else None
        if epoch > lease.epoch:
            raise fenced_error(self.run, lease, epoch,
                               what=f"to move checkpoint_{which} to {name} (it names {named!r}, "
                                    f"written by lease epoch {epoch})")
        logger.info("[rank %d] checkpoint_%s of %s left at %r: newer than %s", self.rank, which,
                    self.run.uri, named, name)

    def _is_better(self, value: float) -> bool:
        # fairseq: ties go to the newer checkpoint.
        return self._scorer.better(value, self._best)

    def _score(self, name: str, metadata: dict) -> tuple[str, Any]:
        """Rank 0: ``("ok", score or None)`` of the checkpoint being saved, or ``("error",
        cause)`` when ``best_fn`` raised (:mod:`xla_ckpt.manager.best`)."""
        try:
            return "ok", self._scorer.score(metadata)
        except Exception as e:  # noqa: BLE001 - the user's function: sent to every rank
            logger.error("[rank %d] best_fn raised on the metrics of %s: %s: %s", self.rank,
                         name, type(e).__name__, e)
            return "error", f"{type(e).__name__}: {e}"

    def _sync(self, *, block: bool) -> list[str]:
        """Exchange preemption flags and save progress; advance the in-flight save.  Collective.

        Every rank runs the same branches because they act only on the
        exchanged messages.  With ``block`` it loops until nothing is in flight.
        """
        committed: list[str] = []
        while True:
            fl = self._inflight
            if block and fl is not None:
                waiting = fl.upload if fl.phase == "upload" else fl.commit
                if waiting is not None:
                    cf.wait([waiting])
            if block and fl is not None and fl.phase == "copy" and fl.copy is not None:
                cf.wait([fl.copy])
            msg = (self._notice.requested,
                   _status(fl.upload) if fl is not None and fl.phase == "upload" else
                   _status(fl.copy) if fl is not None and fl.phase == "copy" else "",
                   _status(fl.commit) if fl is not None and fl.phase == "commit" else "",
                   self.rank == 0 and time.perf_counter() - self._local_started
                   >= self.config.local_min_interval_s,
                   self.rank == 0 and self.config.save_interval_seconds > 0
                   and time.perf_counter() - self._durable_started
                   >= self.config.save_interval_seconds)
            msgs = self._exchange(msg)
            self._local_due, self._durable_due = bool(msgs[0][3]), bool(msgs[0][4])
            if any(m[0] for m in msgs):
                self._preempt_agreed = True
            if fl is not None:
                failures = {r: m[1][6:] for r, m in enumerate(msgs) if m[1].startswith("error:")}
                if msgs[0][2].startswith("error:"):
                    failures[0] = msgs[0][2][6:]
                if failures:
                    self._fail(fl, failures)
                if fl.phase == "upload" and fl.local and all(m[1] == "done" for m in msgs):
                    self._local_written(fl)  # local-only saves end here
                elif fl.phase == "copy" and all(m[1] == "done" for m in msgs):
                    fl.phase = "commit"
                    self._drop_uncommitted_local(fl)
                    if self.rank == 0:
                        fl.commit = self._executor.submit(self._commit_job, fl, fl.gathered)
                elif fl.phase == "upload" and all(m[1] == "done" for m in msgs):
                    gathered = self._exchange(steps.parts_json(fl.upload.result()))
                    fl.phase = "commit"
                    if self.rank == 0:
                        fl.commit = self._executor.submit(self._commit_job, fl, gathered)
                elif fl.phase == "commit" and msgs[0][2] == "done":
                    self._inflight = None
                    fl.storage.close()
                    self._recycle(fl)
                    committed.append(fl.name)
                    self._committed_before = fl.storage.uri
                    if self.rank == 0:
                        dt = time.perf_counter() - fl.t0
                        logger.info("[rank %d] committed %s (%d bytes staged on rank 0) %.2f s "
                                    "after staging", self.rank, fl.storage.uri, fl.staged_bytes,
                                    dt)
            if not block or self._inflight is None:
                return committed

    def _local_written(self, fl: InFlightSave) -> bool:
        """Every rank wrote its local part (collective): gather the parts, commit each
        host's copy, then start the durable upload from the local bytes (phase "copy"), or
        finish a local-only save.  True when the save is over."""
        part: local_save.LocalPart = fl.upload.result()
        every = self._exchange((steps.parts_json(part.parts), part.error))
        errors = {r: e for r, (_, e) in enumerate(every) if e is not None}
        parts = steps.parts_from_json([b for b, _ in every], fl.save_id)
        self._replicate(fl.name, self._commit_local(fl, parts, errors, part.own_state),
                        fl.host_ranks)
        self._pages.forget_unlinked()  # what this commit's pruning removed
        self._recycle(fl)  # the durable upload reads the local files, not the staged copy
        if not fl.durable:
            self._inflight = None
            fl.storage.close()
            if fl.local_storage is not None:
                fl.local_storage.close()
            return True
        fl.gathered = [b for b, _ in every]
        fl.phase = "copy"
        if part.direct or part.error is not None or fl.local_storage is None:
            fl.copy = _done_future(None)  # written to durable storage directly
        else:
            fl.copy = self._executor.submit(local_save.copy_to_durable, fl.local_storage,
                                            fl.storage, part.parts)
        return False

    def _recycle(self, fl: InFlightSave) -> None:
        """Hand an uploaded snapshot's host buffers to the pool for the next save."""
        if self._pool is not None and fl.buffers:
            self._pool.release(fl.buffers)
        fl.buffers = []

    def _fail(self, fl: InFlightSave, failures: dict[int, str]) -> None:
        self._inflight = None
        if not fl.durable:  # a local-only save: dropped, training goes on (manager.local_save)
            cf.wait([f for f in (fl.upload,) if f is not None])
            self._recycle(fl)
            if self._tier is not None and self._host_leader:
                self._tier.discard(fl.name, fl.save_id)
            logger.warning("[rank %d] the local save of %s failed on rank(s) %s (%s); the "
                           "previous local step stays", self.rank, fl.name, sorted(failures),
                           "; ".join(sorted(set(failures.values()))))
            fl.storage.close()
            return
        if self._last_saved is not None and self._last_saved[0] == fl.name:
            self._last_saved = None
        # Every rank lets its own upload finish, then rank 0 removes the uncommitted data files.
        cf.wait([f for f in (fl.upload, fl.copy, fl.commit) if f is not None])
        own = None
        for fut in (fl.upload, fl.copy, fl.commit):
            if fut is not None and fut.exception() is not None:
                own = fut.exception()
        self._recycle(fl)
        # Rank 0 tells every rank whether it was fenced (the commit job checks on rank 0 only).
        fence = None
        if self.rank == 0 and isinstance(own, FencedError):
            fence = (str(own), own.own_epoch, own.current_epoch, own.run)
        # Rank 0 removes the stray files *before* the exchange (discard never raises), so no
        # rank returns from the failed save while its files are still being deleted.
        if self.rank == 0 and not fl.manifest_written:
            discard(fl.storage, fl.save_id)
        fence = self._exchange(fence)[0]
        self._drop_uncommitted_local(fl)
        fl.storage.close()
        if fence is not None:
            self._fenced = FencedError(fence[0], own_epoch=fence[1], current_epoch=fence[2],
                                       run=fence[3])
            self._raise_if_fenced()
        what = ("committed, but updating its pointers failed" if fl.manifest_written
                else "nothing was committed; the previous checkpoint and pointers are unchanged")
        raise CheckpointSaveError(f"saving checkpoint {fl.storage.uri} failed ({what})",
                                  failures) from own
