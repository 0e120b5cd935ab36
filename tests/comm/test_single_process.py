"""SingleProcess and the interface built on its primitives; backend selection; Topology."""

from __future__ import annotations

import pytest
import torch

from xla_ckpt.comm import (
    DistConfig,
    SingleProcess,
    Topology,
    decode_object,
    encode_object,
    get_dist,
    resolve_backend,
)
from xla_ckpt.errors import (
    CheckpointCorruptError,
    ConfigError,
    DistributedError,
    UnsupportedTypeError,
)


def test_collectives_of_a_world_of_one():
    d = SingleProcess()
    assert (d.rank, d.world_size, d.backend, str(d.device)) == (0, 1, "none", "cpu")
    assert d.exchange({"a": (1, 2.0)}) == [{"a": (1, 2.0)}]
    assert d.broadcast_object([None, b"x"]) == [None, b"x"]
    assert d.broadcast_bytes(b"abc") == b"abc"
    t = torch.arange(5.0)
    assert d.broadcast_tensors([t]) == 20 and t.tolist() == [0, 1, 2, 3, 4]
    out = torch.zeros(3)
    d.scatter_tensors([out], {0: [torch.ones(3)]})
    assert out.tolist() == [1, 1, 1]
    assert d.run_collectively(lambda: 5, "five") == 5
    d.barrier(1)


def test_a_local_failure_becomes_distributed_error_with_the_cause():
    d = SingleProcess()
    with pytest.raises(DistributedError) as info:
        empty: dict[str, int] = {}
        d.run_collectively(lambda: empty["missing"], "reading the manifest")
    e = info.value
    assert e.failures == {0: "KeyError: 'missing'"}
    assert str(e) == ("reading the manifest failed on rank(s) 0 of 1 (reported on rank 0) "
                      "[rank 0: KeyError: 'missing']")
    assert type(e.__cause__) is KeyError


def test_objects_travel_as_typed_json_never_tensors():
    assert encode_object({"a": (1, None)}) == b'{"a":{"$tuple":[1,null]}}'
    assert decode_object(b'{"a":{"$tuple":[1,null]}}') == {"a": (1, None)}
    with pytest.raises(UnsupportedTypeError, match="tensor"):
        encode_object({"t": torch.zeros(1)})
    with pytest.raises(CheckpointCorruptError, match="not typed JSON"):
        decode_object(b"\x80\x04pickle")


def test_backend_resolution(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert resolve_backend(DistConfig()) == "single"
    assert resolve_backend(DistConfig(backend="nccl")) == "nccl"
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_backend(DistConfig()) == ("nccl" if torch.cuda.is_available() else "gloo")
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert resolve_backend(DistConfig()) == "xla"
    monkeypatch.delenv("WORLD_SIZE")
    assert resolve_backend(DistConfig()) == "xla"  # the TPU runtime knows the pod


def test_get_dist_single_is_cached(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    d = get_dist()
    assert isinstance(d, SingleProcess) and get_dist() is d


def test_topology_validation():
    t = Topology(rank=3, world_size=4, local_rank=1, local_world_size=2, host_id=1)
    assert str(t) == "rank 3/4 (local 1/2, host 1)" and not t.is_coordinator
    with pytest.raises(ConfigError, match="topology.rank 4 must be < world_size 4"):
        Topology(rank=4, world_size=4)
    with pytest.raises(ConfigError, match="topology.local_rank must be an integer >= 0"):
        Topology(local_rank=-1)
