"""The work of saving, planning, parsing and loading grows linearly with the tensor count (C26).

No timings: the measure is the number of Python function calls (generator resumptions
included) the calling thread makes, counted by ``sys.setprofile``.  That count is the same
on every run and machine, and it is what made restores quadratic before: ``plan_spans``
asked ``all(v.small for v in group)`` of the whole group for every blob (187,507,500 calls
of that generator for 20,000 parameters).  Each path runs at ``n`` and ``4 n`` tensors of the
issue's kind (parameters of 3 floats with AdamW) and its count may grow at most 4.8 times
(1.2 x the tensor count, the benchmark's target); a quadratic term shows as up to 16.

The quadratic list scan inside ``torch.optim.Optimizer.load_state_dict`` (C code, no Python
calls) is not visible here; benchmarks/tensor_count.py measures that one.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import Any, Callable

import pytest
import torch

import xla_ckpt
from xla_ckpt.cli.main import main as cli_main
from xla_ckpt.format.chunks import ChunkRecord, GlobalTensor, chunk_item
from xla_ckpt.format.manifest import BlobRecord, Item, Manifest, TensorRecord
from xla_ckpt.io.buffers import host_arenas
from xla_ckpt.io.chunked import plan_whole_reads
from xla_ckpt.io.manifest_file import read_manifest
from xla_ckpt.io.planning import plan_spans
from xla_ckpt.storage import open_storage
from xla_ckpt.trainer import Checkpointer, Metrics

SMALL = 100  # parameters: 400 tensors
LIMIT = 4 * 1.2


def python_calls(fn: Callable[[], Any]) -> int:
    """Python function calls (and generator resumptions) this thread makes in ``fn()``."""
    count = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        if event == "call":
            count += 1

    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(old)
    return count


class Model(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(3)) for _ in range(n))


def trainer(n: int, seed: int) -> Checkpointer:
    torch.manual_seed(seed)
    ckpt = Checkpointer(model=Model(n), metrics=Metrics(),
                        build_optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    for p in ckpt.live_parameters():
        p.grad = torch.ones(3)
    ckpt.optimizer.step()
    ckpt.set_num_updates(1)
    return ckpt


def state_of(ckpt: Checkpointer) -> dict[str, Any]:
    return {"model": ckpt.model.state_dict(), "optimizer": ckpt.optimizer.state_dict()}


def growth(measure: Callable[[int], int]) -> float:
    """Call-count ratio of ``measure`` at 4x the parameters; ``measure`` warms up first."""
    measure(SMALL // 4)  # imports and first-use caches outside the counts
    return measure(4 * SMALL) / measure(SMALL)


def test_save_and_load_calls_grow_linearly(tmp_path):
    def save(n: int) -> int:
        state = state_of(trainer(n, 0))
        return python_calls(lambda: xla_ckpt.save(state, str(tmp_path / f"s{n}")))

    def load(n: int) -> int:
        uri = str(tmp_path / f"l{n}")
        xla_ckpt.save(state_of(trainer(n, 0)), uri)
        out: list[Any] = []
        calls = python_calls(lambda: out.append(xla_ckpt.load(uri)))
        assert len(out[0]["optimizer"]["state"]) == n
        return calls

    assert growth(save) <= LIMIT
    assert growth(load) <= LIMIT


def test_trainer_save_and_restore_calls_grow_linearly(tmp_path):
    def save(n: int) -> int:
        ckpt = trainer(n, 0)
        return python_calls(lambda: ckpt.save_checkpoint(str(tmp_path / f"s{n}")))

    def restore(n: int) -> int:
        uri = str(tmp_path / f"r{n}")
        src = trainer(n, 0)
        src.save_checkpoint(uri)
        fresh = trainer(n, 1)
        calls = python_calls(lambda: fresh.load_checkpoint(uri))
        assert all(torch.equal(a, b) for a, b in zip(fresh.live_parameters(),
                                                     src.live_parameters(), strict=True))
        return calls

    assert growth(save) <= LIMIT
    assert growth(restore) <= LIMIT


def test_read_planning_calls_grow_linearly(tmp_path):
    """plan_spans alone, over the blobs of the issue's state (the quadratic one before)."""
    def plan(n: int) -> int:
        uri = str(tmp_path / f"p{n}")
        xla_ckpt.save(state_of(trainer(n, 0)), uri)
        item = read_manifest(open_storage(uri)).item("state")
        bufs = host_arenas(item, range(len(item.blobs)))
        spans: list[Any] = []
        calls = python_calls(lambda: spans.extend(plan_spans(item, bufs, 64 << 20)))
        assert sum(len(sp.pieces) for sp in spans) == len(item.blobs) == 4 * n
        return calls

    assert growth(plan) <= LIMIT


@pytest.mark.parametrize("command", ["inspect", "verify", "ls"])
def test_cli_calls_grow_linearly(tmp_path, command):
    def run(n: int) -> int:
        uri = str(tmp_path / f"c{n}" / "checkpoint_1_1")
        os.makedirs(os.path.dirname(uri), exist_ok=True)
        trainer(n, 0).save_checkpoint(uri)
        target = uri if command != "ls" else os.path.dirname(uri)
        codes: list[Any] = []

        def call() -> None:
            with contextlib.redirect_stdout(io.StringIO()):
                codes.append(cli_main([command, target]))

        calls = python_calls(call)
        assert codes == [0]
        return calls

    assert growth(run) <= LIMIT


def chunked_manifest(n_tensors: int, n_chunks: int) -> bytes:
    """A version-2 manifest: ``n_tensors`` global tensors of ``n_chunks`` row chunks each,
    chunk ``c`` of every tensor in item ``chunks/<c>`` (what ``n_chunks`` ranks save)."""
    rows, cols = 2, 3
    items: dict[str, Item] = {}
    per = rows * cols * 4
    for c in range(n_chunks):
        tensors = [TensorRecord(key=f"state['model']['t{t}'][{c * rows}:{(c + 1) * rows}]",
                                blob=0, byte_offset=t * per, dtype="float32",
                                shape=(rows, cols), stride=(cols, 1)) for t in range(n_tensors)]
        items[chunk_item(c)] = Item(
            state=[{"$tensor": t} for t in range(n_tensors)], tensors=tensors,
            blobs=[BlobRecord(file=f"data-{c}.safetensors", offset=0, length=per * n_tensors,
                              crc32c=0, chunk_size=4 << 20, chunk_crc32c=())])
    gts = [GlobalTensor(key=f"state['model']['t{t}']", dtype="float32",
                        shape=(rows * n_chunks, cols),
                        chunks=tuple(ChunkRecord(item=chunk_item(c), tensor=t,
                                                 offsets=(c * rows, 0), sizes=(rows, cols))
                                     for c in range(n_chunks)))
           for t in range(n_tensors)]
    items["state"] = Item(state={"model": {f"t{t}": {"$tensor": t} for t in range(n_tensors)}},
                          chunked=True)
    return Manifest(save_id="0" * 16, items=items, files={
        f"data-{c}.safetensors": per * n_tensors for c in range(n_chunks)},
        world_size=n_chunks, global_tensors=gts).to_json_bytes()


@pytest.mark.parametrize("grow", ["tensors", "chunks"])
def test_chunk_table_parse_and_read_planning_grow_linearly(grow):
    """A sharded checkpoint's manifest parse (chunk tables checked) and the planning of a
    whole-tensor read, at 4x the global tensors or 4x the chunks per tensor."""
    def measure(n: int) -> int:
        tensors, chunks = (n, 4) if grow == "tensors" else (4, n)
        data = chunked_manifest(tensors, chunks)
        parsed: list[Manifest] = []
        calls = python_calls(lambda: parsed.append(Manifest.from_json_bytes(data)))
        m = parsed[0]
        reads: list[Any] = []
        calls += python_calls(lambda: reads.extend(plan_whole_reads(m, range(tensors))))
        assert len(m.global_tensors) == tensors
        assert sum(r.length for r in reads) == tensors * chunks * 24
        return calls

    assert growth(measure) <= LIMIT
