"""The checkpoint manager's config section (``checkpoint:`` in YAML), with fairseq's names."""

from __future__ import annotations

from dataclasses import dataclass, field

from xla_ckpt.checks import check_int, check_number
from xla_ckpt.errors import ConfigError


@dataclass(kw_only=True)
class CheckpointConfig:
    """What :class:`xla_ckpt.manager.CheckpointManager` saves, when, and what it keeps.

    Field names follow fairseq's ``checkpoint`` options (``--save-interval-updates`` ...);
    ``-1`` means "keep all" for the ``keep_*`` counts, ``0`` turns a schedule off.

    Attributes:
        save_dir: run folder (local path or ``gs://bucket/prefix``) holding
            ``checkpoint_<epoch>_<updates>/``, ``checkpoint<epoch>/`` and the pointers
            ``checkpoint_last.json`` / ``checkpoint_best.json``.
        restore_file: what ``restore_or_initialize`` restores: ``"checkpoint_last"``
            (latest committed, the default), ``"checkpoint_best"``, a checkpoint folder
            name in ``save_dir``, or a full checkpoint URI.
        no_save: never save (restore still works).
        save_interval_epochs: save ``checkpoint<epoch>`` at the end of every N-th epoch
            (fairseq ``save_interval``); 0 = no end-of-epoch saves.
        save_interval_updates: save ``checkpoint_<epoch>_<updates>`` every N updates; 0 = off.
        save_interval_seconds: also save ``checkpoint_<epoch>_<updates>`` at the first update
            boundary at least this many seconds after the last durable save began (rank 0's
            clock, agreed by every rank); 0 = off.  With a local tier, the durable schedule
            in time while the local tier saves every few updates.
        no_epoch_checkpoints: do not save end-of-epoch checkpoints at all.
        keep_interval_updates: keep the newest N update checkpoints (``checkpoint_E_U``).
        keep_last_epochs: keep the newest N epoch checkpoints (``checkpointE``).
        keep_best_checkpoints: also keep the N best checkpoints by ``best_checkpoint_metric``
            (0: the metric only moves the ``checkpoint_best`` pointer, whose target is never
            deleted; -1: keep every checkpoint that has the metric).
        best_checkpoint_metric: metric name (a key of the ``metrics`` passed on save).
        maximize_best_checkpoint_metric: higher metric is better.
        async_save: stage to host memory on the training thread, upload in a
            background thread; at most one save in flight.  (Off: the training thread
            writes the live state itself and waits for the commit.)
        reuse_staging_buffers: keep the host buffers of the last async save for the next
            one (one copy of the state stays in host memory; saves the page faults of
            fresh allocations, several times the copy itself).  Saves with a local copy
            use no staging buffer: they copy into the local data files' pages, recycling
            the files keep-last-K evicts (:mod:`xla_ckpt.io.mapped_writer`).
        handle_sigterm: install a SIGTERM handler that asks for a save at the next
            update boundary (preemption on Cloud TPU / GKE spot).
        exit_on_preemption: after the preemption save commits, raise ``SystemExit(0)``.
        sync_interval_updates: ranks exchange their preemption flag and save status
            every N updates (one small all-gather on the control plane; it waits at most
            ``dist.timeout_s``, like every collective).
        exit_grace_s: seconds an async save already handed off may take to commit when
            the loop stops with an exception (Ctrl-C, ``SystemExit``, an error) inside
            ``with manager:``; a second Ctrl-C, a failure, or the end of the grace abandons
            it, named in an ERROR line (the previous checkpoint and pointers stay as they
            were).  0: abandon at once (its parts are deleted).

        local_dir: the local tier (:mod:`xla_ckpt.run.local_tier`): a folder on each host
            that outlives the training process but not the host (``/dev/shm/xla_ckpt`` on
            a TPU VM, an ``emptyDir`` with ``medium: Memory`` on GKE, a local SSD).  Every
            save then stages into it and the durable upload reads its bytes; a restore of
            ``checkpoint_last`` takes the newest step every host holds there when it is
            not older than the newest durable one.  ``{host}`` in it becomes the host
            index (emulated hosts on one machine, each with its own folder).  ``""``: no
            local tier.
        local_interval_updates: also save to the local tier alone every N updates (0: only
            the durable schedule's saves go through it).
        local_policy: ``"interval"`` (``local_interval_updates``) or ``"continuous"``:
            start the next local save as soon as the last save finished, at most every
            ``local_min_interval_s`` seconds (rank 0's clock).
        local_min_interval_s: the continuous policy's minimum interval (seconds).
        keep_local_checkpoints: committed local steps each host keeps (the newest).
        local_max_bytes: at most this many bytes in a host's local tier (0: no limit); a
            local save that would not fit after keep-last pruning is skipped with a
            WARNING naming the sizes (a durable save then writes straight to durable).
            Replicas of other hosts' parts count against it too.
        local_replicas: after each local commit, copy each host's part to this many other
            hosts' local tiers in the background (issue 26; :mod:`xla_ckpt.manager.
            replication`), so a replaced host resumes from its peers' memory; 0: none.
            Needs more than one host (and a Dist over every process of the job).
        local_replica_domains: each host's failure domain, ``{host index: name}`` (one TPU
            slice, one GKE node pool); a replica never lands in its source's domain.  Hosts
            not named are each a domain of their own (the default).

    How a restore moves the bytes (every rank reads, or rank 0 broadcasts) is
    :class:`xla_ckpt.restore.RestoreConfig` (section ``restore``).

    Raises:
        ConfigError: a value of the wrong type or out of range (names ``checkpoint.<field>``
            and the value).
    """

    save_dir: str = "checkpoints"
    restore_file: str = "checkpoint_last"
    no_save: bool = False
    save_interval_epochs: int = 1
    save_interval_updates: int = 0
    save_interval_seconds: float = 0.0
    no_epoch_checkpoints: bool = False
    keep_interval_updates: int = -1
    keep_last_epochs: int = -1
    keep_best_checkpoints: int = 0
    best_checkpoint_metric: str = "loss"
    maximize_best_checkpoint_metric: bool = False
    async_save: bool = True
    reuse_staging_buffers: bool = True
    handle_sigterm: bool = True
    exit_on_preemption: bool = True
    sync_interval_updates: int = 1
    exit_grace_s: float = 30.0
    local_dir: str = ""
    local_interval_updates: int = 0
    local_policy: str = "interval"
    local_min_interval_s: float = 0.0
    keep_local_checkpoints: int = 2
    local_max_bytes: int = 0
    local_replicas: int = 1
    local_replica_domains: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        s = "checkpoint"
        for name in ("save_dir", "restore_file", "best_checkpoint_metric"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v.strip():
                raise ConfigError(f"{s}.{name} must be a non-empty string, got {v!r}")
        for name in ("save_interval_epochs", "save_interval_updates"):
            check_int(s, name, getattr(self, name), 0)
        for name in ("keep_interval_updates", "keep_last_epochs", "keep_best_checkpoints"):
            check_int(s, name, getattr(self, name), -1)
        check_int(s, "sync_interval_updates", self.sync_interval_updates, 1)
        check_number(s, "exit_grace_s", self.exit_grace_s, positive=False)
        if not isinstance(self.local_dir, str):
            raise ConfigError(f"{s}.local_dir must be a folder path or '', got {self.local_dir!r}")
        check_int(s, "local_interval_updates", self.local_interval_updates, 0)
        check_int(s, "keep_local_checkpoints", self.keep_local_checkpoints, 1)
        check_int(s, "local_max_bytes", self.local_max_bytes, 0)
        check_int(s, "local_replicas", self.local_replicas, 0)
        domains = self.local_replica_domains
        if not isinstance(domains, dict) or not all(
                isinstance(v, str) and str(k).lstrip("-").isdigit() for k, v in domains.items()):
            raise ConfigError(f"{s}.local_replica_domains must map host indices to domain "
                              f"names ({{0: slice-a, 1: slice-b}}), got {domains!r}")
        self.local_replica_domains = {int(k): v for k, v in domains.items()}
        check_number(s, "local_min_interval_s", self.local_min_interval_s, positive=False)
        check_number(s, "save_interval_seconds", self.save_interval_seconds, positive=False)
        if self.local_policy not in ("interval", "continuous"):
            raise ConfigError(f"{s}.local_policy must be 'interval' or 'continuous', got "
                              f"{self.local_policy!r}")
        for name in ("no_save", "no_epoch_checkpoints", "maximize_best_checkpoint_metric",
                     "async_save", "reuse_staging_buffers", "handle_sigterm",
                     "exit_on_preemption"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{s}.{name} must be true or false, got {getattr(self, name)!r}")
