"""One decision per restore: what a restore asks of storage before its data does not grow with
the checkpoints a run folder keeps (issue 23, item 4).

Counted through the fault proxy's request log on the GCS emulator (requests, never timings),
for ``xla_ckpt.load(run)``, a manager restore and a trainer restore of run folders holding 3
and 20 committed checkpoints: the same number of listings, object metadata reads, manifest
and pointer downloads; one listing, none of it recursive (no data file is ever listed); the
chosen manifest fetched once; the newest checkpoint restored.  A run folder whose manifests
carry no order metadata (committed by an earlier xla_ckpt) is still ordered right.
``benchmarks/control_requests.py`` measures the same on 1, 2 and 4 ranks.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from manager_helpers import kind

import xla_ckpt
from xla_ckpt.format.manifest import MANIFEST_NAME
from xla_ckpt.manager import CheckpointConfig, CheckpointManager
from xla_ckpt.run.catalog import write_pointer
from xla_ckpt.storage import open_storage
from xla_ckpt.trainer import Checkpointer


def trainer() -> Checkpointer:
    torch.manual_seed(0)
    return Checkpointer(model=torch.nn.Linear(4, 2),
                        build_optimizer=lambda params: torch.optim.SGD(params, lr=0.1))


def write_run(run: str, count: int, *, epochs: dict[int, int] | None = None) -> None:
    """``count`` committed checkpoints ``checkpoint_1_<n>`` (lease epoch 1 unless ``epochs``
    says otherwise for ``n``), and ``checkpoint_last`` naming the last one."""
    ck = trainer()
    for n in range(1, count + 1):
        ck.set_num_updates(n)
        xla_ckpt.save(ck.state_dict(), f"{run}/checkpoint_1_{n}",
                      metadata={"num_updates": n, "lease_epoch": (epochs or {}).get(n, 1)})
    with open_storage(run) as st:
        write_pointer(st, "last", f"checkpoint_1_{count}", lease_epoch=1, num_updates=count)


def restore(entry: str, run: str) -> int:
    """The num_updates ``entry`` restored from ``run``."""
    if entry == "load":
        return xla_ckpt.load(run)["optimizer_history"][-1]["num_updates"]
    if entry == "manager":
        with CheckpointManager(CheckpointConfig(save_dir=run, async_save=False,
                                                handle_sigterm=False)) as mgr:
            result = mgr.restore_or_initialize()
        assert result is not None and result.num_updates is not None
        return result.num_updates
    ck = trainer()
    assert ck.load_checkpoint(run) is not None
    return ck.get_num_updates()


def counted(proxy, monkeypatch, entry: str, run: str) -> tuple[int, Counter, list]:
    """What ``entry`` restored from ``run`` through ``proxy``, its control requests by kind
    (data ranges left out) and every request."""
    with monkeypatch.context() as m:
        m.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        proxy.reset_log()
        restored = restore(entry, run)
    records = proxy.records()
    return restored, Counter(kind(r) for r in records if kind(r) != "data"), records


@pytest.mark.parametrize("entry", ["load", "manager", "trainer"])
def test_finding_latest_costs_the_same_for_3_and_20_checkpoints(gcs_uri, fault_proxy,
                                                                monkeypatch, entry):
    runs = {k: f"{gcs_uri}/run{k}" for k in (3, 20)}
    for k, run in runs.items():
        write_run(run, k)
    got = {k: counted(fault_proxy, monkeypatch, entry, run) for k, run in runs.items()}
    (n3, c3, _), (n20, c20, recs20) = got[3], got[20]
    assert (n3, n20) == (3, 20)                                  # the newest, each time
    assert c3 == c20, (c3, c20)                                  # no request more for 20
    assert c3["list"] == 1                                       # "latest" listed once
    lists = [r for r in recs20 if kind(r) == "list"]
    assert all("matchGlob=" in r.query for r in lists)           # never every object
    fetched = Counter(r.object_name for r in recs20 if kind(r) == "manifest" and r.status == 200)
    assert fetched == Counter({f"{runs[20].split('/', 3)[3]}/checkpoint_1_20/{MANIFEST_NAME}": 1})
    assert c3["manifest"] <= 2 and c3["pointer"] <= 2            # + a 404 probe; last (+ best)


def test_manifests_without_order_metadata_are_still_ordered(gcs_uri, fault_proxy, monkeypatch):
    """Checkpoints committed before the order went into the manifest's metadata: the
    catalog reads their manifests (as it always did) and picks the same checkpoint;
    a successor's checkpoint outranks its predecessor's by lease epoch (C15), here even
    though the pointer names the predecessor's."""
    run = f"{gcs_uri}/old"
    write_run(run, 4, epochs={2: 2})                  # checkpoint_1_2 by the next incarnation
    with open_storage(run) as st:
        for n in range(1, 5):                         # as an earlier xla_ckpt committed them
            name = f"checkpoint_1_{n}/{MANIFEST_NAME}"
            st.write_atomic(name, [st.read_bytes(name)])
        assert [o.metadata for o in st.list_in_subfolders("", MANIFEST_NAME)] == [None] * 4
    write_run(f"{gcs_uri}/new", 4, epochs={2: 2})    # the same run as committed today
    restored, c, _ = counted(fault_proxy, monkeypatch, "load", run)
    assert restored == 2 and c["manifest"] == 1 + 4   # the probe and each of the 4
    restored_new, c_new, _ = counted(fault_proxy, monkeypatch, "load", f"{gcs_uri}/new")
    assert restored_new == 2 and c_new["manifest"] == 2  # the probe and the chosen one
