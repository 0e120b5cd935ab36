"""Exact comparison of nested states: types, values and tensor bits.

``assert_state_identical(actual, expected)`` fails with the key path of the
first difference.  Tensors must agree in dtype, shape and every bit (NaNs
included); ``device`` is compared by type when ``check_device`` is true.
Containers must have exactly the same type (tuple vs list, OrderedDict vs
dict, numpy scalar vs Python number).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import numpy as np
import torch


def tensor_bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (on CPU, contiguous) as a uint8 tensor."""
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    flat = t.reshape(-1)
    return flat.to(torch.uint8) if t.dtype == torch.bool else flat.view(torch.uint8)


def tensors_identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits."""
    return (a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
            and torch.equal(tensor_bits(a), tensor_bits(b)))


def assert_state_identical(actual: Any, expected: Any, path: str = "state", *,
                           check_device: bool = False) -> None:
    """Raise AssertionError naming the first path where ``actual`` differs from ``expected``."""
    if type(actual) is not type(expected):
        raise AssertionError(f"{path}: type {type(actual).__name__} != {type(expected).__name__}")
    if isinstance(expected, torch.Tensor):
        if check_device and actual.device.type != expected.device.type:
            raise AssertionError(f"{path}: device {actual.device} != {expected.device}")
        if actual.dtype != expected.dtype or tuple(actual.shape) != tuple(expected.shape):
            raise AssertionError(f"{path}: {actual.dtype}{list(actual.shape)} != "
                                 f"{expected.dtype}{list(expected.shape)}")
        if not torch.equal(tensor_bits(actual), tensor_bits(expected)):
            raise AssertionError(f"{path}: tensor bits differ")
        return
    if isinstance(expected, dict):
        if list(actual.keys()) != list(expected.keys()):
            raise AssertionError(f"{path}: keys {list(actual)[:8]} != {list(expected)[:8]}")
        for k in expected:
            assert_state_identical(actual[k], expected[k], f"{path}[{k!r}]",
                                   check_device=check_device)
        meta_a, meta_e = getattr(actual, "_metadata", None), getattr(expected, "_metadata", None)
        if meta_a != meta_e:
            raise AssertionError(f"{path}._metadata differs")
        return
    if isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            raise AssertionError(f"{path}: length {len(actual)} != {len(expected)}")
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_state_identical(a, e, f"{path}[{i}]", check_device=check_device)
        return
    if isinstance(expected, argparse.Namespace):
        assert_state_identical(vars(actual), vars(expected), f"{path}.vars",
                               check_device=check_device)
        return
    if isinstance(expected, np.generic):
        if actual.dtype != expected.dtype or actual.tobytes() != expected.tobytes():
            raise AssertionError(f"{path}: {actual!r} != {expected!r}")
        return
    if isinstance(expected, float):
        same = math.isnan(actual) if math.isnan(expected) else actual.hex() == expected.hex()
        if not same:
            raise AssertionError(f"{path}: {actual!r} != {expected!r}")
        return
    if actual != expected:
        raise AssertionError(f"{path}: {actual!r} != {expected!r}")
