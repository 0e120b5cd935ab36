"""The worker side of the launcher: the main loop of one spawned rank process.

:func:`_worker_main` is the ``spawn`` target (imported by module path in the
fresh interpreter): it puts the rank's environment in place, imports torch
(and torch_xla), says it is ready, then runs each call the parent sends and
answers with its value or its packed exception.
"""

from __future__ import annotations

import importlib
import multiprocessing.connection as mpc
import os
import signal
import time

from xla_ckpt.testing.launcher.results import _pack_exception


def _worker_main(rank: int, world_size: int, env: dict[str, str], conn: mpc.Connection,
                 preload: tuple[str, ...]) -> None:
    os.environ.update(env)
    import torch  # noqa: PLC0415 - after the environment is in place

    torch.set_num_threads(1)
    for mod in preload:
        importlib.import_module(mod)
    if "torch_xla" in preload:
        # Bring the XLA device up before any backward pass: torch's autograd engine sizes its
        # per-device queues when it first runs, and a pooled worker that ran a CPU backward
        # before ever touching xla:0 later fails an internal assert on an XLA backward.
        import torch_xla  # noqa: PLC0415 - optional dependency, preloaded on request only

        torch_xla.device()
    conn.send(("ready", rank))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        call_id, fn, args, kwargs, call_env = msg
        saved = {k: os.environ.get(k) for k in call_env}
        os.environ.update(call_env)
        t0 = time.perf_counter()
        try:
            value = fn(*args, **kwargs)
            reply = ("ok", call_id, rank, value, time.perf_counter() - t0)
            try:
                conn.send(reply)
            except Exception as e:  # noqa: BLE001 - e.g. an unpicklable return value
                conn.send(("err", call_id, rank, _pack_exception(e), time.perf_counter() - t0))
        except BaseException as e:  # noqa: BLE001 - report everything, SystemExit included
            conn.send(("err", call_id, rank, _pack_exception(e), time.perf_counter() - t0))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    try:
        import torch.distributed as dist  # noqa: PLC0415 - torch only after the env is set (above)

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


def kill_self(sig: int = signal.SIGKILL) -> None:
    """Kill the calling worker process at once (to emulate a rank lost mid-job)."""
    os.kill(os.getpid(), sig)
