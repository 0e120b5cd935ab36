"""``xla-ckpt verify``: every crc32c recomputed; exit 0 intact, 1 corrupt naming every bad tensor,
2 usage/access error.  Also :mod:`xla_ckpt.io.verify` directly (parallel slices, crc32c combine).
"""

import json
import random

import safetensors.torch
import torch
from cli_helpers import flip_byte, make_run

from xla_ckpt.format import manifest as manifest_mod
from xla_ckpt.format.crc import crc32c
from xla_ckpt.format.manifest import MANIFEST_NAME, STATE_ITEM, rank_item
from xla_ckpt.io import commit, new_save_id, read_manifest, write_item
from xla_ckpt.io.verify import crc32c_combine, verify_checkpoint
from xla_ckpt.storage import StorageConfig, open_storage

CHUNK = 1024


def reseal(body: bytes) -> bytes:
    """A rewritten manifest with a valid self-checksum when the format has one (not a signature:
    whoever rewrites a manifest can recompute it), so the deeper check is what is tested."""
    seal = getattr(manifest_mod, "seal", None)
    return seal(body) if seal is not None else body


def save_chunked(uri: str) -> dict:
    """A checkpoint with 1 KiB crc32c chunks: 'a' and 'b' view one 32 KiB blob, 'c' its own."""
    base = torch.arange(8192, dtype=torch.float32)
    state = {"a": base[:4096], "b": base[4096:], "c": torch.ones(16, dtype=torch.float64)}
    rank1 = {"r": torch.full((300,), 7, dtype=torch.int32)}
    with open_storage(uri) as st:
        sid = new_save_id()
        parts = [write_item(st, sid, STATE_ITEM, state, chunk_size_bytes=CHUNK),
                 write_item(st, sid, rank_item(1), rank1, chunk_size_bytes=CHUNK)]
        commit(st, sid, parts)
    return state


def _blob_of(m, key, item=STATE_ITEM):
    it = m.items[item]
    rec = next(t for t in it.tensors if t.key == key)
    return it.blobs[rec.blob], rec


def test_intact_checkpoint_exits_0(cli, root):
    make_run(root, [("checkpoint_1_100", 100, 1, 1.0)])
    r = cli("verify", f"{root}/checkpoint_1_100")
    assert r.code == 0 and r.err == ""
    assert r.out.startswith(f"OK {root}/checkpoint_1_100: 8 tensors in 1 files, ")
    r = cli("verify", root)  # run folder -> latest
    assert r.code == 0 and r.out.startswith(f"OK {root}/checkpoint_1_100:")


def test_every_bad_tensor_is_named_and_only_those(cli, root):
    uri = f"{root}/ck"
    save_chunked(uri)
    with open_storage(uri) as st:
        m = read_manifest(st)
    blob_ab, rec_b = _blob_of(m, "state['b']")
    blob_c, _ = _blob_of(m, "state['c']")
    blob_r, _ = _blob_of(m, "state['r']", rank_item(1))
    # One flipped bit inside 'b' (the second half of the shared blob), one in 'c', one in rank 1's.
    flip_byte(uri, blob_ab.file, blob_ab.offset + rec_b.byte_offset + 5 * CHUNK + 3)
    flip_byte(uri, blob_c.file, blob_c.offset + 9)
    flip_byte(uri, blob_r.file, blob_r.offset + 1000)
    r = cli("verify", uri)
    assert r.code == 1 and r.err == ""
    lines = r.out.splitlines()
    start = blob_ab.offset + rec_b.byte_offset + 5 * CHUNK
    assert lines[0] == (f"BAD state['b']: {blob_ab.file}: crc32c mismatch in bytes "
                        f"[{start}, {start + CHUNK})")
    assert lines[1].startswith(f"BAD state['c']: {blob_c.file}: crc32c of bytes "
                               f"[{blob_c.offset}, {blob_c.offset + 128}) is 0x")
    assert lines[2].startswith("BAD rank/00001:state['r']: ") and "crc32c mismatch" in lines[2]
    assert not any("state['a']" in ln for ln in lines)
    assert lines[-1] == f"CORRUPT {uri}: 3 bad tensors, 3 problems in 2 of 2 files"

    r = cli("verify", uri, "--json")
    doc = json.loads(r.out)
    assert r.code == 1 and doc["ok"] is False
    assert doc["bad_tensors"] == ["state['b']", "state['c']", "rank/00001:state['r']"]
    assert [p["kind"] for p in doc["problems"]] == ["crc32c"] * 3


def test_missing_and_truncated_data_files_are_named(cli, root):
    uri = f"{root}/ck"
    save_chunked(uri)
    with open_storage(uri) as st:
        m = read_manifest(st)
        state_file = m.items[STATE_ITEM].blobs[0].file
        rank_file = m.items[rank_item(1)].blobs[0].file
        st.delete(rank_file)
        data = st.read_bytes(state_file)
        blob_c, _ = _blob_of(m, "state['c']")
        st.write_atomic(state_file, [data[:blob_c.offset + 8]])  # cut inside 'c'
    r = cli("verify", uri)
    assert r.code == 1
    out = r.out
    assert f"BAD rank/00001:state['r']: {rank_file}: data file is missing (expected " in out
    assert (f"BAD {state_file}: expected {m.files[state_file]} bytes, found "
            f"{blob_c.offset + 8} bytes (truncated)") in out
    assert (f"BAD state['c']: {state_file}: bytes [{blob_c.offset}, {blob_c.offset + 128}) lie "
            f"beyond the end of the {blob_c.offset + 8}-byte file (truncated)") in out
    assert "state['a']" not in out and "state['b']" not in out  # still inside the file: intact


def test_usage_and_access_errors_exit_2_incomplete_exits_1(cli, root, tmp_path):
    r = cli("verify", f"{root}/nothing")
    assert r.code == 2 and r.out == "" and r.err.count("\n") == 1
    assert r.err.startswith("xla-ckpt verify: error: ") and "no checkpoint here" in r.err
    make_run(root, [], incomplete=["checkpoint_1_1"])
    r = cli("verify", f"{root}/checkpoint_1_1")
    assert r.code == 1 and "incomplete (no manifest.json commit marker)" in r.err
    r = cli("verify", "s3://bucket/x")
    assert r.code == 2 and "unsupported URI scheme" in r.err
    r = cli("verify")
    assert r.code == 2


def test_unreadable_manifest_exits_1(cli, root):
    make_run(root, [("checkpoint_1_100", 100, 1, 1.0)])
    with open_storage(f"{root}/checkpoint_1_100") as st:
        st.write_atomic(MANIFEST_NAME, [b'{"format": "xla_ckpt", "version": 1, "files": 3}'])
    r = cli("verify", f"{root}/checkpoint_1_100")
    assert r.code == 1 and "'files' must be an object" in r.err


# ---- library ------------------------------------------------------------------------------


def test_verify_reads_in_parallel_slices_and_reports_progress(tmp_path):
    uri = str(tmp_path / "ck")
    save_chunked(uri)
    seen: list[int] = []
    with open_storage(uri, StorageConfig(slice_size_bytes=4 * CHUNK, max_workers=4)) as st:
        report = verify_checkpoint(st, progress=seen.append)
        total = sum(b.length for it in read_manifest(st).items.values() for b in it.blobs)
    assert report.ok and report.problems == []
    assert (report.files, report.blobs, report.tensors) == (2, 3, 4)
    assert sum(seen) == total == report.bytes_read
    assert max(seen) == 4 * CHUNK and len(seen) > 8  # sliced, not whole blobs


def test_whole_blob_crc_is_combined_from_slices():
    rng = random.Random(0)
    for _ in range(200):
        a = rng.randbytes(rng.randint(0, 5000))
        b = rng.randbytes(rng.randint(0, 5000))
        assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


def test_whole_blob_crc_disagreeing_with_chunks_is_reported(tmp_path):
    uri = str(tmp_path / "ck")
    save_chunked(uri)
    with open_storage(uri) as st:
        doc = json.loads(st.read_bytes(MANIFEST_NAME))
        doc["items"]["state"]["blobs"][0]["crc32c"] ^= 1
        doc.pop("manifest_crc32c", None)
        st.write_atomic(MANIFEST_NAME, [reseal(json.dumps(doc).encode())])
        report = verify_checkpoint(st)
    assert [p.keys for p in report.problems] == [("state['a']", "state['b']")]
    assert "manifest says" in report.problems[0].detail


def test_verify_on_a_legacy_file_says_to_convert_it(cli, root):
    with open_storage(root) as st:
        st.write_atomic("x.safetensors", [safetensors.torch.save({"w": torch.ones(2)})])
    r = cli("verify", f"{root}/x.safetensors")
    assert r.code == 2 and r.out == ""
    assert r.err == (f"xla-ckpt verify: error: {root}/x.safetensors is a legacy "
                     "torch.save/fairseq .pt or safetensors file, not an xla_ckpt checkpoint "
                     "folder; read it with xla_ckpt.load or import it with `xla-ckpt convert "
                     f"{root}/x.safetensors DST`\n")
