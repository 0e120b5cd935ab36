"""``WrittenItem.from_json``: what another rank sent is rebuilt and checked before a commit.

Both distributed save paths (``save_distributed`` and the manager) gather every rank's
written items as JSON (``restore.save_steps.parts_json``) and rebuild them with
``parts_from_json`` -> ``WrittenItem.from_json``; a malformed document is a
``CheckpointCorruptError`` naming the rank, the item and the field, never a manifest readers
would refuse.  Real local storage: the items are written by ``write_items``.
"""

from __future__ import annotations

import json

import pytest
import torch

from xla_ckpt.errors import CheckpointCorruptError
from xla_ckpt.format.manifest import rank_item
from xla_ckpt.io.writer import WrittenItem, write_items
from xla_ckpt.restore.save_steps import parts_from_json, parts_json
from xla_ckpt.storage import open_storage


@pytest.fixture
def written(tmp_path):
    storage = open_storage(str(tmp_path))
    parts = write_items(storage, "abc123", [
        ("state", {"w": torch.arange(6.0).reshape(2, 3), "n": 3}),
        (rank_item(1), {"pos": torch.tensor([5], dtype=torch.int64)})])
    yield parts
    storage.close()


def test_round_trip_of_every_rank_is_what_was_written(written):
    docs = [parts_json(written[:1]), parts_json(written[1:]), parts_json([])]
    back = parts_from_json(docs, "abc123")
    assert back == written
    assert [WrittenItem.from_json(p.to_json(), rank=0) for p in written] == written


def _doc(written, **change):
    d = json.loads(json.dumps(written[1].to_json()))
    for path, value in change.items():
        node = d
        keys = path.split("__")
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        if value is _DROP:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
    return d


_DROP = object()


@pytest.mark.parametrize("change, words", [
    ({"files": _DROP}, "item 'rank/00001' written by rank 3: field 'files' is missing"),
    ({"files": ["x"]}, "item 'rank/00001' written by rank 3: 'files' must be an object, got list"),
    ({"item": 5}, "item 'rank/00001' written by rank 3: 'item' must be an object, got int"),
    ({"name": ""}, "item document written by rank 3: 'name' must be a non-empty string, got ''"),
    ({"item__tensors__0__dtype": "float99"},
     "unknown dtype 'float99' for the items written by rank 3: item 'rank/00001' tensor 0"),
    ({"item__blobs__0__file": "../escape"},
     "the items written by rank 3: item 'rank/00001' blob 0: file '../escape' is not listed"),
    ({"item__tensors__0__shape": [1000]},
     ("the items written by rank 3: item 'rank/00001' tensor 0 (state['pos']): shape [1000] "
      "of int64 needs 8000 bytes")),
])
def test_a_malformed_document_names_the_rank_the_item_and_the_field(written, change, words):
    with pytest.raises(CheckpointCorruptError) as ei:
        WrittenItem.from_json(_doc(written, **change), rank=3)
    assert words in str(ei.value)


def test_a_rank_that_sent_no_list_or_no_json_is_named():
    with pytest.raises(CheckpointCorruptError, match="item document written by rank 1 must be "
                                                    "an object with 'name', 'item' and 'files', "
                                                    "got str"):
        parts_from_json([b"[]", b'["x"]'], "abc123")
    with pytest.raises(CheckpointCorruptError, match="the items written by rank 2 must be a "
                                                    "list, got dict"):
        parts_from_json([b"[]", b"[]", b"{}"], "abc123")
    with pytest.raises(CheckpointCorruptError, match="the items written by rank 0 are not JSON"):
        parts_from_json([b"[", b"[]"], "abc123")
