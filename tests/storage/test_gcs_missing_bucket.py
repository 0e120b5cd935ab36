"""A mistyped bucket says the bucket does not exist, at every entry point (issue 25, defect 8:
"a mistyped bucket gives ``CheckpointNotFoundError ... lease.json``").

The emulator answers 404 with an empty body both for a missing object and for a missing bucket
(as GCS does for a missing object; GCS words a missing bucket in the body, the emulator does
not), so the backend asks for the bucket itself after a 404 that only a missing bucket gives (a
listing, an upload).  Every entry point -- ``xla_ckpt.load`` / ``save``, the manager's restore
and save, the CLI -- then raises or prints :class:`BucketNotFoundError` naming the bucket and
what to do, never "no checkpoint" (which a trainer would take as "start fresh").
"""

import uuid

import pytest
import torch

import xla_ckpt
from xla_ckpt.cli.main import main
from xla_ckpt.errors import (
    BucketNotFoundError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    NothingCommittedError,
)
from xla_ckpt.manager import CheckpointConfig, CheckpointManager
from xla_ckpt.testing.fault_proxy import Fault, requests_to


@pytest.fixture
def emulator_env(gcs_emulator, monkeypatch):
    for k, v in gcs_emulator.env().items():
        monkeypatch.setenv(k, v)
    return gcs_emulator


def typo(bucket):
    """The emulator's bucket with two letters swapped (``xla-ckpt-test`` -> ``xla-ckpt-tset``)."""
    return bucket[:-3] + bucket[-2] + bucket[-3] + bucket[-1]


@pytest.fixture(params=["typo", "other"])
def missing(request, emulator_env):
    bucket = typo(emulator_env.bucket) if request.param == "typo" else \
        f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    assert bucket != emulator_env.bucket
    return bucket


def _check(e, bucket):
    text = str(e)
    assert f"the bucket {bucket!r} does not exist (HTTP 404 for gs://{bucket} itself)" in text
    assert "Check the bucket name in the URI" in text
    assert f"create the bucket first (gcloud storage buckets create gs://{bucket})" in text


def _cfg(uri):
    return CheckpointConfig(save_dir=uri, async_save=False, handle_sigterm=False,
                            save_interval_epochs=0)


def test_load_and_save_name_the_missing_bucket(missing):
    run = f"gs://{missing}/run"
    for uri in (run, f"{run}/checkpoint_1_10", f"{run}/checkpoint_last"):
        with pytest.raises(BucketNotFoundError) as ei:
            xla_ckpt.load(uri)
        _check(ei.value, missing)
        assert ei.value.bucket == missing and ei.value.uri.startswith(f"gs://{missing}/run")
        assert not isinstance(ei.value, CheckpointNotFoundError)  # never "nothing saved"
    with pytest.raises(BucketNotFoundError) as ei:
        xla_ckpt.save({"w": torch.ones(3)}, f"{run}/ck")
    _check(ei.value, missing)
    assert str(ei.value).startswith(f"upload gs://{missing}/run/ck/data-")


def test_the_manager_names_the_missing_bucket_and_never_starts_fresh(missing):
    cfg = _cfg(f"gs://{missing}/run")
    fresh: list[int] = []
    with CheckpointManager(cfg) as mgr:
        with pytest.raises(BucketNotFoundError) as ei:
            mgr.restore_or_initialize(lambda: fresh.append(1))
        _check(ei.value, missing)
        assert fresh == []
        with pytest.raises(BucketNotFoundError) as ei:
            mgr.restore(step=10)
        _check(ei.value, missing)
    with CheckpointManager(cfg) as mgr:
        with pytest.raises(CheckpointSaveError) as es:   # one error type on every rank
            mgr.save({"w": torch.ones(2)}, epoch=1, num_updates=10)
    assert "BucketNotFoundError" in str(es.value) and "lease.json" in str(es.value)
    _check(es.value, missing)


@pytest.mark.parametrize("argv", [["ls"], ["inspect"], ["verify"], ["gc", "--keep-last", "1"],
                                  ["inspect", "/checkpoint_1_10"]])
def test_the_cli_names_the_missing_bucket(missing, capsys, argv):
    cmd, *rest = argv
    uri = f"gs://{missing}/run"
    if rest and rest[0].startswith("/"):
        uri, rest = uri + rest[0], rest[1:]
    capsys.readouterr()
    code = main(["--no-progress", cmd, uri, *rest])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"xla-ckpt {cmd}: error: ")
    _check(err, missing)


def test_an_existing_bucket_still_says_nothing_is_there(emulator_env):
    uri = emulator_env.uri(f"nothing-{uuid.uuid4().hex[:8]}/run")
    with pytest.raises(NothingCommittedError):
        xla_ckpt.load(uri)
    fresh: list[int] = []
    with CheckpointManager(_cfg(uri)) as mgr:
        got = mgr.restore_or_initialize(lambda: fresh.append(1))
    assert got is None and fresh == [1]   # nothing saved yet: the one "start fresh" case


def test_a_bucket_that_cannot_be_checked_keeps_the_original_answer(fault_proxy, gcs_emulator):
    """A principal without ``storage.buckets.get`` gets 403 for the bucket: nothing is claimed."""
    bucket_get = requests_to(method="GET", path_regex=r"^/storage/v1/b/[^/]+$")
    fault_proxy.inject(Fault.error(403), match=bucket_get, times=10)
    with fault_proxy.storage(f"gs://{typo(gcs_emulator.bucket)}/run") as st:
        with pytest.raises(CheckpointNotFoundError) as ei:
            st.list("")
        assert not isinstance(ei.value, BucketNotFoundError)
        assert str(ei.value) == f"list gs://{typo(gcs_emulator.bucket)}/run: not found (HTTP 404)"
    statuses = [r.status for r in fault_proxy.records(bucket_get)]
    assert statuses and set(statuses) == {403}
