"""Test helpers: GCS emulator, fault-injecting proxy, multi-process launcher.

* :mod:`~xla_ckpt.testing.gcs_emulator` — :class:`GCSEmulator`, a local GCS in a subprocess;
* :mod:`~xla_ckpt.testing.fault_proxy` — :class:`FaultProxy`, latency, throughput and faults
  between a client and the emulator;
* :mod:`~xla_ckpt.testing.launcher` — :class:`WorkerPool` / :func:`launch`, a function run in
  N real rank processes;
* :mod:`~xla_ckpt.testing.asserts` — bitwise comparison of restored state;
* :mod:`~xla_ckpt.testing.pytest_plugin` — fixtures over the emulator and the proxy.

The submodules are imported on use (``from xla_ckpt.testing.launcher import WorkerPool``), so a
spawned rank that needs the launcher does not import the emulator or pytest.

Library code never imports this package.
"""

__all__ = ["asserts", "fault_proxy", "gcs_emulator", "launcher", "pytest_plugin"]
