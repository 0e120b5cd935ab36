"""Tensors where the typed encoding holds only values are refused by name, with what to do instead.

Set and frozenset members, dict keys and an OrderedDict's ``_metadata`` are written inline as
values: a tensor there has no index or key to be stored by reference to its bytes.  Each refusal is
an UnsupportedTypeError (a TypeError) naming the key path, the container, the tensor's type, and
the fix; a save refused so leaves nothing behind.  Values outside the state (metadata) get the
plain "needs a tensor hook" refusal, which says what to pass instead.
"""

import os
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch

import xla_ckpt
from xla_ckpt.errors import UnsupportedTypeError, XlaCkptError
from xla_ckpt.format import typed
from xla_ckpt.testing.asserts import assert_state_identical

WHY_SET = ("a set is saved as a value, its members written inline (sorted; unordered in Python) "
           "with no index or key to refer to one by, so a tensor there cannot be stored as a "
           "reference to its bytes; ")
FIX_SET = ("store the tensors in a list or tuple instead (keep a set of their names beside it if "
           "membership is what matters)")
WHY_KEY = ("dict keys are saved as values, written inline (and a tensor hashes by identity, so a "
           "restored key would never match a live one), so a tensor there cannot be stored as a "
           "reference to its bytes; ")
FIX_KEY = ("key the dict by a name or an index and keep the tensor as the value, or store a list "
           "of (key, value) tuples")
T1 = "torch.Tensor of dtype float32 and shape [1]"


def refusal(state: Any, tmp_path) -> str:
    """The message xla_ckpt.save gives for ``state``; the folder is left empty."""
    folder = tmp_path / "ck"
    with pytest.raises(UnsupportedTypeError) as e:
        xla_ckpt.save(state, str(folder))
    assert isinstance(e.value, TypeError) and isinstance(e.value, XlaCkptError)
    assert not folder.exists() or os.listdir(folder) == []
    return str(e.value)


def test_tensor_in_a_set(tmp_path):
    assert refusal({"s": {torch.ones(1)}}, tmp_path) == (
        f"cannot save a tensor ({T1}) in the set at state['s']: {WHY_SET}{FIX_SET}")


def test_tensors_in_a_nested_frozenset_that_cannot_even_be_sorted(tmp_path):
    # Comparing two 2-element tensors raises RuntimeError ("Boolean value ... is ambiguous"):
    # that used to escape as a bare RuntimeError from the sort.
    state = {"opt": [{"groups": frozenset({torch.ones(2), torch.zeros(2)})}]}
    assert refusal(state, tmp_path) == (
        "cannot save a tensor (torch.Tensor of dtype float32 and shape [2]) in the frozenset at "
        f"state['opt'][0]['groups']: {WHY_SET}{FIX_SET}")


def test_tensor_inside_a_tuple_in_a_set_names_the_set(tmp_path):
    state = {"s": {("w", torch.zeros(3, dtype=torch.int64)), ("v", torch.ones(3))}}
    msg = refusal(state, tmp_path)
    assert msg.startswith("cannot save a tensor (torch.Tensor of dtype ")
    assert msg.endswith(f" in the set at state['s']: {WHY_SET}{FIX_SET}")


def test_parameter_in_a_set_names_its_type(tmp_path):
    p = torch.nn.Parameter(torch.ones(2, 2, dtype=torch.bfloat16))
    assert refusal({"params": {p}}, tmp_path).startswith(
        "cannot save a tensor (torch.nn.parameter.Parameter of dtype bfloat16 and shape [2, 2]) "
        "in the set at state['params']: ")


def test_tensor_as_a_dict_key(tmp_path):
    assert refusal({"d": {torch.ones(1): "x"}}, tmp_path) == (
        f"cannot save a tensor ({T1}) in a key of the dict at state['d']: {WHY_KEY}{FIX_KEY}")


def test_tensor_inside_a_tuple_key_and_an_ordered_dict_key(tmp_path):
    assert refusal({"d": {"ok": 1, ("k", torch.ones(1)): 2}}, tmp_path) == (
        f"cannot save a tensor ({T1}) in a key of the dict at state['d']: {WHY_KEY}{FIX_KEY}")
    od = OrderedDict([(torch.ones(1), 1)])
    assert refusal({"m": [od]}, tmp_path) == (
        f"cannot save a tensor ({T1}) in a key of the OrderedDict at state['m'][0]: "
        f"{WHY_KEY}{FIX_KEY}")


def test_tensor_or_array_in_state_dict_metadata(tmp_path):
    od: Any = OrderedDict([("w", torch.ones(1))])  # Any: the stubs know no _metadata attribute
    od._metadata = {"": {"version": torch.ones(1)}}
    assert refusal({"model": od}, tmp_path) == (
        f"cannot save a tensor ({T1}) in the _metadata of the OrderedDict at state['model']: "
        "a state_dict's _metadata is saved as a value, written inline, so a tensor there cannot "
        "be stored as a reference to its bytes; keep tensors out of it (it holds per-module "
        "version numbers)")
    od._metadata = {"": {"version": np.ones(2, dtype=np.float32)}}
    assert refusal({"model": od}, tmp_path).startswith(
        "cannot save a numpy array (numpy.ndarray of dtype float32 and shape [2]) in the "
        "_metadata of the OrderedDict at state['model']: ")


def test_the_same_refusals_with_any_tensor_hook():
    calls = []

    def hook(t, path):
        calls.append(path)
        return len(calls) - 1

    with pytest.raises(UnsupportedTypeError, match=r"^cannot save a tensor .* in the set at "
                                                   r"state\['a'\]\['b'\]: "):
        typed.encode({"a": {"b": {torch.ones(1)}}}, hook)
    assert calls == []  # the hook is never offered a tensor it could not reference


def test_values_with_no_hook_at_all_say_what_to_pass(tmp_path):
    with pytest.raises(UnsupportedTypeError) as e:
        typed.encode({"loss": torch.tensor([1.5])})
    assert str(e.value) == (
        f"tensor at state['loss'] needs a tensor hook: a {T1} cannot be stored in typed JSON "
        "alone (checkpoint metadata, control-plane messages hold no tensor bytes); pass a Python "
        "number or list instead (t.item(), t.tolist()), or save it in the state")
    with pytest.raises(UnsupportedTypeError) as e:  # inside a set too: the set is not the cause
        typed.encode({"s": {torch.ones(1)}})
    assert str(e.value).startswith(f"tensor at state['s'] needs a tensor hook: a {T1} cannot")
    with pytest.raises(UnsupportedTypeError) as e:
        typed.encode({"a": np.arange(3)})
    assert str(e.value) == (
        "numpy array of dtype int64 at state['a'] cannot be stored in typed JSON alone "
        "(checkpoint metadata, control-plane messages hold no array bytes); pass a list instead "
        "(a.tolist()), or save it in the state")
    folder = tmp_path / "ck"
    with pytest.raises(UnsupportedTypeError, match=r"^tensor at state\['loss'\] needs a tensor "
                                                   r"hook: .* pass a Python number"):
        xla_ckpt.save({"w": torch.ones(1)}, str(folder), metadata={"loss": torch.tensor(1.5)})
    assert not folder.exists() or os.listdir(folder) == []


def test_what_the_messages_suggest_saves_and_sets_of_values_still_round_trip(tmp_path):
    state = {
        "tensors": [torch.ones(1), torch.zeros(2)], "pairs": [(torch.ones(1), "x")],
        "names": {"a", "b"}, "frozen": frozenset({1, 2.5}), "mixed": {1, "a", (2, "b")},
        "keys": {("k", 1): torch.ones(1), 3: torch.zeros(1)},
    }
    uri = str(tmp_path / "ok")
    xla_ckpt.save(state, uri)
    assert_state_identical(xla_ckpt.load(uri), state)
