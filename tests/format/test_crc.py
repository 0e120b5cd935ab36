"""crc32c: the zero-copy native path equals google-crc32c's own value; combine is exact."""

import os

import google_crc32c
import numpy as np
import pytest
import torch

from xla_ckpt.format.crc import crc32c, crc32c_combine, native


def test_native_path_is_in_use():
    assert native() is True  # the google-crc32c wheel ships libcrc32c; a copy-free path exists


@pytest.mark.parametrize("n", [0, 1, 7, 4096, 1 << 20])
def test_every_buffer_kind_gives_google_crc32c_value(n):
    data = os.urandom(n)
    want = google_crc32c.value(data)
    arr = np.frombuffer(data, dtype=np.uint8).copy()
    view = memoryview(arr)  # type: ignore[arg-type]  # numpy stubs: __buffer__ on py>=3.12 only
    assert crc32c(data) == want
    assert crc32c(view) == want
    assert crc32c(view.toreadonly()) == want
    assert crc32c(torch.from_numpy(arr)) == want
    assert crc32c(bytearray(data)) == want


def test_extend_and_combine_agree_with_the_whole():
    data = os.urandom(100_003)
    for cut in (0, 1, 4096, 50_000, 100_002, 100_003):
        a, b = data[:cut], data[cut:]
        assert crc32c(b, crc32c(a)) == google_crc32c.value(data)
        assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == google_crc32c.value(data)


def test_non_contiguous_tensor_is_refused():
    t = torch.arange(16, dtype=torch.uint8).view(4, 4).t()
    with pytest.raises(ValueError, match="contiguous"):
        crc32c(t)
