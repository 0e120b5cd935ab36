"""Byte-free FSDP2 shards save and restore onto any mesh, bitwise equal to DCP (issue 23).

A ``(3, 0)`` parameter under ``fully_shard`` over 4 ranks keeps a ``(0, 0)`` local tensor on
every rank while DTensor's rule gives ``(1, 0)`` to ranks 0..2: the save refused it ("DTensor
local shard has shape (0, 0), but its placements Shard(0) on mesh (4,) give (1, 0)") where
``dcp.save`` / ``dcp.load`` work.  The kind: any shard that holds no element, whatever shape
its local tensor reports; covered by a ``(3, 0)`` and a ``(4, 0)`` parameter, their AdamW
state (the same layout), and a ``(0, 5)`` parameter (byte-free in the rule's own shape).

Real gloo ranks (the launcher's shared pools), real FSDP2 and DCP on CPU; DCP is the reference.
"""

from __future__ import annotations

import pytest
import torch
import zero_element_workers as W

from xla_ckpt.comm import SingleProcess
from xla_ckpt.format.chunks import Box
from xla_ckpt.restore.owners import plan_chunked_save
from xla_ckpt.sharded.views import for_restore, for_save, local_tensor
from xla_ckpt.testing.launcher import shared_pool

RUN_TIMEOUT_S = 240
EMPTY = ("state['model']['e']", "state['model']['v']", "state['model']['z']")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("zero"))
    got = [r.unwrap() for r in shared_pool(4, xla=False).run(W.save_both, root,
                                                              timeout_s=RUN_TIMEOUT_S)]
    return root, got


@pytest.mark.slow
def test_zero_element_parameters_save_from_4_ranks(saved):
    _, got = saved
    for rank, shards in enumerate(got):
        # the layout: a (0, 0) local tensor for the (3, 0) parameter on every rank
        assert shards["state['model']['e']"][:2] == ((3, 0), (0, 0)), rank
        assert shards["state['optim']['state']['e']['exp_avg']"][:2] == ((3, 0), (0, 0)), rank
        assert shards["state['model']['z']"][:2] == ((0, 5), (0, 5)), rank


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 2])
def test_zero_element_parameters_restore_onto_another_mesh_bitwise_as_dcp(saved, world):
    root, _ = saved
    results = [r.unwrap() for r in shared_pool(world, xla=False).run(
        W.restore_both, root, timeout_s=RUN_TIMEOUT_S)]
    for rank, got in enumerate(results):
        ref = got["dcp"]
        for key in EMPTY:
            assert key in ref and ref[key][3] == b"", (rank, key)
        assert "state['optim']['state']['e']['exp_avg_sq']" in ref
        for s in ("all_ranks", "broadcast"):
            assert got[s] == ref, (rank, s, sorted(k for k in ref if got[s].get(k) != ref[k]))
        model_ref = {k: v for k, v in ref.items() if k.startswith("state['model']")}
        assert got["dcp_into"] == model_ref, rank  # xla_ckpt's DCP reader into live targets
        assert got["whole"]["state['model']['e']"] == ((3, 0), "torch.float32")
        assert got["whole"]["state['model']['v']"] == ((4, 0), "torch.float32")
        assert got["whole"]["state['model']['z']"] == ((0, 5), "torch.float32")
        assert got["whole"]["state['optim']['state']['e']['exp_avg']"] == ((3, 0),
                                                                             "torch.float32")
        assert got["whole"]["state['model']['lin.weight']"] == ((10, 6), "torch.float32")


def test_a_byte_free_box_takes_any_byte_free_local_shape_and_nothing_else():
    class Fake:  # what local_tensor reads of a DTensor: to_local()
        def __init__(self, local):
            self.local = local

        def to_local(self):
            return self.local

    for box, local in [(Box((0, 0), (1, 0)), torch.empty(0, 0)),
                       (Box((2, 0, 0), (2, 0, 2)), torch.empty(0, 0, 2)),
                       (Box((0, 0), (0, 5)), torch.empty(0, 5))]:
        assert local_tensor(Fake(local), box, "Shard(0) on mesh (4,)") is local
    # a shard with elements on either side must have the rule's shape
    with pytest.raises(ValueError, match=r"local shard has shape \(2, 3\), but its placements "
                                         r"Shard\(0\) on mesh \(4,\) give \(1, 3\)"):
        local_tensor(Fake(torch.zeros(2, 3)), Box((0, 0), (1, 3)), "Shard(0) on mesh (4,)")
    with pytest.raises(ValueError, match=r"local shard has shape \(1, 3\), but its placements "
                                         r"Shard\(0\) on mesh \(4,\) give \(0, 3\)"):
        local_tensor(Fake(torch.zeros(1, 3)), Box((3, 0), (0, 3)), "Shard(0) on mesh (4,)")
    # plain byte-free tensors: no box to save or fill
    assert for_save(torch.empty(3, 0)).shards == [] and for_restore(torch.empty(0, 5)).shards == []


def test_byte_free_views_of_one_storage_are_not_tied():
    # no bytes to share: each is its own (empty) global tensor, as DCP keeps them
    buf = torch.arange(10.0)
    plan = plan_chunked_save(SingleProcess(), {"a": buf[4:4], "b": buf[4:4].view(0),
                                               "c": buf[2:6], "d": buf[2:6]})
    assert plan.tree == {"a": {"$tensor": 0}, "b": {"$tensor": 1}, "c": {"$tensor": 2},
                         "d": {"$tensor": 2}}
    assert [s.shape for s in plan.specs] == [(0,), (0,), (4,)]
