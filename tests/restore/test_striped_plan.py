"""The striped plan's stripes, the stripe reads, and ``auto``'s choice (no processes, no timing)."""

from __future__ import annotations

import pytest
import torch

from xla_ckpt.api import save
from xla_ckpt.comm.host_memory import segment_layout
from xla_ckpt.format.manifest import BlobRecord, Item
from xla_ckpt.io import CheckpointReader
from xla_ckpt.restore import RestoreConfig
from xla_ckpt.restore.cost import Bandwidths, RestoreSizes, RestoreTopology
from xla_ckpt.restore.select import JobShape, choose_plan_for_job
from xla_ckpt.restore.striped import exchange_ranges, plan_stripes, ranges_of, stripe_size
from xla_ckpt.storage import open_storage

MiB = 1 << 20


def _item(lengths: list[int], chunk: int = MiB, whole: tuple[int, ...] = ()) -> Item:
    blobs, off = [], 0
    for i, n in enumerate(lengths):
        chunks = () if i in whole else (0,) * (-(-n // chunk))
        blobs.append(BlobRecord(file="data/0", offset=off, length=n, crc32c=0, chunk_size=chunk,
                                chunk_crc32c=chunks))
        off += n
    return Item(state=None, blobs=blobs)


def _parts(stripes):
    return [(b, lo, n, s.reader) for s in stripes for b, lo, n in s.parts]


def test_stripes_cover_every_byte_once_and_respect_chunks():
    item = _item([10 * MiB + 5, 3 * MiB, 0, 700, 2 * MiB + 1], whole=(3,))
    stripes = plan_stripes(item, [[0, 1], [2, 3]], stripe_bytes=2 * MiB + 17)
    parts = _parts(stripes)
    for i, rec in enumerate(item.blobs):
        mine = sorted((lo, n) for b, lo, n, _ in parts if b == i)
        covered = 0
        for start, length in mine:
            assert start == covered  # no gap, no overlap
            assert start % MiB == 0 and ((start + length) % MiB == 0 or
                                         start + length == rec.length)
            covered += length
        assert covered == rec.length
    assert [n for b, _, n, _ in parts if b == 3] == [700]  # one crc32c: whole
    assert not [p for p in parts if p[0] == 2]  # empty blob: nothing to read
    assert max(s.length for s in stripes) == 2 * MiB  # rounded down to whole chunks


def test_small_adjacent_blobs_share_a_stripe():
    # 40 blobs of 1 KiB back to back, then a 6 MiB one, then 3 more small ones
    item = _item([1024] * 40 + [6 * MiB] + [512] * 3)
    stripes = plan_stripes(item, [[0, 1]], stripe_bytes=16 * 1024)
    small = [s for s in stripes if all(b != 40 for b, _, _ in s.parts)]
    # 40 KiB of small blobs in runs of at most 16 KiB; the 3 after the big blob: one run
    assert [s.length for s in small] == [16384, 16384, 8192, 1536]
    for s in small:  # a run is file-adjacent: one ranged request reads it
        ends = [item.blobs[b].offset + item.blobs[b].length for b, _, _ in s.parts[:-1]]
        assert ends == [item.blobs[b].offset for b, _, _ in s.parts[1:]]
    assert sorted(b for b, _, _, _ in _parts(stripes)) == sorted(
        [b for b in range(44) if b != 40] + [40] * len([s for s in stripes if s not in small]))


def test_stripes_balance_hosts_then_ranks():
    item = _item([64 * MiB] * 4)
    stripes = plan_stripes(item, [[0, 1], [2, 3], [4, 5], [6, 7]], stripe_bytes=8 * MiB)
    per_rank = {r: sum(s.length for s in stripes if s.reader == r) for r in range(8)}
    assert set(per_rank.values()) == {32 * MiB}  # 256 MiB over 8 readers, exactly
    per_host = [per_rank[2 * h] + per_rank[2 * h + 1] for h in range(4)]
    assert per_host == [64 * MiB] * 4
    # every rank computes the same plan
    assert plan_stripes(item, [[0, 1], [2, 3], [4, 5], [6, 7]], 8 * MiB) == stripes
    uneven = plan_stripes(_item([5 * MiB, 3 * MiB, 2 * MiB]), [[0], [1, 2]], stripe_bytes=MiB)
    loads = [sum(s.length for s in uneven if s.reader == r) for r in range(3)]
    assert loads[0] - (loads[1] + loads[2]) in (-MiB, 0, MiB)  # hosts within one stripe
    mine = ranges_of(uneven, 0)
    assert sum(n for spans in mine.values() for _, n in spans) == loads[0]


def test_each_host_and_rank_reads_one_contiguous_run():
    """Runs in segment order, so the exchange moves each host's bytes as one range (odd blob
    sizes: the alignment padding between blobs travels with them, no other host's byte)."""
    sizes = [5 * MiB + 3, 700, 3 * MiB, 0, 129, 6 * MiB + 1, 64, 2 * MiB]
    item = _item(sizes)
    hosts = [[0, 1], [2, 3], [4, 5]]
    stripes = plan_stripes(item, hosts, stripe_bytes=2 * MiB)
    offsets, data = segment_layout(sizes)
    owner = {r: h for h, ranks in enumerate(hosts) for r in ranks}
    ranges = exchange_ranges(stripes, sizes, owner, len(hosts))
    assert [len(r) for r in ranges] == [1, 1, 1]
    (a, b), (c, d), (e, f) = (r[0] for r in ranges)
    assert a == 0 and b <= c and d <= e and f == offsets[-1] + sizes[-1] <= data
    for h, (lo, hi) in enumerate(r[0] for r in ranges):  # exactly this host's blob bytes
        mine = {(offsets[x] + st, n) for s in stripes if owner[s.reader] == h
                for x, st, n in s.parts}
        assert sum(n for _, n in mine) == sum(s.length for s in stripes if owner[s.reader] == h)
        inside = [(o + st, n) for s in stripes for x, st, n in s.parts
                  for o in [offsets[x]] if lo <= o + st < hi]
        assert set(inside) == mine
    # and per rank: the exchange without host sharing has one part per rank
    per_rank = exchange_ranges(stripes, sizes, {r: r for r in range(6)}, 6)
    assert all(len(r) <= 1 for r in per_rank)
    total = sum(sizes)
    assert abs(sum(s.length for s in stripes if owner[s.reader] == 0) - total / 3) <= 4 * MiB


def test_exchange_ranges_never_span_another_members_bytes():
    # blob 1 (64 bytes, whole) between two parts of rank 0: rank 0 gets two ranges
    sizes = [100, 64, 100]
    item = _item(sizes, whole=(0, 1, 2))
    from xla_ckpt.restore.striped import Stripe

    stripes = [Stripe(((0, 0, 100),), 0), Stripe(((1, 0, 64),), 1), Stripe(((2, 0, 100),), 0)]
    offsets, _ = segment_layout(sizes)
    ranges = exchange_ranges(stripes, sizes, {0: 0, 1: 1}, 2)
    assert ranges == [[(0, 100), (offsets[2], offsets[2] + 100)],
                      [(offsets[1], offsets[1] + 64)]]
    # without blob 1 in between (it is empty) the padding after blob 0 joins them
    sizes = [100, 0, 100]
    offsets, _ = segment_layout(sizes)
    stripes = [Stripe(((0, 0, 100),), 0), Stripe(((2, 0, 100),), 0)]
    assert exchange_ranges(stripes, sizes, {0: 0, 1: 1}, 2) == [[(0, offsets[2] + 100)], []]
    assert item.blobs[1].length == 64


def test_stripe_size_bounds():
    assert stripe_size(0, 8, 16 * MiB) == MiB
    assert stripe_size(256 * MiB, 8, 16 * MiB) == 8 * MiB
    assert stripe_size(64 * 1024 * MiB, 8, 16 * MiB) == 16 * MiB
    with pytest.raises(ValueError, match="at least one rank per host"):
        plan_stripes(_item([MiB]), [[0], []], MiB)


def test_stripe_reads_check_and_refuse_unaligned_ranges(tmp_path):
    t = torch.arange(5 * MiB // 2, dtype=torch.float32) * 0.5  # 2.5 chunks of 4 MiB
    uri = str(tmp_path / "ck")
    save({"t": t}, uri)
    reader = CheckpointReader.open(uri)
    item = reader.manifest.item("state")
    (rec,) = item.blobs
    c = rec.chunk_size
    buf = torch.zeros(rec.length, dtype=torch.uint8)
    got = reader.read_ranges_into("state", {0: buf}, {0: [(0, c)]})
    assert got == c
    assert torch.equal(buf[:c], t.view(torch.uint8)[:c]) and not buf[c:].any()
    with pytest.raises(ValueError, match="not aligned to its crc32c chunks"):
        reader.read_ranges_into("state", {0: buf}, {0: [(1, c)]})
    # the tail range ends at the blob's end, not a chunk boundary: allowed
    tail = rec.length - (rec.length // c) * c or c
    reader.read_ranges_into("state", {0: buf}, {0: [(rec.length - tail, tail)]})
    assert torch.equal(buf[rec.length - tail:], t.view(torch.uint8)[rec.length - tail:])
    # a corrupted byte inside a stripe is caught by that chunk's crc32c
    storage = open_storage(uri)
    path = tmp_path / "ck" / rec.file
    raw = bytearray(path.read_bytes())
    raw[rec.offset + 5] ^= 0xFF
    path.write_bytes(bytes(raw))
    storage.close()
    from xla_ckpt.errors import IntegrityError
    with pytest.raises(IntegrityError, match="crc32c mismatch"):
        CheckpointReader.open(uri).read_ranges_into("state", {0: buf}, {0: [(0, c)]})


def _shape(hosts: int, per: int, kind: str = "gloo") -> JobShape:
    return JobShape(RestoreTopology(hosts=hosts, ranks_per_host=per), kind)


EMULATED = Bandwidths(storage_stream_bytes_per_s=32 * MiB, storage_host_bytes_per_s=64 * MiB,
                      first_byte_latency_s=0.03)


def test_auto_picks_striped_when_host_links_are_the_bottleneck():
    sizes = RestoreSizes(state_bytes=256 * MiB)
    cfg = RestoreConfig(cost_model=EMULATED)
    choice = choose_plan_for_job(_shape(4, 2), sizes, cfg)
    assert choice.plan == "striped"
    assert set(choice.predicted_s) == {"all_ranks", "per_host", "broadcast", "striped"}
    # the every-rank read pulls the state twice per host, per_host once: striped's quarter wins
    assert choice.predicted_s["all_ranks"] > choice.predicted_s["per_host"] \
        > choice.predicted_s["striped"]


def test_auto_on_xla_keeps_off_the_data_plane_unless_allowed():
    sizes = RestoreSizes(state_bytes=256 * MiB)
    cfg = RestoreConfig(cost_model=EMULATED)
    choice = choose_plan_for_job(_shape(4, 2, "xla"), sizes, cfg)
    assert choice.plan == "per_host"
    assert "needs an XLA collective" in choice.reason
    allowed = RestoreConfig(cost_model=EMULATED, allow_xla_data_plane=True)
    assert choose_plan_for_job(_shape(4, 2, "xla"), sizes, allowed).plan == "striped"
    # one host: no plan but broadcast needs a cross-host collective, so striped stays allowed
    one = choose_plan_for_job(_shape(1, 4, "xla"), sizes, cfg)
    assert one.reason.endswith("excluded: broadcast (needs an XLA collective "
                               "(restore.allow_xla_data_plane is false))")
    # ... and one shared link: one read per host is as fast as stripes, and simpler
    assert one.plan == "per_host"


def test_auto_without_host_memory_and_single_process():
    sizes = RestoreSizes(state_bytes=256 * MiB)
    off = RestoreConfig(cost_model=EMULATED, host_shared_memory=False)
    assert choose_plan_for_job(_shape(4, 2), sizes, off).plan in ("striped", "broadcast")
    assert "per_host (not runnable here)" in choose_plan_for_job(_shape(4, 2), sizes, off).reason
    assert choose_plan_for_job(_shape(1, 1, "single"), sizes, RestoreConfig()).plan == "all_ranks"
    # a tiny state: the first-byte latency dominates; one read per host beats exchanging
    tiny = RestoreSizes(state_bytes=4096)
    assert choose_plan_for_job(_shape(2, 2), tiny, RestoreConfig()).plan in ("all_ranks",
                                                                              "per_host")


def test_cost_model_from_yaml_mapping():
    cfg = RestoreConfig(cost_model={"first_byte_latency_s": 0.5, "streams_per_reader": 2})  # type: ignore[arg-type]  # a YAML-style mapping
    assert cfg.cost_model.first_byte_latency_s == 0.5 and cfg.cost_model.streams_per_reader == 2
    from xla_ckpt.errors import ConfigError
    with pytest.raises(ConfigError, match="restore.cost_model.storage_host_bytes_per_s"):
        RestoreConfig(cost_model={"storage_host_bytes_per_s": 0})  # type: ignore[arg-type]  # a YAML-style mapping
    with pytest.raises(ConfigError, match="restore.strategy must be one of auto, all_ranks, "
                                          "per_host, broadcast, striped"):
        RestoreConfig(strategy="rank0")


def test_cost_model_refuses_infinite_latency_and_unknown_keys():
    from xla_ckpt.errors import ConfigError
    for name in ("first_byte_latency_s", "data_plane_latency_s"):
        with pytest.raises(ConfigError, match=f"restore.cost_model.{name} must be a finite"):
            RestoreConfig(cost_model={name: float("inf")})  # type: ignore[arg-type]  # a YAML-style mapping
    with pytest.raises(ConfigError, match="restore.cost_model: unknown key.s. first_byte_latncy_s; "
                                          "valid keys: data_plane_cross_host_bytes_per_s"):
        RestoreConfig(cost_model={"first_byte_latncy_s": 0.03})  # type: ignore[arg-type]  # a YAML-style mapping


def test_the_size_auto_sees_of_a_chunked_checkpoint_is_its_chunks():
    """A sharded (manifest v2) state item holds no blobs of its own: its bytes are the saved
    chunks', which is what the cost model must weigh (10 x 6 float32 rows + an int64)."""
    from tests.format.test_chunked_manifest import parse, v2_doc
    from xla_ckpt.restore.select import sizes_of

    m = parse(v2_doc())
    assert m.item("state").chunked and not m.item("state").blobs
    assert sizes_of(m, "state", RestoreConfig(), None).state_bytes == 10 * 6 * 4 + 8
