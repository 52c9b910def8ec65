"""The patch store's modules import one another one way: no module imports one that imports
it back, even inside a function, so each can be read (and loaded) without the others' state."""

from __future__ import annotations

import ast
from pathlib import Path

import services.patch_store

PACKAGE = "services.patch_store"


def _imports(path: Path) -> set[str]:
    """The modules of the package that `path` imports anywhere (top level or in a function)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == PACKAGE:  # `from services.patch_store import convert`
                found |= {f"{PACKAGE}.{alias.name}" for alias in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.startswith(PACKAGE + ".")}


def test_the_patch_store_modules_import_each_other_without_a_cycle():
    root = Path(services.patch_store.__file__).parent
    graph = {f"{PACKAGE}.{p.stem}": _imports(p) for p in root.glob("*.py") if p.stem != "__init__"}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, "import cycle: " + " -> ".join((*path, module))
        if module in done:
            return
        for dep in sorted(graph.get(module, ())):
            visit(dep, (*path, module))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())
