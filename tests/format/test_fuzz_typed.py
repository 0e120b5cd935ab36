"""Fuzz the typed (non-tensor) state decoder: hostile trees give CheckpointCorruptError only.

The typed tree comes from the manifest, so it is untrusted: unknown tags,
wrong payload types, huge numbers, odd numpy dtypes, unhashable keys and deep
nesting must each end in the library's error, never another exception.
Bounded example counts keep CI fast.
"""

import argparse
import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xla_ckpt.errors import CheckpointCorruptError, UnsupportedTypeError
from xla_ckpt.format import typed

FUZZ = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])

TAGS = ["$tuple", "$float", "$dict", "$odict", "$np", "$np_dtype", "$namespace", "$torch_dtype",
        "$torch_device", "$bytes", "$set", "$frozenset", "$complex", "$tensor", "$ndarray",
        "$nope"]

scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2**80, 2**80)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=10)
           | st.sampled_from(["nan", "inf", "-inf", "float64", "int8", "S3", "U2", "O", "V4",
                              "M8[s]", "f8,f8", "bfloat16", "cpu", "cuda:3", "xla:0", "AAAA",
                              "c16", "float32", "b1", "<f4", "U999999999"]))


def _tagged(kids):
    tag = st.sampled_from(TAGS)
    return st.builds(lambda t, v, extra: {t: v, **extra}, tag, kids,
                     st.dictionaries(st.sampled_from(["v", "meta"]), kids, max_size=1))


trees = st.recursive(scalars, lambda kids: st.lists(kids, max_size=3)
                     | st.dictionaries(st.text(max_size=5), kids, max_size=3)
                     | _tagged(kids), max_leaves=10)


def _lookup(i):
    if not 0 <= i < 2:
        raise CheckpointCorruptError(f"typed state refers to tensor {i} but only 2 exist")
    return torch.tensor([float(i)])


@FUZZ
@given(trees)
def test_hostile_typed_trees_give_only_corrupt_errors(node):
    for lookup in (_lookup, None):
        try:
            typed.decode(node, lookup)
        except CheckpointCorruptError:
            pass


@FUZZ
@given(st.sampled_from(TAGS[:-1]), scalars | st.lists(scalars, max_size=3))
def test_every_tag_with_any_payload_gives_only_corrupt_errors(tag, value):
    try:
        typed.decode({tag: value, "v": value}, _lookup)
    except CheckpointCorruptError:
        pass


def test_nesting_deeper_than_the_bound_is_refused_on_decode():
    node: Any = 0
    for _ in range(typed.MAX_DEPTH + 5):
        node = [node]
    with pytest.raises(CheckpointCorruptError, match=f"nesting deeper than {typed.MAX_DEPTH}"):
        typed.decode(node)


def _nest(depth, leaf):
    v = leaf
    for _ in range(depth):
        v = [v]
    return v


@pytest.mark.parametrize("leaf", [1.5, np.float64(2.5), argparse.Namespace(a=1), (1, 2),
                                  {"$k": 1}])
def test_whatever_encodes_decodes_at_any_depth(leaf):
    # Save refuses what load would refuse: the deepest tree that encodes also decodes.
    depth = 0
    while True:
        try:
            enc = typed.encode(_nest(depth + 1, leaf))
        except UnsupportedTypeError as e:
            assert f"nested deeper than {typed.MAX_DEPTH} levels" in str(e)
            break
        depth += 1
        assert depth <= typed.MAX_DEPTH + 1
    enc = typed.encode(_nest(depth, leaf))
    out = typed.decode(enc)
    for _ in range(depth):
        out = out[0]
    if isinstance(leaf, argparse.Namespace):
        assert vars(out) == vars(leaf)
    else:
        assert out == leaf and type(out) is type(leaf)


def test_specific_hostile_nodes():
    bad = [
        {"$float": []},                      # unhashable payload
        {"$complex": [10**400, 0]},          # overflows float
        {"$np": "float64", "v": 10**400},    # overflows the dtype
        {"$np": [["a", "f8"]]},              # structured dtype
        {"$np": {"names": 1}},               # malformed dtype spec
        {"$np": "U999999999999999", "v": "x"},
        {"$np_dtype": "O"},
        {"$np_dtype": [["a", "f8"], 3]},
        {"$torch_device": 10**30},
        {"$torch_device": "warp:9"},
        {"$torch_dtype": "Tensor"},
        {"$bytes": 12},
        {"$dict": [[[1], 2]]},               # unhashable key
        {"$set": [[1]]},
        {"$namespace": {"$dict": [[1, 2]]}},
        {"$tensor": True},
        {"$tensor": 7},
        {"$odict": "x"},
    ]
    for node in bad:
        with pytest.raises(CheckpointCorruptError):
            typed.decode(node, _lookup)


def test_decoded_floats_keep_nan_and_inf():
    out = typed.decode({"$tuple": [{"$float": "nan"}, {"$float": "-inf"}]})
    assert isinstance(out, tuple) and math.isnan(out[0]) and out[1] == -math.inf


@pytest.mark.parametrize("value", [np.datetime64("2024-01-01"), np.dtype(object),
                                   np.void(b"\x00\x01")])
def test_save_refuses_numpy_values_that_load_would_refuse(value):
    with pytest.raises(UnsupportedTypeError, match=r"state\['x'\]"):
        typed.encode({"x": value})
