"""An allow-list unpickler: ``pickle.Unpickler`` whose ``find_class`` knows a fixed set of names.

DCP writes two kinds of pickles that xla_ckpt has to read: the checkpoint's ``.metadata``
(``pickle.dump`` of a dozen dataclasses) and the ``data.pkl`` record inside each tensor
chunk's ``torch.save`` zip.  Both are read here with :class:`AllowListUnpickler`, never with
unrestricted :mod:`pickle`: every global the pickle names (``GLOBAL``, ``STACK_GLOBAL``,
``INST``, ``OBJ``, the ``EXT*`` registry codes; all of them go through ``find_class``) must be
in the unpickler's allow-list, and what the list gives back is never the real class but an
inert stand-in (:class:`Pickled`) or a small, side-effect-free function.  Anything else raises
:class:`~xla_ckpt.errors.UnsafePickleError` naming the global and the file *before* it is
looked up, so nothing the pickle names is imported or called.  Persistent ids are refused
unless the caller handles them (the ``data.pkl`` reader does, for tensor storages).
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Callable, Mapping

from xla_ckpt.errors import CheckpointCorruptError, UnsafePickleError


class Pickled:
    """An inert stand-in for an allow-listed class: records what the pickle gave it.

    ``NEWOBJ``/``REDUCE`` arguments land in :attr:`args`, the ``BUILD`` state in
    :attr:`state`; nothing else runs.  Hashed by identity (DCP pickles ``MetadataIndex``
    objects as dict keys).
    """

    pickled_name = "?"

    def __new__(cls, *args: Any) -> "Pickled":
        obj = object.__new__(cls)
        obj.args = args
        obj.state = None
        return obj

    def __init__(self, *args: Any) -> None:  # REDUCE calls cls(*args): __new__ kept them
        pass

    args: tuple[Any, ...]
    state: Any

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<pickled {self.pickled_name} args={self.args!r} state={self.state!r}>"


def stand_in(full_name: str) -> type[Pickled]:
    """A fresh :class:`Pickled` subclass standing in for the class named ``full_name``."""
    return type(full_name.rpartition(".")[2], (Pickled,), {"pickled_name": full_name})


class AllowListUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals in ``allowed``.

    Args:
        file: the pickle's bytes as a binary file.
        allowed: ``"module.name"`` -> the object ``find_class`` returns for it.
        where: the file (URI and record) for messages.
        what: what the allow-list is for, for messages ("DCP .metadata").
        persistent_load: called with each persistent id; None refuses them.
    """

    def __init__(self, file: Any, *, allowed: Mapping[str, Any],
                 where: str, what: str,
                 persistent_load: Callable[[Any], Any] | None = None) -> None:
        super().__init__(file)
        self._allowed = allowed
        self._where = where
        self._what = what
        self._persistent = persistent_load

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        try:
            return self._allowed[full]
        except (KeyError, TypeError):
            raise UnsafePickleError(
                f"{self._where}: refusing to unpickle global {full!r}: it is not one of the "
                f"classes a {self._what} holds (allow-list of xla_ckpt.format.dcp); nothing "
                "was imported or run. The file is hostile or not what it claims to be; if it "
                "comes from a trusted job, load it there with torch.distributed.checkpoint") \
                from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise CheckpointCorruptError(f"{self._where}: a {self._what} holds no persistent "
                                         f"ids, this one has {pid!r}")
        return self._persistent(pid)


class _Reader:
    """``read``/``readline`` over bytes, and no ``readinto``: the C unpickler then copies what
    ``read`` returns instead of exporting its own buffers (a hostile length then ends in a
    clean "truncated" error)."""

    def __init__(self, data: bytes) -> None:
        self._f = io.BytesIO(data)
        self.read = self._f.read
        self.readline = self._f.readline

    def tell(self) -> int:
        return self._f.tell()


def allow_list_loads(data: bytes, *, allowed: Mapping[str, Any], where: str, what: str,
                     persistent_load: Callable[[Any], Any] | None = None) -> Any:
    """Unpickle ``data`` with :class:`AllowListUnpickler`; one object.

    Raises:
        UnsafePickleError: a global outside ``allowed`` (names it and ``where``).
        CheckpointCorruptError: malformed bytes, or the allowed stand-ins got arguments they
            do not take.
    """
    f = _Reader(data)
    try:
        obj = AllowListUnpickler(f, allowed=allowed, where=where, what=what,
                                 persistent_load=persistent_load).load()
    except (UnsafePickleError, CheckpointCorruptError):
        raise
    except MemoryError:
        raise CheckpointCorruptError(f"{where}: the {what} declares more memory than this host "
                                     "has; it is malformed or hostile") from None
    except RecursionError:
        raise CheckpointCorruptError(f"{where}: the {what} nests too deeply") from None
    except Exception as e:  # noqa: BLE001 - any failure of a hostile pickle is "malformed"
        raise CheckpointCorruptError(f"{where}: malformed {what} ({type(e).__name__}: "
                                     f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if f.tell() != len(data):
        raise CheckpointCorruptError(f"{where}: {len(data) - f.tell()} bytes after the end of "
                                     f"the {what} pickle; the file is malformed")
    return obj
