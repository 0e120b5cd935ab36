"""A small real English corpus that ships with every Python: stdlib module docstrings.

Training pairs are (sentence, next sentence of the same docstring paragraph), the classic
"adjacent sentences are positives" set-up for contrastive sentence-embedding fine-tuning.
"""

from __future__ import annotations

import importlib
import re

# Modules with long, stable, well-written docstrings.
MODULES = ("argparse", "collections", "contextlib", "csv", "dataclasses", "decimal", "difflib",
           "email", "fractions", "functools", "heapq", "inspect", "json", "logging", "pickle",
           "random", "shutil", "string", "subprocess", "tarfile", "textwrap", "threading",
           "typing", "unittest", "uuid", "zipfile")

_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def sentences() -> list[list[str]]:
    """Paragraphs (lists of sentences, >= 2 each) from the docstrings of :data:`MODULES`."""
    paragraphs: list[list[str]] = []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # pragma: no cover - every module above is stdlib
            continue
        docs = [mod.__doc__ or ""]
        for attr in sorted(dir(mod)):
            obj = getattr(mod, attr, None)
            own = callable(obj) and getattr(obj, "__module__", "") == name
            if not attr.startswith("_") and own:
                docs.append(obj.__doc__ or "")
        for doc in docs:
            for para in re.split(r"\n\s*\n", doc):
                text = " ".join(para.split())
                sents = [s for s in _SPLIT.split(text) if 20 <= len(s) <= 300]
                if len(sents) >= 2:
                    paragraphs.append(sents)
    return paragraphs


def pairs(limit: int | None = None) -> list[tuple[str, str]]:
    """(anchor, positive) adjacent-sentence pairs, in a fixed order (deduplicated anchors)."""
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for para in sentences():
        for a, b in zip(para, para[1:], strict=False):
            if a not in seen:
                seen.add(a)
                out.append((a, b))
    return out[:limit] if limit else out
