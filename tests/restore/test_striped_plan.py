"""The striped plan's reads of the replicated blobs, its exchange ranges, and ``auto``'s choice
(no processes, no timing)."""

from __future__ import annotations

import pytest

from xla_ckpt.comm.host_memory import ALIGN_BYTES, segment_layout
from xla_ckpt.format.manifest import BlobRecord, Item, Manifest
from xla_ckpt.restore import RestoreConfig
from xla_ckpt.restore.assign import BALANCE_TOLERANCE
from xla_ckpt.restore.blobs import blob_reads
from xla_ckpt.restore.box_striped import FlatExchange, _Block, flat_ranges
from xla_ckpt.restore.cost import Bandwidths, RestoreSizes, RestoreTopology
from xla_ckpt.restore.select import JobShape, choose_plan_for_job

MiB = 1 << 20


def _item(lengths: list[int], chunk: int = MiB, whole: tuple[int, ...] = ()) -> Item:
    blobs, off = [], 0
    for i, n in enumerate(lengths):
        chunks = () if i in whole else (0,) * (-(-n // chunk))
        blobs.append(BlobRecord(file="data/0", offset=off, length=n, crc32c=0, chunk_size=chunk,
                                chunk_crc32c=chunks))
        off += n
    return Item(state=None, blobs=blobs)


def _manifest(lengths: list[int], **kw) -> Manifest:
    item = _item(lengths, **kw)
    return Manifest(save_id="s", items={"state": item}, files={"data/0": sum(lengths)})


def _covers_once(m: Manifest, reads: list[list[tuple[int, int, int]]]) -> None:
    item = m.item("state")
    per_blob: dict[int, list[tuple[int, int]]] = {}
    for mine in reads:
        for b, lo, hi in mine:
            per_blob.setdefault(b, []).append((lo, hi))
    for b, rec in enumerate(item.blobs):
        spans = sorted(per_blob.get(b, []))
        if rec.length:
            assert spans[0][0] == 0 and spans[-1][1] == rec.length, b
        assert all(spans[k][1] == spans[k + 1][0] for k in range(len(spans) - 1)), b
        for lo, hi in spans:  # whole crc32c chunks (or the whole blob): checked by its reader
            assert lo % rec.chunk_size == 0 or not rec.chunk_crc32c, (b, lo)
            assert hi % rec.chunk_size == 0 or hi == rec.length, (b, hi)
            assert rec.chunk_crc32c or (lo, hi) == (0, rec.length), (b, lo, hi)


def test_blob_reads_cover_every_byte_once_on_chunk_boundaries_balanced():
    sizes = [5 * MiB + 3, 700, 3 * MiB, 0, 129, 6 * MiB + 1, 64, 2 * MiB, 900 * 1024]
    m = _manifest(sizes, chunk=256 * 1024, whole=(1, 4, 6))
    for world in (1, 2, 3, 6, 8):
        reads = blob_reads(m, "state", world)
        _covers_once(m, reads)
        per_rank = [sum(hi - lo for _, lo, hi in mine) for mine in reads]
        mean = sum(sizes) / world
        assert max(abs(n - mean) for n in per_rank) <= BALANCE_TOLERANCE * mean, per_rank
        assert blob_reads(m, "state", world) == reads  # pure: every rank plans the same
    # the blobs in another order: still within 25 % (not one rank with every large blob)
    m = _manifest([64] * 40 + [4 * MiB] * 4, chunk=256 * 1024)
    reads = blob_reads(m, "state", 4)
    _covers_once(m, reads)
    per_rank = [sum(hi - lo for _, lo, hi in mine) for mine in reads]
    assert max(per_rank) <= 1.25 * sum(per_rank) / 4, per_rank


def _ex(sizes: list[int], member: list[int]) -> tuple[FlatExchange, list[int]]:
    offsets, _ = segment_layout(sizes)
    return FlatExchange(None, member, None, offsets, ALIGN_BYTES), offsets


def test_each_host_sends_its_rows_as_one_range():
    """Contiguous runs in rank order, ranks of a host side by side: the exchange moves each
    host's bytes as one range of its segment (odd blob sizes: the alignment padding between
    blobs travels with them, no other host's byte)."""
    sizes = [5 * MiB + 3, 700, 3 * MiB, 0, 129, 6 * MiB + 1, 64, 2 * MiB]
    m = _manifest(sizes, chunk=256 * 1024, whole=(1, 4, 6))
    hosts = [[0, 1], [2, 3], [4, 5]]
    member = [h for h, ranks in enumerate(hosts) for _ in ranks]
    reads = {r: [_Block(r, b, lo, hi) for b, lo, hi in mine]
             for r, mine in enumerate(blob_reads(m, "state", 6))}
    ex, offsets = _ex(sizes, member)
    ranges = flat_ranges(reads, sizes, ex, len(hosts))
    assert [len(r) for r in ranges] == [1, 1, 1]
    for h, [(lo, hi)] in enumerate(ranges):  # exactly this host's blob bytes, and padding
        mine = {(offsets[b.index] + b.lo, offsets[b.index] + b.hi) for r in hosts[h]
                for b in reads[r]}
        inside = {(offsets[b.index] + b.lo, offsets[b.index] + b.hi) for bl in reads.values()
                  for b in bl if lo <= offsets[b.index] + b.lo < hi and b.hi > b.lo}
        assert inside == {x for x in mine if x[1] > x[0]}
    # without host sharing every rank is a member: at most one range each
    ex, _ = _ex(sizes, list(range(6)))
    assert all(len(r) <= 1 for r in flat_ranges(reads, sizes, ex, 6))


def test_flat_ranges_never_span_another_members_bytes():
    # blob 1 (64 bytes) between two blobs of member 0: member 0 sends two ranges
    sizes = [100, 64, 100]
    ex, offsets = _ex(sizes, [0, 1])
    reads = {0: [_Block(0, 0, 0, 100), _Block(0, 2, 0, 100)], 1: [_Block(1, 1, 0, 64)]}
    assert flat_ranges(reads, sizes, ex, 2) == [[(0, 100), (offsets[2], offsets[2] + 100)],
                                                [(offsets[1], offsets[1] + 64)]]
    # without blob 1 in between (it is empty) the padding after blob 0 joins them
    sizes = [100, 0, 100]
    ex, offsets = _ex(sizes, [0, 1])
    reads = {0: [_Block(0, 0, 0, 100), _Block(0, 2, 0, 100)], 1: []}
    assert flat_ranges(reads, sizes, ex, 2) == [[(0, offsets[2] + 100)], []]
    # a block that ends inside a blob does not reach across the next member's rows
    sizes = [300]
    ex, _ = _ex(sizes, [0, 1])
    reads = {0: [_Block(0, 0, 0, 100), _Block(0, 0, 200, 300)], 1: [_Block(1, 0, 100, 200)]}
    assert flat_ranges(reads, sizes, ex, 2) == [[(0, 100), (200, 300)], [(100, 200)]]


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
