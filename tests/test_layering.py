"""The package is a one-way stack: tools -> public API -> adapters -> engine -> backends
-> leaf utilities.

Read from the source with :mod:`ast` (nothing is imported), every import of one of our
modules, at module level or inside a function, must go to the same layer or a lower
one; no module may import another module's underscore names (modules themselves may be
underscore-named: they are the package's structure); and the import graph has no cycle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "layernorm"

#: Module-name prefixes and their layer, highest first; the longest prefix wins.
LAYERS = {
    "layernorm.bench": 5,
    "layernorm.__main__": 5,
    "layernorm": 4,  # the package's re-exports (this exact module only)
    "layernorm._api": 4,
    "layernorm.layer": 4,
    "layernorm.torch": 4,
    "layernorm._adapters": 3,
    "layernorm._engine": 2,
    "layernorm._fast": 2,
    "layernorm._fast_add": 2,
    "layernorm._fast_backward": 2,
    "layernorm._plans": 2,
    "layernorm._backends": 1,
    "layernorm._dispatch": 0,
    "layernorm._validate": 0,
    "layernorm._layout": 0,
    "layernorm._dtypes": 0,
}
LAYER_NAMES = {5: "tools", 4: "public API", 3: "adapters", 2: "engine", 1: "backends",
               0: "leaf utilities"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def layer_of(module: str) -> int:
    """The layer of one of our modules (the longest matching prefix of LAYERS)."""
    best = None
    for prefix in LAYERS:
        if module == prefix or (prefix != PACKAGE and module.startswith(prefix + ".")):
            if best is None or len(prefix) > len(best):
                best = prefix
    if best is None:
        raise KeyError(module)
    return LAYERS[best]


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module if _is_package(module) else module.rsplit(".", 1)[0]
    for _ in range(node.level - 1):
        base = base.rsplit(".", 1)[0]
    return f"{base}.{node.module}" if node.module else base


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def scan(module: str, path: Path) -> tuple[set[str], list[str]]:
    """Our modules that ``module`` imports, and its private-name violations."""
    tree = ast.parse(path.read_text(), str(path))
    imported: set[str] = set()
    problems: list[str] = []
    aliases: dict[str, str] = {}  # local name -> our module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    imported.add(alias.name)
                    if alias.asname:
                        aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            if source.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if target in MODULES:  # a submodule
                    imported.add(target)
                    aliases[alias.asname or alias.name] = target
                    continue
                imported.add(source)
                if _is_private(alias.name):
                    problems.append(f"{module}:{node.lineno} imports {source}.{alias.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and _is_private(node.attr)):
            target = f"{aliases[node.value.id]}.{node.attr}"
            if target not in MODULES:
                problems.append(f"{module}:{node.lineno} uses {target}")
    imported.discard(module)
    return imported, problems


GRAPH = {module: scan(module, path) for module, path in MODULES.items()}


def test_every_module_has_a_layer():
    missing = []
    for module in MODULES:
        try:
            layer_of(module)
        except KeyError:
            missing.append(module)
    assert not missing, f"modules with no layer in LAYERS: {missing}"


def test_imports_go_down_the_stack():
    upward = []
    for module, (imported, _) in GRAPH.items():
        for target in imported:
            if layer_of(target) > layer_of(module):
                upward.append(f"{module} ({LAYER_NAMES[layer_of(module)]}) imports "
                              f"{target} ({LAYER_NAMES[layer_of(target)]})")
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def test_no_private_name_crosses_a_module():
    problems = sorted(p for _, found in GRAPH.values() for p in found)
    assert not problems, "private names imported across modules:\n" + "\n".join(problems)


def _cycle() -> list[str] | None:
    graph = {m: {t for t in imported if t in MODULES} for m, (imported, _) in GRAPH.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle():
    cycle = _cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("source, expected", [
    ("from ._engine import _private\n", "imports layernorm._engine._private"),
    ("from . import _engine\n_engine._flat_param(1)\n", "uses layernorm._engine._flat_param"),
])
def test_the_private_name_check_catches_violations(tmp_path, source, expected):
    path = tmp_path / "probe.py"
    path.write_text(source)
    _, problems = scan("layernorm._api", path)
    assert len(problems) == 1 and expected in problems[0]


def test_the_layer_check_catches_an_upward_import(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("from .. import _api\n")
    imported, _ = scan("layernorm._backends._array_api", path)
    assert "layernorm._api" in imported
    assert layer_of("layernorm._api") > layer_of("layernorm._backends._array_api")


def test_the_cycle_check_finds_a_cycle(monkeypatch):
    fake = {"layernorm.a": ({"layernorm.b"}, []), "layernorm.b": ({"layernorm.a"}, [])}
    this = sys.modules[__name__]
    monkeypatch.setattr(this, "GRAPH", fake)
    monkeypatch.setattr(this, "MODULES", {"layernorm.a": Path(), "layernorm.b": Path()})
    assert _cycle() in (["layernorm.a", "layernorm.b", "layernorm.a"],
                        ["layernorm.b", "layernorm.a", "layernorm.b"])
