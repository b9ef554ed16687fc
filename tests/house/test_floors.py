"""The house's rules, checked on the source: every import points down a floor, no circles, small files.

Floors (ARCHITECTURE.md): 1 cmd, cli; 2 daemon (with config, its settings), demo; 3 engine, sinks,
training; 4 contract; 5 ops, errors. A module may import its own floor or any floor below, never one above.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "stagerd"

FLOOR = {
    "cmd": 1, "cli": 1, "__init__": 1,
    "daemon": 2, "demo": 2, "config": 2,
    "engine": 3, "sinks": 3, "training": 3, "integrations": 3, "stage": 3,
    "contract": 4,
    "ops": 5, "errors": 5,
}  # fmt: skip
MAX_LINES = 450


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every stagerd module `module` imports, at any depth in the file (lazy imports count)."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("stagerd") and name != module:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {m: _imports(m, p, known) for m, p in known.items()}


def test_every_import_points_down_a_floor():
    wrong = [
        f"{m} (floor {FLOOR[_room(m)]}) imports {d} (floor {FLOOR[_room(d)]})"
        for m, deps in _graph().items()
        for d in deps
        if d != "stagerd" and FLOOR[_room(d)] < FLOOR[_room(m)]
    ]
    assert wrong == []


def test_training_never_imports_the_engine_or_the_daemon():
    wrong = [
        f"{m} imports {d}"
        for m, deps in _graph().items()
        if _room(m) == "training"
        for d in deps
        if _room(d) in ("engine", "daemon", "sinks")
    ]
    assert wrong == []


def test_no_import_circles():
    graph = _graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if dep == "stagerd" or dep not in graph:
                continue  # the package face re-exports lazily, by attribute
            if state.get(dep) == 1:
                cycles.append([*trail[trail.index(dep) :], dep] if dep in trail else [node, dep])
            elif dep not in state:
                visit(dep, [*trail, dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_families_of_siblings_have_their_own_folder():
    """Three modules of one folder named `x.py`/`x_*.py` are a family: it belongs in `x/`, as `sinks/hub/`."""
    families: dict[tuple[Path, str], list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.stem != "__init__":
            families.setdefault((path.parent, path.stem.split("_")[0]), []).append(path.name)
    crowded = {
        f"{folder.relative_to(PACKAGE)}/{name}_*": sorted(members)
        for (folder, name), members in families.items()
        if len(members) >= 3
    }
    assert crowded == {}


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_file_is_small(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines (at most {MAX_LINES})"
