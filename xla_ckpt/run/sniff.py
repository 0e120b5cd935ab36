"""What kind of checkpoint a name, or the first bytes of one object, is.

The kinds every entry point accepts (:func:`xla_ckpt.run.resolve.resolve`), told apart by
name (a run folder listing) or by sniffing at most 16 bytes (a single object); and what a
conversion's destination already holds (:func:`destination_holds`).  Torch-free to import
(the CLI's ``ls``/``inspect`` start without torch): :func:`is_legacy_file` loads the sniffer
on first use.
"""

from __future__ import annotations

import os

from xla_ckpt.errors import CheckpointCorruptError, CheckpointNotFoundError
from xla_ckpt.format.manifest import MANIFEST_NAME
from xla_ckpt.io.names import INDEX_NAME, SINGLE_NAME
from xla_ckpt.storage import StorageConfig, open_storage, parse_uri
from xla_ckpt.storage.uri import split_uri

XLA_CKPT = "xla_ckpt"
""":attr:`~xla_ckpt.run.resolve.Resolved.kind` of an xla_ckpt checkpoint folder."""
LEGACY = "legacy"
""":attr:`~xla_ckpt.run.resolve.Resolved.kind` of a legacy ``.pt``/safetensors file."""
HF_INDEX = "hf_index"
""":attr:`~xla_ckpt.run.resolve.Resolved.kind` of a sharded HF safetensors checkpoint
(``checkpoint``: its index)."""
DCP = "dcp"
""":attr:`~xla_ckpt.run.resolve.Resolved.kind` of a PyTorch DCP checkpoint folder
(``checkpoint``: the folder)."""

KINDS = {XLA_CKPT: "an xla_ckpt checkpoint folder",
         LEGACY: "a legacy torch.save/fairseq .pt or safetensors file",
         HF_INDEX: "a sharded HF safetensors checkpoint (model.safetensors.index.json)",
         DCP: "a PyTorch DCP checkpoint folder (.metadata)"}
"""What each :attr:`~xla_ckpt.run.resolve.Resolved.kind` is, in words (for messages)."""

ACCEPTED = ("an xla_ckpt checkpoint folder (manifest.json), a run folder of them, a legacy "
            "torch.save/fairseq .pt, an HF model.safetensors or model.safetensors.index.json "
            "(or a folder holding one), or a PyTorch DCP checkpoint folder (.metadata)")
"""The kinds of source :func:`xla_ckpt.run.resolve.resolve` accepts, for "none of these"
errors."""

DCP_METADATA = ".metadata"
"""The commit marker of a DCP checkpoint (written last by ``dcp.save``)."""

_LEGACY_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt")


def foreign_checkpoints(names: list[str]) -> list[tuple[str, str]]:
    """``(name, kind in words)`` of the checkpoints of other kinds a run folder listing shows.

    ``names`` is a recursive listing (:meth:`xla_ckpt.storage.Storage.list`).  Found by name
    only: legacy files at the top (``checkpoint_last.pt``, ``*.safetensors``, ...), and
    sub-folders holding a DCP ``.metadata``, a safetensors index or ``model.safetensors``.
    """

    found: dict[str, str] = {}
    for n in names:
        parts = n.split("/")
        if len(parts) == 1 and n.endswith(_LEGACY_SUFFIXES):
            found[n] = KINDS[LEGACY]
        elif len(parts) == 2 and parts[1] == DCP_METADATA:
            found[parts[0]] = KINDS[DCP]
        elif len(parts) == 2 and parts[1] in (INDEX_NAME, SINGLE_NAME):
            found.setdefault(parts[0], "an HF model folder")
    return sorted(found.items())


def is_legacy_file(uri: str, *, config: StorageConfig | None = None) -> bool:
    """True if ``uri`` names one object that is a torch.save/fairseq ``.pt`` or safetensors file.

    An xla_ckpt checkpoint is a folder, so a URI naming one object is never one.
    Reads at most 16 bytes.
    """
    from xla_ckpt.format.legacy.kinds import sniff_format  # noqa: PLC0415 - imports torch; CLI start-up stays torch-free

    try:
        folder, name = split_uri(uri)
    except CheckpointNotFoundError:
        return False
    local = parse_uri(uri)
    if local.is_local and not os.path.isfile(os.path.abspath(os.path.expanduser(local.path))):
        return False
    storage = open_storage(folder, config)
    try:
        info = storage.stat(name)
        prefix = bytearray(min(16, info.size))
        if prefix:
            storage.read_range(name, 0, memoryview(prefix), info.generation)
        sniff_format(bytes(prefix), where=uri, size=info.size)
        return True
    except (CheckpointNotFoundError, CheckpointCorruptError):
        return False
    finally:
        storage.close()


OUTPUT_KINDS = {"xla_ckpt": "a committed xla_ckpt checkpoint (manifest.json)",
                "dcp": "a PyTorch DCP checkpoint (.metadata)",
                "hf": "HF safetensors weights",
                "file": "a file",
                "run": "a run folder of checkpoints"}
"""What :func:`destination_holds` finds at a destination, in words."""


def destination_holds(dst: str, config: StorageConfig | None = None
                      ) -> tuple[str, str] | None:
    """``(kind, description)`` of the checkpoint or output already at ``dst``; None if none.

    Kinds (:data:`OUTPUT_KINDS`): ``"file"`` (``dst`` is one object), ``"xla_ckpt"``
    (``manifest.json`` at its top), ``"dcp"`` (``.metadata``), ``"hf"`` (``*.safetensors``
    or ``model.safetensors.index.json`` at its top), ``"run"`` (sub-folders holding a
    checkpoint of any kind, or ``.pt``/``.bin``/... files at its top).  Other objects
    (a ``config.json``, logs) do not count.
    """
    if parse_uri(dst).is_local:
        path = os.path.abspath(os.path.expanduser(parse_uri(dst).path))
        if os.path.isfile(path):
            return "file", f"a file ({path})"
        if not os.path.isdir(path):
            return None
    with open_storage(dst, config) as st:
        names = st.list("")
        if names == [""]:
            return "file", f"an object ({st.uri})"
        top = [n for n in names if "/" not in n]
        if MANIFEST_NAME in top:
            return "xla_ckpt", OUTPUT_KINDS["xla_ckpt"]
        if DCP_METADATA in top:
            return "dcp", OUTPUT_KINDS["dcp"]
        hf = [n for n in top if n == INDEX_NAME or n.endswith(".safetensors")]
        if hf:
            more = ", ..." if len(hf) > 3 else ""
            return "hf", f"{OUTPUT_KINDS['hf']} ({', '.join(hf[:3])}{more})"
        subs = sorted({n.split("/", 1)[0] for n in names
                       if n.count("/") == 1 and n.split("/", 1)[1] == MANIFEST_NAME})
        found = [n for n, _ in foreign_checkpoints(names)] + subs
        if found:
            shown = ", ".join(sorted(found)[:3]) + (", ..." if len(found) > 3 else "")
            return "run", f"{OUTPUT_KINDS['run']} ({shown})"
    return None
