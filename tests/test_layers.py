"""The package's imports point one way, and no module outgrows a screenful of concepts.

Layer order of ``xla_ckpt/`` (bottom -> top); a room may import only rooms *below* it in
this list, never a room above or beside it on the same line unless that pair is listed in
``_SIDE_BY_SIDE``:

 1. ``errors``                  -- exception types
 2. ``checks``                  -- config value checks (each raises ConfigError)
 3. ``format``                  -- bytes <-> tensors, the manifest, crc32c, legacy ``.pt`` parsing
 4. ``storage``                 -- backends (local, GCS), URIs, retries, deadlines
 5. ``testing``                 -- GCS emulator, fault proxy, launcher (tests and the demo only)
 6. ``comm``                    -- ranks, hosts, collectives, host shared memory; ``DistConfig``
 7. ``io``                      -- the format engine: reader, chunk reads, writer, verify
 8. ``sharded``                 -- live sharded values (DTensor, SPMD, plain) as boxes
 9. ``run``                     -- the run folder: catalog, resolve, fencing, retention, prune
10. ``kinds``                   -- other kinds of checkpoint, conversion (legacy, HF, DCP, export)
11. ``restore``                 -- the restore engine and its plans; save by owners
12. ``api``                     -- ``xla_ckpt.load`` / ``xla_ckpt.save``
13. ``manager``, ``trainer``    -- the checkpoint manager; fairseq-semantics trainer restore/save
14. ``config``                  -- YAML composition of every component's config
15. ``demo``, ``cli``           -- the main job; the command line

Every import counts: module level, inside functions, and under ``TYPE_CHECKING``, because
each is a dependency a reader has to hold in mind.  Two checks: no circle between files
(a strongly connected component of more than one module), and no import from a lower room
to a higher one (which is what makes a circle between rooms impossible).  The package's
own ``__init__`` is the top: it may name anything (lazily).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "xla_ckpt"

LAYERS: list[tuple[str, ...]] = [
    ("errors",),
    ("checks",),
    ("format",),
    ("storage",),
    ("testing",),
    ("comm",),
    ("io",),
    ("sharded",),
    ("run",),
    ("kinds",),
    ("restore",),
    ("api",),
    ("manager", "trainer"),
    ("config",),
    ("demo", "cli"),
]
_SIDE_BY_SIDE = {("trainer", "manager"), ("cli", "demo")}  # (importer, imported) on one line
MAX_MODULE_LINES = 800


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The xla_ckpt modules ``name`` imports, anywhere in the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            # a module's import of its own package (or an ancestor) runs that __init__ first;
            # that is the language's doing, not a dependency, so it is not counted
            if target.startswith("xla_ckpt") and target != name and \
                    not name.startswith(target + "."):
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "xla_ckpt"


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle() -> None:
    # the check below is only as good as this: a made-up graph with one circle of three
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert _circles(graph) == [["a", "b", "c"]]


def test_no_circle_between_files() -> None:
    circles = _circles(_graph())
    assert circles == [], "import circles between files: " + "; ".join(
        " <-> ".join(c) for c in circles)


def test_every_room_is_in_the_layer_list() -> None:
    rooms = {_room(m) for m in _modules()} - {"xla_ckpt"}
    listed = {room for line in LAYERS for room in line}
    assert rooms == listed, (f"rooms not in LAYERS: {sorted(rooms - listed)}; "
                             f"listed but gone: {sorted(listed - rooms)}")


def test_imports_point_down_the_layers() -> None:
    level = {room: i for i, line in enumerate(LAYERS) for room in line}
    upward: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, targets in _graph().items():
        src = _room(module)
        if src == "xla_ckpt":
            continue  # the package's own __init__: the top
        for target in targets:
            dst = _room(target)
            if dst in (src, "xla_ckpt") or (src, dst) in _SIDE_BY_SIDE:
                continue
            if level[dst] >= level[src]:
                upward[(src, dst)].append(f"{module} -> {target}")
    assert not upward, "imports that point up (or sideways) the layers: " + "; ".join(
        f"{src} -> {dst}: {', '.join(sorted(v)[:3])}" for (src, dst), v in sorted(upward.items()))


@pytest.mark.parametrize("limit", [MAX_MODULE_LINES])
def test_no_module_over_the_limit(limit: int) -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    over = {name: n for name, n in sizes.items() if n > limit}
    assert not over, f"modules over {limit} lines: {over}"
