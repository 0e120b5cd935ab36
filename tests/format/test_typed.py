"""Typed encoding of non-tensor state: exact round trips through JSON text, and clear refusals."""

import argparse
import json
import math
from collections import OrderedDict, namedtuple
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xla_ckpt.errors import CheckpointCorruptError, UnsupportedTypeError
from xla_ckpt.format import typed
from xla_ckpt.testing.asserts import assert_state_identical


def through_json(obj):
    """encode -> JSON text -> parse -> decode, the path a manifest takes."""
    text = json.dumps(typed.encode(obj), allow_nan=False)
    return typed.decode(json.loads(text))


def test_every_supported_type_round_trips_with_its_exact_type():
    od: Any = OrderedDict([("b", 1), ("a", 2)])  # Any: the stubs know no _metadata attribute
    od._metadata = OrderedDict([("", {"version": 1})])  # as on a module's state_dict()
    state = {
        "tuple": (1, 2.0, "x"), "list": [1, 2.0, "x"], "nested": ((), [()], ([],)),
        "int": 3, "float": 3.0, "big": 2**100, "neg": -7, "bool": True, "false": False,
        "none": None, "str": "ünïcödé ✓", "empty": "",
        "nan": math.nan, "inf": math.inf, "-inf": -math.inf, "-0.0": -0.0,
        "int_keys": {0: {"step": 3}, 1: {}}, "mixed_keys": {1: "a", "1": "b", (1, 2): "c",
                                                           None: "d", 2.5: "e", False: "f"},
        "dollar_keys": {"$tensor": 1, "$tuple": [1]},
        "ordered": od,
        "ns": argparse.Namespace(lr=[0.1], betas=(0.9, 0.98), sub=argparse.Namespace(a=1)),
        "np": [np.float16(1.5), np.float32(0.1), np.float64(0.1), np.int8(-3), np.int16(3),
               np.int32(-3), np.int64(2**62), np.uint8(255), np.uint16(3), np.uint32(3),
               np.uint64(2**64 - 1), np.bool_(True), np.complex64(1 + 2j), np.float64("nan")],
        "np_dtype": np.dtype("float32"), "torch_dtype": torch.bfloat16,
        "device": torch.device("xla", 3), "bytes": b"\x00\xffab", "set": {3, 1, 2},
        "frozenset": frozenset({"a"}), "complex": complex(1.5, -2),
    }
    assert_state_identical(through_json(state), state)


def test_int_vs_float_and_tuple_vs_list_survive():
    got = through_json({"betas": (0.9, 0.98), "lr": [1, 1.0], "step": 1})
    assert type(got["betas"]) is tuple and type(got["lr"]) is list
    assert [type(v) for v in got["lr"]] == [int, float] and type(got["step"]) is int


def test_encoding_is_human_readable_json():
    enc = typed.encode({"lr": 0.5, "betas": (0.9, 0.98), "args": argparse.Namespace(seed=1),
                        "state": {0: {"step": np.int64(3)}}})
    assert enc == {"lr": 0.5, "betas": {"$tuple": [0.9, 0.98]},
                   "args": {"$namespace": {"seed": 1}},
                   "state": {"$dict": [[0, {"step": {"$np": "int64", "v": 3}}]]}}


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8),
    st.binary(max_size=8), st.builds(np.float64, st.floats(allow_nan=False)),
    st.builds(np.int64, st.integers(-2**63, 2**63 - 1)), st.builds(np.float32, st.floats(
        allow_nan=False, width=32)))
keys = st.one_of(st.text(max_size=6), st.integers(-5, 5))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.tuples(inner, inner),
    st.dictionaries(keys, inner, max_size=4),
    st.builds(lambda d: argparse.Namespace(**d),
              st.dictionaries(st.from_regex(r"[a-z]{1,5}", fullmatch=True), inner, max_size=3))),
    max_leaves=20)


@settings(max_examples=150, deadline=None)
@given(values)
def test_any_nested_state_round_trips_exactly(obj):
    assert_state_identical(through_json(obj), obj)


class Opaque:
    pass


P = namedtuple("P", "x y")


@pytest.mark.parametrize("obj, message", [
    ({"a": [Opaque()]}, "cannot save value of type test_typed.Opaque at state['a'][0]"),
    ({"nt": P(1, 2)}, "namedtuple P at state['nt']: convert it to a dict"),
    ({"arr": np.array(["a"], dtype=object)}, "numpy array of dtype object at state['arr']"),
    ({"t": torch.ones(1)}, "tensor at state['t'] needs a tensor hook"),
])
def test_unsupported_values_are_refused_naming_the_key(obj, message):
    with pytest.raises(UnsupportedTypeError) as e:
        typed.encode(obj)
    assert str(e.value).startswith(message)


def test_reference_cycle_is_refused():
    a: list = []
    a.append(a)
    with pytest.raises(UnsupportedTypeError, match=r"reference cycle at state\[0\]"):
        typed.encode(a)


def test_shared_subobjects_are_not_cycles():
    shared = {"x": 1}
    assert through_json({"a": shared, "b": shared}) == {"a": {"x": 1}, "b": {"x": 1}}


@pytest.mark.parametrize("node, message", [
    ({"$nope": 1}, "unknown tag '$nope'"),
    ({"$float": "NaN!"}, "$float 'NaN!'"),
    ({"$np": "object", "v": 1}, "numpy dtype 'object' not allowed"),
    ({"$np_dtype": "O"}, "object numpy dtype not allowed"),
    ({"$tuple": 1}, "$tuple needs a list"),
    ({"$dict": [[1]]}, "dict items must be a list of [key, value] pairs"),
    ({"$dict": [[[1], 2]]}, "unhashable dict key [1]"),
    ({"$namespace": {"$dict": [[1, 2]]}}, "$namespace needs a dict with str keys"),
    ({"$bytes": "***"}, "bad base64 in $bytes"),
    ({"$torch_dtype": "os.system"}, "unknown torch dtype 'os.system' in checkpoint"),
    ({"$tensor": "0"}, "$tensor needs an integer index"),
    ({"$complex": [1]}, "$complex needs [re, im]"),
])
def test_malformed_typed_state_is_a_corrupt_checkpoint(node, message):
    with pytest.raises(CheckpointCorruptError) as e:
        typed.decode(node)
    assert str(e.value) == f"malformed typed state: {message}"


def test_nesting_depth_is_bounded():
    node: object = 1
    for _ in range(typed.MAX_DEPTH + 2):
        node = [node]
    with pytest.raises(CheckpointCorruptError, match=f"nesting deeper than {typed.MAX_DEPTH}"):
        typed.decode(node)
