"""Conformance: custom metadata stored by ``write_atomic`` and returned by
``list_in_subfolders``, the one listing a run folder's catalog orders its checkpoints from
(every backend of ``conftest.BACKENDS``, the faulty GCS one included)."""

from __future__ import annotations

from xla_ckpt.storage.base import ObjectInfo, Storage


def names_and_metadata(objs: list[ObjectInfo]) -> list[tuple[str, object]]:
    return [(o.name, o.metadata) for o in objs]


def test_list_in_subfolders_returns_each_marker_with_its_metadata(storage: Storage):
    storage.write_atomic("b/manifest.json", [b"{}"], if_generation_match=0,
                         metadata={"k": "2", "when": "1.5"})
    storage.write_atomic("a/manifest.json", [b"{ }"], metadata={"k": "1"})
    storage.write_atomic("a/data-1", [b"x" * 3000])                # not a marker: not listed
    storage.write_atomic("c/data-1", [b"x"])                       # no marker in c/
    storage.write_atomic("manifest.json", [b"{}"])                 # the top: not one level down
    storage.write_atomic("a/deeper/manifest.json", [b"{}"])        # two levels down
    storage.write_atomic("d/manifest.json", [b"{}"])               # written without metadata
    got = storage.list_in_subfolders("", "manifest.json")
    assert [(o.name, o.size) for o in got] == [("a/manifest.json", 3), ("b/manifest.json", 2),
                                               ("d/manifest.json", 2)]
    assert [o.metadata for o in got[:2]] == [{"k": "1"}, {"k": "2", "when": "1.5"}]
    assert got[2].metadata in (None, {})
    assert all(o.generation == storage.stat(o.name).generation for o in got)


def test_list_in_subfolders_under_a_prefix_and_of_an_absent_one(storage: Storage):
    storage.write_atomic("run/x/manifest.json", [b"1"], metadata={"e": "0"})
    storage.write_atomic("runner/y/manifest.json", [b"2"], metadata={"e": "1"})  # not under run/
    assert names_and_metadata(storage.list_in_subfolders("run", "manifest.json")) == [
        ("x/manifest.json", {"e": "0"})]
    assert storage.list_in_subfolders("nothing-here", "manifest.json") == []


def test_a_replace_without_metadata_drops_it(storage: Storage):
    storage.write_atomic("a/manifest.json", [b"1"], metadata={"e": "3"})
    storage.write_atomic("a/manifest.json", [b"22"])
    (only,) = storage.list_in_subfolders("", "manifest.json")
    assert (only.size, only.metadata in (None, {})) == (2, True)


def test_metadata_of_a_composed_write(storage: Storage):
    """An object large enough to go up as parts (GCS: composed) keeps its metadata too."""
    big = bytes(range(256)) * 600  # 153,600 bytes: above the conformance GCS part threshold
    storage.write_atomic("e/manifest.json", [big], if_generation_match=0, metadata={"n": "7"})
    (only,) = storage.list_in_subfolders("", "manifest.json")
    assert (only.name, only.size, only.metadata) == ("e/manifest.json", len(big), {"n": "7"})
    assert storage.read_bytes("e/manifest.json") == big
