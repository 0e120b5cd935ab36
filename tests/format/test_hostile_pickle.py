"""Hostile legacy files: pickles that try to run code, allocation bombs, malformed archives.

Each one ends in the library's error naming what is wrong, with memory
bounded and no trace left: the marker file a payload would create never
exists.  Payloads are built as real ``torch.save`` files (zip and pre-1.6
formats), or as raw pickle bytes for opcodes ``torch.save`` never writes.
"""

import io
import json
import os
import pickle
import struct
import subprocess
import warnings
import zipfile
from typing import Any

import pytest
import torch

from xla_ckpt.errors import CheckpointCorruptError, MetaTensorError, UnsafePickleError
from xla_ckpt.format.legacy import load_legacy


class RunCommand:
    """Unpickling this runs ``os.system(cmd)`` (what a malicious checkpoint does)."""

    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return os.system, (self.cmd,)


class PopenCommand:
    def __init__(self, argv):
        self.argv = argv

    def __reduce__(self):
        return subprocess.Popen, (self.argv,)


class EvalCode:
    def __init__(self, code):
        self.code = code

    def __reduce__(self):
        return eval, (self.code,)


def _save(obj, zip_format=True) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=zip_format)
    return buf.getvalue()


def zip_with_pickle(pkl: bytes, *, template=None, compress=False, duplicate=False) -> bytes:
    """A torch zip archive whose data.pkl is ``pkl`` (other records from ``template``)."""
    src = zipfile.ZipFile(io.BytesIO(template or _save({})))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            data = pkl if info.filename.endswith("/data.pkl") else src.read(info.filename)
            z.writestr(info.filename, data)
            if duplicate and info.filename.endswith("/data.pkl"):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # "Duplicate name": the point
                    z.writestr(info.filename, _pickle_of({"other": 2}))
    return out.getvalue()


def legacy_with_pickle(pkl: bytes) -> bytes:
    """A pre-1.6 torch file whose main pickle is ``pkl`` (magic, version, sys_info kept)."""
    good = _save({}, zip_format=False)
    f = io.BytesIO(good)
    for _ in range(3):
        pickle.load(f)
    return good[:f.tell()] + pkl + pickle.dumps([], protocol=2)


def _marker(tmp_path):
    return tmp_path / "pwned"


# ---- pickles that try to run code ---------------------------------------------------------


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "pre-1.6"])
@pytest.mark.parametrize("make,name", [
    (lambda m: RunCommand(f"touch {m}"), "posix.system"),
    (lambda m: PopenCommand(["touch", str(m)]), "subprocess.Popen"),
    (lambda m: EvalCode(f"open({str(m)!r}, 'w').close()"), "builtins.eval"),
], ids=["os.system", "Popen", "eval"])
def test_code_running_pickle_is_refused_naming_the_global_and_leaves_no_trace(
        tmp_path, zip_format, make, name):
    marker = _marker(tmp_path)
    data = _save({"model": {"w": torch.ones(2)}, "payload": make(marker)}, zip_format=zip_format)
    with pytest.raises(UnsafePickleError) as err:
        load_legacy(data, where="evil.pt")
    assert f"refusing to unpickle global {name}:" in str(err.value)
    assert str(err.value).startswith("evil.pt: ")
    assert not marker.exists()


def test_every_unsafe_global_is_named_at_once(tmp_path):
    marker = _marker(tmp_path)
    data = _save({"a": RunCommand(f"touch {marker}"), "b": EvalCode("1")})
    with pytest.raises(UnsafePickleError, match=r"globals builtins.eval, posix.system:"):
        load_legacy(data, where="evil.pt")
    assert not marker.exists()


def _unicode(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _inst(cmd):  # protocol-0 style INST: calls os.system(cmd) in a plain unpickler
    return b"\x80\x02(" + _unicode(cmd) + b"ios\nsystem\n."


def _stack_global(cmd):  # protocol-4 STACK_GLOBAL: the callable's name comes from the stack
    return b"\x80\x04" + _unicode("os") + _unicode("system") + b"\x93" + _unicode(cmd) + b"\x85R."


def _obj(_cmd):  # OBJ: instantiates a class pushed on the stack
    return b"\x80\x02(c__builtin__\nobject\no."


@pytest.mark.parametrize("make,what", [(_inst, "INST os.system"), (_stack_global, "STACK_GLOBAL"),
                                       (_obj, "OBJ")], ids=["INST", "STACK_GLOBAL", "OBJ"])
@pytest.mark.parametrize("wrap", [zip_with_pickle, legacy_with_pickle], ids=["zip", "pre-1.6"])
def test_opcodes_that_call_code_without_a_named_global_are_refused(tmp_path, make, what, wrap):
    marker = _marker(tmp_path)
    pkl = make(f"touch {marker}")
    if make is not _obj:  # the payload is live: plain pickle runs it (on a control marker)
        control = tmp_path / "control"
        pickle.loads(make(f"touch {control}"))
        assert control.exists()
    with pytest.raises(UnsafePickleError, match=f"opcodes that can run code \\({what}"):
        load_legacy(wrap(pkl), where="evil.pt")
    assert not marker.exists()


def test_omegaconf_dictconfig_is_refused_with_a_hint():
    pkl = b"\x80\x02comegaconf.dictconfig\nDictConfig\n)\x81}b."
    with pytest.raises(UnsafePickleError) as err:
        load_legacy(zip_with_pickle(pkl), where="fairseq-0.10.pt")
    msg = str(err.value)
    assert "omegaconf.dictconfig.DictConfig" in msg and "OmegaConf.to_container" in msg


# ---- allocation bombs and malformed archives ---------------------------------------------


def test_bytearray_bomb_is_refused_before_allocating():
    pkl = b"\x80\x02c__builtin__\nbytearray\nJ\x00\x00\x00\x40\x85R."  # bytearray(1 GiB)
    with pytest.raises(UnsafePickleError, match="builtins.bytearray"):
        load_legacy(zip_with_pickle(pkl), where="bomb.pt")


def test_storage_claiming_more_bytes_than_the_file_holds_is_refused():
    template = _save({"w": torch.arange(4.0)})
    name = next(n for n in zipfile.ZipFile(io.BytesIO(template)).namelist()
                if n.endswith("/data.pkl"))
    pkl = zipfile.ZipFile(io.BytesIO(template)).read(name)
    i = pkl.index(b"K\x04", pkl.index(b"cpu"))  # numel of the storage: 4 -> 2**31 - 1
    bad = pkl[:i] + b"J" + struct.pack("<i", 2**31 - 1) + pkl[i + 2:]
    data = zip_with_pickle(bad, template=template)
    with pytest.raises(CheckpointCorruptError, match=r"tensors claim 8589934588 bytes of storage "
                                                     r"but the file holds only \d+ bytes"):
        load_legacy(data, where="bomb.pt")


def test_zip_declaring_more_bytes_than_it_holds_is_refused():
    data = zip_with_pickle(b"\x80\x02}." + b"\x00" * (8 * 2**20), compress=True)
    assert len(data) < 2**20
    with pytest.raises(CheckpointCorruptError, match="uncompressed bytes in a .*torch.save never "
                                                     "compresses"):
        load_legacy(data, where="zipbomb.pt")


def test_zip_with_a_duplicated_entry_is_refused():
    data = zip_with_pickle(_pickle_of({"x": 1}), duplicate=True)
    with pytest.raises(CheckpointCorruptError, match="appears more than once"):
        load_legacy(data, where="dup.pt")


def _pickle_of(obj) -> bytes:
    return pickle.dumps(obj, protocol=2)


def test_torchscript_archive_is_refused(tmp_path):
    m = torch.jit.script(torch.nn.Linear(2, 2))
    path = tmp_path / "ts.pt"
    torch.jit.save(m, str(path))
    with pytest.raises(CheckpointCorruptError, match="TorchScript archive"):
        load_legacy(path.read_bytes(), where="ts.pt")


@pytest.mark.parametrize("cut", [0, 1, 100, 0.5, -1])
def test_truncated_file_gives_a_corrupt_error(cut):
    data = _save({"model": {"w": torch.randn(64)}})
    n = int(len(data) * cut) if isinstance(cut, float) else (cut if cut >= 0 else len(data) - 1)
    with pytest.raises(CheckpointCorruptError, match="^cut.pt: "):
        load_legacy(data[:n], where="cut.pt")


def test_malformed_pickle_gives_a_corrupt_error():
    with pytest.raises(CheckpointCorruptError, match="malformed pickle"):
        load_legacy(zip_with_pickle(b"\x80\x02}q\x00(X\xff\xff"), where="bad.pt")


@pytest.mark.timeout(60)
def test_shared_list_expansion_is_refused_quickly():
    x: list[Any] = [0]
    for _ in range(64):  # 2**64 leaves when walked; a few hundred bytes on disk
        x = [x, x]
    data = _save({"x": x})
    assert len(data) < 4096
    with pytest.raises(CheckpointCorruptError, match="expands on load"):
        load_legacy(data, where="laughs.pt")


def test_reference_cycle_is_refused():
    cyc: list[Any] = []
    cyc.append(cyc)
    with pytest.raises(CheckpointCorruptError, match=r"reference cycle at state\['c'\]\[0\]"):
        load_legacy(_save({"c": cyc}), where="cyc.pt")


def test_deep_nesting_is_refused():
    deep: Any = 0
    for _ in range(200):
        deep = [deep]
    with pytest.raises(CheckpointCorruptError, match="nesting deeper than 128"):
        load_legacy(_save({"d": deep}), where="deep.pt")


def test_meta_tensor_is_refused_naming_its_key():
    data = _save({"model": {"w": torch.empty(3, device="meta")}})
    with pytest.raises(MetaTensorError, match=r"tensor at state\['model'\]\['w'\] is on the meta"):
        load_legacy(data, where="meta.pt")


def test_huge_expanded_view_is_refused():
    data = _save({"w": torch.zeros(1).expand(2**25)})  # 128 MiB view of a 4-byte storage
    assert len(data) < 4096
    with pytest.raises(CheckpointCorruptError, match=r"tensor at state\['w'\] is a view of "
                                                     r"134217728 bytes over a 4-byte storage"):
        load_legacy(data, where="view.pt")


# ---- hostile safetensors files -----------------------------------------------------------


def _st(header: dict, body: bytes = b"", length: int | None = None) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h) if length is None else length) + h + body


@pytest.mark.parametrize("data,match", [
    (_st({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, 2**60),
     "header length 1152921504606846976 is impossible"),
    (_st({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
     "malformed safetensors"),
    (_st({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
     "malformed safetensors"),
    (_st({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),
     "malformed safetensors"),
    (_st({"w": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
     "malformed safetensors"),
    (_st({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})[:-1] + b"\0" * 8,
     "not valid JSON"),
], ids=["absurd-header-length", "beyond-end", "shape-vs-bytes", "overlap", "unknown-dtype",
        "bad-json"])
def test_hostile_safetensors_give_corrupt_errors(data, match):
    with pytest.raises(CheckpointCorruptError, match=match):
        load_legacy(data, where="evil.safetensors")


def test_not_a_legacy_file():
    with pytest.raises(CheckpointCorruptError, match="not a torch.save/fairseq .pt file or a "
                                                     "safetensors file"):
        load_legacy(b"GIF89a not a checkpoint", where="x.gif")
