"""Run a Python function in N real worker processes, the way torchrun would start them.

Each worker is a fresh ``spawn``-ed interpreter with the environment a
launcher gives a rank: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` (a free port)
and ``PJRT_DEVICE=CPU`` (so every worker owns its own XLA CPU device), and
``GROUP_RANK`` (the host id).  ``WorkerPool(world_size, hosts=H)`` runs the ranks
as ``H`` emulated hosts of ``world_size // H`` consecutive ranks (``GROUP_RANK``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` per rank, :func:`rank_environment`), each host's
ranks with ``XLA_CKPT_GCS_SOURCE_ADDRESS=127.0.0.(10+h)`` so their GCS connections
leave from the host's own loopback address and the fault proxy shapes and counts each
host's link (opt out with ``bind_host_addresses=False``).  Code
under test calls ``torch.distributed.init_process_group("gloo",
init_method="env://")`` (or :func:`xla_ckpt.comm.get_dist`) as it would under
torchrun.

Only loopback is used: like torchrun's elastic agent, the launcher itself
hosts the rendezvous ``TCPStore`` on a socket bound to 127.0.0.1 and tells the
workers to be its clients (``TORCHELASTIC_USE_AGENT_STORE=True``); gloo is
pinned to the loopback interface (``GLOO_SOCKET_IFNAME=lo``).

Two ways to use it::

    results = launch(fn, 4, args=(path,), timeout_s=60)       # one-shot
    with WorkerPool(4) as pool:                                 # start once, run many
        results = pool.run(fn, path, timeout_s=60)

``fn`` must be importable by module and name (defined at module level).
Every call returns one :class:`RankResult` per rank: the value, or the
exception the rank raised (re-created with its type, ``args`` and
attributes, e.g. :attr:`DistributedError.failures`), or how the process
died.  A hard timeout kills stragglers, so a hang in the code under test
shows up as ``timed_out=True`` instead of a stuck test run.

Modules: :mod:`.pool` (the parent: :class:`WorkerPool`, :func:`launch`,
:func:`shared_pool`, :func:`free_port`), :mod:`.worker` (what each spawned
rank process runs; :func:`kill_self`), :mod:`.results` (:class:`RankResult`
and how a rank's exception travels back, :class:`RemoteError`).

Test helper only: library code never imports this package.
"""

from xla_ckpt.testing.launcher.pool import (
    DEFAULT_RUN_TIMEOUT_S,
    DEFAULT_START_TIMEOUT_S,
    WorkerPool,
    free_port,
    launch,
    rank_environment,
    shared_pool,
)
from xla_ckpt.testing.launcher.results import RankResult, RemoteError
from xla_ckpt.testing.launcher.worker import kill_self

__all__ = ["DEFAULT_RUN_TIMEOUT_S", "DEFAULT_START_TIMEOUT_S", "RankResult", "RemoteError",
           "WorkerPool", "free_port", "kill_self", "launch", "rank_environment", "shared_pool"]
