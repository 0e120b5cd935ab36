"""The API table of docs/api.md names exactly what each package face exports (``__all__``)."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

API_PAGE = Path(__file__).resolve().parent.parent / "docs" / "api.md"
ROW = re.compile(r"^\| `(xla_ckpt(?:\.[a-z_]+)?)` \| (.*) \|$")


def _table() -> dict[str, set[str]]:
    rows = {}
    for line in API_PAGE.read_text().splitlines():
        m = ROW.match(line)
        if m:
            rows[m.group(1)] = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", m.group(2)))
    return rows


def test_every_package_face_has_all_and_the_api_page_names_exactly_it():
    table = _table()
    pkg = API_PAGE.parent.parent / "xla_ckpt"
    top = ["xla_ckpt"] + sorted(f"xla_ckpt.{p.parent.name}" for p in pkg.glob("*/__init__.py"))
    assert set(table) == set(top), f"docs/api.md API table rows {sorted(table)} vs packages {top}"
    for name in top:
        module = importlib.import_module(name)
        exported = getattr(module, "__all__", None)
        assert exported is not None, f"{name} has no __all__"
        assert table[name] == set(exported), (
            f"{name}: docs/api.md names {sorted(table[name] - set(exported))} not in __all__, "
            f"misses {sorted(set(exported) - table[name])}")
        for attr in exported:  # every listed name exists (submodules import on demand)
            assert hasattr(module, attr) or importlib.util.find_spec(f"{name}.{attr}"), \
                f"{name}.__all__ lists {attr!r}, which is not there"
