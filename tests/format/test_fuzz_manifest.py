"""Fuzz the manifest parser, and a whole load of a tampered checkpoint: only library errors.

A manifest is untrusted input.  Whatever its bytes, ``Manifest.from_json_bytes``
either returns a validated manifest or raises ``CheckpointCorruptError``; a
checkpoint whose manifest was tampered with loads, verifies and inspects to
either the right values or an ``XlaCkptError`` -- never another exception,
a crash or a hang.  Bounded example counts keep CI fast.
"""

import copy
import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xla_ckpt
from xla_ckpt.errors import CheckpointCorruptError, XlaCkptError
from xla_ckpt.format import manifest as manifest_mod
from xla_ckpt.format.manifest import MANIFEST_NAME, Item, Manifest
from xla_ckpt.format.plan import blob_record, plan_item
from xla_ckpt.format.safetensors_layout import build_header
from xla_ckpt.io.verify import verify_checkpoint
from xla_ckpt.storage.local import LocalStorage

FUZZ = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

json_scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2**70, 2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
                | st.sampled_from(["float32", "../x", "manifest.json", "$tensor", "$tuple", "state",
                                   "xla_ckpt", "bfloat16", "", "..", "a/b", "U8"]))
json_values = st.recursive(json_scalars, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)


def _valid_doc() -> dict:
    state = {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                       "b": torch.ones(3, dtype=torch.bfloat16)},
             "step": 3, "betas": (0.9, 0.98)}
    plan = plan_item(state)
    header, offsets = build_header(plan.blobs, {})
    blobs = [blob_record(b, "data-x-state.safetensors", off)
             for b, off in zip(plan.blobs, offsets, strict=True)]
    size = len(header) + sum(b.data.numel() for b in plan.blobs)
    m = Manifest(save_id="abc", items={"state": Item(plan.state, plan.tensors, blobs)},
                 files={"data-x-state.safetensors": size}, metadata={"num_updates": 5})
    doc = json.loads(m.to_json_bytes())
    doc.pop("manifest_crc32c", None)  # the self-checksum trailer, where the format has one
    return doc


VALID = _valid_doc()


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _mutate(doc, path, value, how):
    doc = copy.deepcopy(doc)
    if not path:
        return value
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1]
    if how == "replace":
        parent[last] = value
    elif how == "delete":
        if isinstance(parent, dict):
            del parent[last]
        else:
            parent.pop(last)
    elif how == "duplicate" and isinstance(parent, list):
        parent.append(copy.deepcopy(parent[last]))
    elif how == "negate" and isinstance(parent[last], int) and not isinstance(parent[last], bool):
        parent[last] = -parent[last] - 1
    elif how == "huge" and isinstance(parent[last], int) and not isinstance(parent[last], bool):
        parent[last] = parent[last] + 2**40
    else:
        parent[last] = value
    return doc


mutations = st.lists(st.tuples(st.integers(0, 10**6), json_values,
                               st.sampled_from(["replace", "delete", "duplicate", "negate",
                                                "huge"])), min_size=1, max_size=3)


def _apply(doc, muts):
    """Apply (path index, value, how) mutations; a path is drawn from the current document."""
    for index, value, how in muts:
        paths = list(_paths(doc))
        try:
            doc = _mutate(doc, paths[index % len(paths)], value, how)
        except (KeyError, IndexError, TypeError, AttributeError):
            continue
    return doc


def test_valid_manifest_parses_and_round_trips():
    m = Manifest.from_json_bytes(json.dumps(VALID).encode())
    assert [t.key for t in m.item().tensors] == ["state['model']['w']", "state['model']['b']"]
    again = json.loads(m.to_json_bytes())
    again.pop("manifest_crc32c", None)
    assert again == VALID


@FUZZ
@given(st.binary(max_size=300))
def test_arbitrary_bytes_give_only_corrupt_errors(data):
    try:
        Manifest.from_json_bytes(data, where="fuzz")
    except CheckpointCorruptError as e:
        assert "fuzz" in str(e)


@FUZZ
@given(json_values)
def test_arbitrary_json_gives_only_corrupt_errors(doc):
    try:
        Manifest.from_json_bytes(json.dumps(doc).encode(), where="fuzz")
    except CheckpointCorruptError as e:
        assert "fuzz" in str(e)


@FUZZ
@given(mutations)
def test_mutated_manifest_gives_only_corrupt_errors(muts):
    doc = _apply(VALID, muts)
    try:
        m = Manifest.from_json_bytes(json.dumps(doc).encode(), where="fuzz")
    except CheckpointCorruptError as e:
        assert "fuzz" in str(e)
        return
    # What validates must be internally consistent: every view fits its blob and its file.
    for item in m.items.values():
        for t in item.tensors:
            blob = item.blobs[t.blob]
            assert t.byte_offset + t.span_bytes() <= blob.length
            assert blob.offset + blob.length <= m.files[blob.file]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzzck")
    state = {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                       "b": torch.ones(3, dtype=torch.bfloat16)},
             "step": 3, "betas": (0.9, 0.98), "opt": {0: {"exp_avg": torch.zeros(4)}}}
    xla_ckpt.save(state, str(root / "ck"))
    return root / "ck", state


@FUZZ
@given(mutations)
def test_tampered_checkpoint_loads_or_raises_library_error(saved, muts):
    folder, state = saved
    original = (folder / MANIFEST_NAME).read_bytes()
    doc = json.loads(original)
    fuzzed = _apply(doc, muts)
    tmp = folder / (MANIFEST_NAME + ".fuzz")
    body = json.dumps(fuzzed).encode()
    seal = getattr(manifest_mod, "seal", None)  # hostile bytes may carry a valid self-checksum
    if seal is not None and isinstance(fuzzed, dict):
        fuzzed.pop("manifest_crc32c", None)
        body = seal(json.dumps(fuzzed).encode())
    tmp.write_bytes(body)
    os.replace(tmp, folder / MANIFEST_NAME)
    try:
        try:
            loaded = xla_ckpt.load(str(folder))
        except XlaCkptError:
            loaded = None
        if fuzzed == doc:  # the mutations cancelled out: the state must come back exactly
            assert loaded is not None and torch.equal(loaded["model"]["w"], state["model"]["w"])
        try:
            with LocalStorage(str(folder)) as st_:
                verify_checkpoint(st_)
        except XlaCkptError:
            pass
    finally:
        (folder / MANIFEST_NAME).write_bytes(original)
