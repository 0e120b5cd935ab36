"""torch_xla backend: ranks from the XLA runtime, control and broadcast planes on gloo.

On a Cloud TPU VM / pod (PJRT, one process per chip) the topology comes from
``torch_xla.runtime`` and the gloo group is initialised with
``init_method="xla://"`` (torch_xla's rendezvous), so no ``MASTER_ADDR`` is
needed.  XLA collectives are never used to move Python objects (object
broadcast is broken upstream, pytorch/xla#5492); tensors restored on this
path are read from storage by every rank, and the broadcast path, when asked
for, moves host (CPU) buffers over gloo.

CPU emulation (tests, the demo): N processes with ``PJRT_DEVICE=CPU`` each
own an XLA CPU device, but ``torch_xla.runtime`` reports world size 1 in
every one of them; the job's real topology then comes from the gloo process
group (initialised from ``env://``).
"""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as tdist

from xla_ckpt.comm.topology import Topology
from xla_ckpt.comm.torch_dist import DEFAULT_TIMEOUT_S, TorchDist, init_process_group
from xla_ckpt.errors import ConfigError

logger = logging.getLogger(__name__)


def _env_launched() -> bool:
    return bool(os.environ.get("MASTER_ADDR")) and bool(os.environ.get("WORLD_SIZE"))


class XlaDist(TorchDist):
    """:class:`Dist` for torch_xla jobs (TPU, or XLA CPU devices under emulation).

    Args:
        init_method: ``None`` picks ``env://`` when a launcher set
            ``MASTER_ADDR``/``WORLD_SIZE`` (torchrun, CPU emulation) and
            ``xla://`` otherwise (TPU runtime rendezvous).
        timeout_s: seconds every collective waits.

    Raises:
        ConfigError: the XLA runtime and the process group disagree about rank
            or world size.
    """

    kind = "xla"

    def __init__(self, *, init_method: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        import torch_xla  # noqa: PLC0415 - optional dependency
        import torch_xla.runtime as xr  # noqa: PLC0415 - optional dependency

        if not tdist.is_initialized():
            if init_method is None:
                init_method = "env://" if _env_launched() else "xla://"
            if init_method.startswith("xla://"):
                import torch_xla.distributed.xla_backend  # noqa: PLC0415 - registers xla://
            init_process_group("gloo", init_method, timeout_s)
        self._xr = xr
        self._xla_device = torch_xla.device()
        ctrl = tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        # bytes move on a gloo group of our own (never through an XLA process group)
        data = tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        super().__init__(timeout_s=timeout_s, group=data, _ctrl_group=ctrl)

    def _make_topology(self) -> Topology:
        pg = super()._make_topology()
        xr = self._xr
        xla_world = xr.world_size()
        if xla_world <= 1:
            if pg.world_size > 1:
                logger.info("rank %d: torch_xla.runtime reports world size %d (CPU emulation); "
                            "topology taken from the process group: %s", pg.rank, xla_world, pg)
            return pg
        topo = Topology(rank=xr.global_ordinal(), world_size=xla_world,
                        local_rank=xr.local_ordinal(),
                        local_world_size=max(xr.local_device_count(), 1),
                        host_id=xr.host_index())
        if (topo.rank, topo.world_size) != (pg.rank, pg.world_size):
            raise ConfigError(f"torch_xla.runtime says rank {topo.rank} of {topo.world_size} but "
                              f"the process group says rank {pg.rank} of {pg.world_size}; "
                              "initialise the group with init_method='xla://'")
        return topo

    @property
    def device(self) -> torch.device:
        """This process's XLA device (``torch_xla.device()``)."""
        return self._xla_device

    @property
    def data_device(self) -> torch.device:
        return torch.device("cpu")
