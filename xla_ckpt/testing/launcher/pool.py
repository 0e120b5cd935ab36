"""The parent side of the launcher: :class:`WorkerPool`, :func:`launch`, :func:`shared_pool`.

The parent hosts the rendezvous ``TCPStore``, spawns one
:func:`~xla_ckpt.testing.launcher.worker._worker_main` process per rank, sends
each call to every rank and collects one :class:`RankResult` per rank (with a
hard timeout).  See the package docstring for the environment each rank gets.
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing as mp
import multiprocessing.connection as mpc
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from xla_ckpt.storage.base import SOURCE_ADDRESS_ENV
from xla_ckpt.testing.fault_proxy.hosts import MAX_EMULATED_HOSTS, host_address
from xla_ckpt.testing.launcher.results import RankResult, RemoteError, _unpack_exception
from xla_ckpt.testing.launcher.worker import _worker_main

DEFAULT_START_TIMEOUT_S = 120.0
DEFAULT_RUN_TIMEOUT_S = 120.0
_KILL_GRACE_S = 3.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_hosts(world_size: int, hosts: int) -> int:
    """Ranks per emulated host (``world_size // hosts``), after checking the split is even.

    Raises:
        ValueError: ``hosts`` is not an integer in ``[1, world_size]`` (and at most
            :data:`~xla_ckpt.testing.fault_proxy.hosts.MAX_EMULATED_HOSTS`), or
            ``world_size`` is not a multiple of it.
    """
    if not isinstance(hosts, int) or isinstance(hosts, bool) or hosts < 1:
        raise ValueError(f"hosts must be an integer >= 1, got {hosts!r}")
    if hosts > MAX_EMULATED_HOSTS:
        raise ValueError(f"hosts must be at most {MAX_EMULATED_HOSTS} (one loopback address "
                         f"each), got {hosts}")
    if world_size % hosts:
        raise ValueError(f"world_size {world_size} is not a multiple of hosts {hosts}: every "
                         "emulated host runs the same number of ranks; pick hosts dividing "
                         "world_size")
    return world_size // hosts


def rank_environment(rank: int, world_size: int, hosts: int = 1, *,
                     bind_host_addresses: bool = True) -> dict[str, str]:
    """The per-rank launcher variables of ``rank`` when ``world_size`` ranks run as ``hosts``
    emulated hosts (consecutive ranks share a host, as torchrun numbers them).

    ``RANK``; ``GROUP_RANK = rank * hosts // world_size`` (the host id,
    :attr:`Topology.host_id <xla_ckpt.comm.topology.Topology>`);
    ``LOCAL_RANK = rank % (world_size // hosts)``; ``LOCAL_WORLD_SIZE = world_size // hosts``;
    and, when ``hosts > 1`` and ``bind_host_addresses``,
    ``XLA_CKPT_GCS_SOURCE_ADDRESS = host_address(GROUP_RANK)`` (``127.0.0.(10+h)``: the
    rank's GCS connections leave from its host's own loopback address, so the fault proxy
    shapes and counts per host).  ``hosts=1`` gives what the launcher always gave:
    ``GROUP_RANK=0``, ``LOCAL_RANK=rank``, ``LOCAL_WORLD_SIZE=world_size``, no address.

    Raises:
        ValueError: see :func:`check_hosts`; ``rank`` outside ``[0, world_size)``.
    """
    per_host = check_hosts(world_size, hosts)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    group_rank = rank * hosts // world_size
    env = {"RANK": str(rank), "GROUP_RANK": str(group_rank),
           "LOCAL_RANK": str(rank % per_host), "LOCAL_WORLD_SIZE": str(per_host)}
    if hosts > 1 and bind_host_addresses:
        env[SOURCE_ADDRESS_ENV] = host_address(group_rank)
    return env


# ---------------------------------------------------------------------------- parent side
@dataclass
class _Worker:
    rank: int
    process: Any
    conn: Any
    alive: bool = True


@dataclass
class WorkerPool:
    """``world_size`` worker processes started once and reused for many calls.

    Args:
        world_size: number of ranks (one process each).
        env: extra environment for every worker (e.g. ``STORAGE_EMULATOR_HOST``);
            per-call additions go to :meth:`run`.
        xla: preload ``torch_xla`` in every worker (its own XLA CPU device);
            False starts faster when a test needs no XLA.
        start_timeout_s: seconds to wait for every worker to import torch and answer.
        hosts: run the ranks as this many emulated hosts of ``world_size // hosts``
            consecutive ranks each (``GROUP_RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` per
            rank, see :func:`rank_environment`); 1 (the default) is one host holding every
            rank.
        bind_host_addresses: with ``hosts > 1``, give each rank
            ``XLA_CKPT_GCS_SOURCE_ADDRESS`` = its host's loopback address
            ``127.0.0.(10+h)``, so its GCS storage binds to it
            (:attr:`StorageConfig.source_address <xla_ckpt.storage.base.StorageConfig>`).

    Raises:
        ValueError: ``world_size < 1``, or ``hosts`` does not divide it (:func:`check_hosts`).

    After a call in which a rank timed out or died, the pool is ``broken``:
    its surviving workers are stopped (their process group is no longer
    usable) and further :meth:`run` calls raise ``RuntimeError``.
    """

    world_size: int
    env: Mapping[str, str] | None = None
    xla: bool = True
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    hosts: int = 1
    bind_host_addresses: bool = True
    broken: bool = field(default=False, init=False)
    _workers: list[_Worker] = field(default_factory=list, init=False, repr=False)
    _store: Any = field(default=None, init=False, repr=False)
    _calls: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        check_hosts(self.world_size, self.hosts)
        self._start()

    def _start(self) -> None:
        import torch.distributed as dist  # noqa: PLC0415 - the parent hosts the rendezvous store

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        # The store takes ownership of the listening socket (it closes it).
        self._store = dist.TCPStore("127.0.0.1", port, self.world_size + 1, True,
                                    timeout=datetime.timedelta(seconds=60),
                                    master_listen_fd=sock.detach(), wait_for_workers=False)
        base = {
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": str(self.world_size), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "GLOO_SOCKET_IFNAME": "lo", "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1",
            "TF_CPP_MIN_LOG_LEVEL": "2",
        }
        ctx = mp.get_context("spawn")
        preload = ("torch_xla", "torch_xla.runtime") if self.xla else ()
        for rank in range(self.world_size):
            mine = rank_environment(rank, self.world_size, self.hosts,
                                    bind_host_addresses=self.bind_host_addresses)
            # As before hosts existed: ``env`` may override the host variables (GROUP_RANK,
            # LOCAL_WORLD_SIZE, the address) but not RANK and LOCAL_RANK.
            own = {k: mine.pop(k) for k in ("RANK", "LOCAL_RANK")}
            env = {**base, **mine, **(self.env or {}), **own}
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_worker_main, args=(rank, self.world_size, env, child, preload),
                            name=f"xla_ckpt-rank{rank}", daemon=True)
            p.start()
            child.close()
            self._workers.append(_Worker(rank, p, parent))
        deadline = time.monotonic() + self.start_timeout_s
        pending = {w.rank for w in self._workers}
        while pending:
            left = deadline - time.monotonic()
            ready = mpc.wait([self._workers[r].conn for r in pending]
                             + [self._workers[r].process.sentinel for r in pending], max(left, 0))
            if not ready:
                self.close()
                raise RuntimeError(f"workers {sorted(pending)} did not start within "
                                   f"{self.start_timeout_s} s")
            for r in list(pending):
                w = self._workers[r]
                if w.conn in ready:
                    try:
                        w.conn.recv()
                    except EOFError:
                        pass
                    pending.discard(r)
                elif w.process.sentinel in ready:
                    self.close()
                    raise RuntimeError(f"worker {r} exited with code {w.process.exitcode} "
                                       "while starting")

    def run(self, fn: Callable, *args: Any, timeout_s: float = DEFAULT_RUN_TIMEOUT_S,
            env: Mapping[str, str] | None = None, **kwargs: Any) -> list[RankResult]:
        """Call ``fn(*args, **kwargs)`` on every rank at once; one result per rank.

        ``env`` is set in each worker for the duration of the call.  Ranks
        that have not answered after ``timeout_s`` seconds are killed.
        """
        if self.broken:
            raise RuntimeError("worker pool is broken (a rank died or timed out in an earlier "
                               "call); start a new one")
        self._calls += 1
        call_id = self._calls
        results = {w.rank: RankResult(w.rank) for w in self._workers}
        for w in self._workers:
            w.conn.send((call_id, fn, args, kwargs, dict(env or {})))
        pending = {w.rank for w in self._workers}
        deadline = time.monotonic() + timeout_s
        while pending:
            waitables = {}
            for r in pending:
                w = self._workers[r]
                waitables[w.conn] = r
                waitables[w.process.sentinel] = r
            ready = mpc.wait(list(waitables), max(deadline - time.monotonic(), 0))
            if not ready:
                break
            for obj in ready:
                r = waitables[obj]
                if r not in pending:
                    continue
                w = self._workers[r]
                if obj is w.conn or w.conn.poll():
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):
                        msg = None
                    if msg is not None and msg[1] == call_id:
                        kind, _cid, _rank, payload, secs = msg
                        res = results[r]
                        res.seconds = secs
                        if kind == "ok":
                            res.value = payload
                        else:
                            res.error = _unpack_exception(payload)
                            res.traceback = payload["traceback"]
                        pending.discard(r)
                        continue
                    if msg is not None:
                        continue
                if not w.process.is_alive():
                    w.process.join(0.1)
                    code = w.process.exitcode
                    results[r].exitcode = code
                    how = (f"killed by signal {-code}" if code is not None and code < 0
                           else f"exited with code {code}")
                    results[r].error = RemoteError(f"rank {r} {how} before answering")
                    w.alive = False
                    self.broken = True
                    pending.discard(r)
        for r in pending:
            results[r].timed_out = True
            results[r].error = TimeoutError(f"rank {r} did not answer within {timeout_s} s "
                                            "(killed by the launcher)")
            self.broken = True
        if self.broken:
            self.close()
            for r in pending:
                results[r].exitcode = self._workers[r].process.exitcode
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop every worker (politely, then SIGKILL after a grace period)."""
        for w in self._workers:
            if w.process.is_alive():
                try:
                    w.conn.send(None)
                except (OSError, BrokenPipeError):
                    pass
        deadline = time.monotonic() + (_KILL_GRACE_S if not self.broken else 0.5)
        for w in self._workers:
            w.process.join(max(deadline - time.monotonic(), 0))
            if w.process.is_alive():
                w.process.kill()
                w.process.join(5)
            w.conn.close()
            w.alive = False
        self._store = None
        self.broken = True

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def launch(fn: Callable, world_size: int, *, args: tuple = (), kwargs: Mapping | None = None,
           timeout_s: float = DEFAULT_RUN_TIMEOUT_S, env: Mapping[str, str] | None = None,
           xla: bool = True, hosts: int = 1,
           bind_host_addresses: bool = True) -> list[RankResult]:
    """Start ``world_size`` workers, run ``fn(*args, **kwargs)`` on each once, stop them.

    See :class:`WorkerPool` for the arguments (``hosts``: emulated hosts); returns one
    :class:`RankResult` per rank.
    """
    pool = WorkerPool(world_size, env=env, xla=xla, hosts=hosts,
                      bind_host_addresses=bind_host_addresses)
    try:
        return pool.run(fn, *args, timeout_s=timeout_s, **dict(kwargs or {}))
    finally:
        pool.close()


_SHARED: dict[tuple, WorkerPool] = {}


def shared_pool(world_size: int, *, xla: bool = True, hosts: int = 1,
                bind_host_addresses: bool = True) -> WorkerPool:
    """A process-wide pool of ``world_size`` workers, started on first use, replaced when broken.

    Lets several test modules share one set of workers (starting torch and
    torch_xla costs seconds per process).  One pool per ``(world_size, xla, hosts,
    bind_host_addresses)`` (see :class:`WorkerPool`).  Stopped at interpreter exit.
    """
    key = (world_size, xla, hosts, bind_host_addresses and hosts > 1)
    pool = _SHARED.get(key)
    if pool is None or pool.broken:
        pool = _SHARED[key] = WorkerPool(world_size, xla=xla, hosts=hosts,
                                         bind_host_addresses=bind_host_addresses)
    return pool


@atexit.register
def _close_shared() -> None:
    for pool in _SHARED.values():
        if not pool.broken:
            pool.close()
    _SHARED.clear()
