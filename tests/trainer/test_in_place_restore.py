"""The trainer's default restore reads an xla_ckpt checkpoint's model and criterion in place.

``Checkpointer.load_checkpoint`` with the default ``SingleProcessRestorer`` passes
``targets=`` (``module_load.in_place_targets`` of the live model and criterion), so the
saved bytes land straight in the live CPU parameters and ``load_state_dict`` copies
nothing.  What is observed: the reader's in-place plan (``reader.in_place_buffers``,
wrapped to record what it returned, then used as it is), data pointers, values bitwise,
and that a strict mismatch still raises with every live tensor untouched.
"""

from __future__ import annotations

import pytest
import torch

from xla_ckpt.errors import StateMismatchError
from xla_ckpt.io import reader as reader_mod
from xla_ckpt.storage import StorageConfig
from xla_ckpt.storage.local import LocalStorage
from xla_ckpt.testing.asserts import assert_state_identical
from xla_ckpt.trainer import Checkpointer, RestoreRequest, SingleProcessRestorer

EXTRA = {"train_iterator": {"epoch": 1, "iterations_in_epoch": 3, "version": 2}}


class Scaled(torch.nn.Module):
    """A criterion with a parameter (fairseq criteria may have some)."""

    scale: torch.nn.Parameter

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor([2.0, 3.0]))


def scale_of(ck: Checkpointer) -> torch.Tensor:
    assert isinstance(ck.criterion, Scaled)
    return ck.criterion.scale.detach()


def trainer(seed: int, model: torch.nn.Module | None = None, **kw) -> Checkpointer:
    torch.manual_seed(seed)
    model = model if model is not None else torch.nn.Sequential(
        torch.nn.Linear(64, 300), torch.nn.LayerNorm(300), torch.nn.Linear(300, 8))
    crit = Scaled()
    with torch.no_grad():
        crit.scale.mul_(seed + 1)
    return Checkpointer(model=model, criterion=crit,
                        build_optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), **kw)


def saved(tmp_path, seed: int = 0) -> tuple[str, Checkpointer]:
    src = trainer(seed)
    for p in src.live_parameters():
        p.grad = torch.ones_like(p)
    src.optimizer.step()
    src.set_num_updates(3)
    uri = str(tmp_path / "checkpoint_1_3")
    src.save_checkpoint(uri, EXTRA)
    return uri, src


@pytest.fixture
def in_place_plans(monkeypatch):
    """Every plan ``CheckpointReader.load`` made: the tensor keys it read in place."""
    plans: list[list[str]] = []
    real = reader_mod.in_place_buffers

    def recording(item, into):
        got = real(item, into)
        plans.append(sorted(t.key for t in item.tensors if t.blob in got))
        return got

    monkeypatch.setattr(reader_mod, "in_place_buffers", recording)
    return plans


def live_ptrs(ck: Checkpointer) -> dict[str, int]:
    assert ck.criterion is not None
    return {**{k: t.data_ptr() for k, t in ck.model.state_dict(keep_vars=True).items()},
            **{f"c.{k}": t.data_ptr() for k, t in ck.criterion.state_dict(keep_vars=True).items()}}


def test_default_restore_reads_model_and_criterion_into_the_live_parameters(tmp_path,
                                                                            in_place_plans):
    uri, src = saved(tmp_path)
    dst = trainer(5)
    assert isinstance(dst.restorer, SingleProcessRestorer)
    ptrs = live_ptrs(dst)
    extra = dst.load_checkpoint(uri)
    assert extra is not None and extra["train_iterator"]["iterations_in_epoch"] == 3
    assert live_ptrs(dst) == ptrs                                     # same memory
    assert_state_identical(dict(dst.model.state_dict()), dict(src.model.state_dict()))
    assert torch.equal(scale_of(dst), scale_of(src))
    assert_state_identical(dst.optimizer.state_dict(), src.optimizer.state_dict())
    assert dst.get_num_updates() == 3
    (plan,) = in_place_plans
    want = [f"state['model']['{k}']" for k in src.model.state_dict()] + [
        "state['criterion']['scale']"]
    assert plan == sorted(want)                                       # every one in place


def test_a_strict_mismatch_raises_before_any_live_byte_is_written(tmp_path, in_place_plans):
    uri, _ = saved(tmp_path)
    wider = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.LayerNorm(300),
                                torch.nn.Linear(300, 9))              # head shape differs
    dst = trainer(5, model=wider)
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    crit_before = scale_of(dst).clone()
    with pytest.raises(StateMismatchError, match=r"shape mismatch in 2\.weight \(saved \[8, "
                                                 r"300\], live \[9, 300\]\)"):
        dst.load_checkpoint(uri)
    assert_state_identical(dict(wider.state_dict()), before)
    assert torch.equal(scale_of(dst), crit_before)     # fits, but untouched too
    assert in_place_plans == []                                       # nothing read in place


def test_a_restorer_that_leaves_the_targets_unused_reads_into_fresh_memory(tmp_path,
                                                                            in_place_plans):
    uri, src = saved(tmp_path)
    calls: list[RestoreRequest] = []
    plain = SingleProcessRestorer()

    def restorer(request: RestoreRequest):
        calls.append(request)
        return plain(RestoreRequest(uri=request.uri))

    dst = trainer(5, restorer=restorer)
    ptrs = live_ptrs(dst)
    dst.load_checkpoint(uri)
    assert [c.uri for c in calls] == [uri] and calls[0].targets is not None  # offered
    assert calls[0].into is None and in_place_plans == []             # read into fresh memory
    assert live_ptrs(dst) == ptrs
    assert_state_identical(dict(dst.model.state_dict()), dict(src.model.state_dict()))


def test_replaced_while_read_in_place_reads_the_new_save_into_the_same_memory(
        tmp_path, monkeypatch, in_place_plans):
    """A second save commits after the first read of 1 MiB or more (a fault the real storage
    cannot produce on demand, triggered from inside the real ``LocalStorage.read_range``)."""
    uri = str(tmp_path / "checkpoint_1_3")
    slice_bytes = 2**20
    big = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.LayerNorm(1024),
                              torch.nn.Linear(1024, 8))
    src_a = trainer(0, model=big)
    src_a.save_checkpoint(uri, EXTRA)
    second: list[Checkpointer] = []
    real = LocalStorage.read_range

    def read_range(storage, name, offset, out, generation=None):
        real(storage, name, offset, out, generation)
        if name.startswith("data-") and len(out) >= slice_bytes and not second:
            b = trainer(1, model=torch.nn.Sequential(
                torch.nn.Linear(1024, 1024), torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 8)))
            b.set_num_updates(7)
            b.save_checkpoint(uri, EXTRA)
            second.append(b)

    monkeypatch.setattr(LocalStorage, "read_range", read_range)
    dst = trainer(5, model=torch.nn.Sequential(torch.nn.Linear(1024, 1024),
                                               torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 8)),
                  restorer=SingleProcessRestorer(config=StorageConfig(
                      slice_size_bytes=slice_bytes, max_workers=1)))
    ptrs = live_ptrs(dst)
    dst.load_checkpoint(uri)
    (b,) = second
    assert dst.get_num_updates() == 7 and live_ptrs(dst) == ptrs
    assert_state_identical(dict(dst.model.state_dict()), dict(b.model.state_dict()))
    assert len(in_place_plans) == 2 and in_place_plans[0] == in_place_plans[1]
    assert "state['model']['0.weight']" in in_place_plans[1]
