"""The CLI, the local cluster and the Serve application import one way (issue 29): they
used to import each other in a circle over `DEFAULT_HOME` and `resolve_model`, which now
live in the leaf `services/common/paths.py`. Read from the import statements (deferred ones
inside functions included), so a circle through any other module of services/ counts too."""

from __future__ import annotations

import ast
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[3] / "services"
THREE = ("services.cli", "services.cluster.local", "services.gateway.serve_app")


def _module(path: Path) -> str:
    parts = path.relative_to(SERVICES.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of services/ it imports anywhere in its body."""
    modules = {_module(p): p for p in SERVICES.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_no_import_circle_passes_through_the_cli_the_cluster_or_the_serve_app():
    graph = import_graph()
    circles = [m for m in THREE if m in _reachable(graph, m)]
    assert circles == [], f"{circles} import themselves back, through {graph}"


def test_the_paths_module_is_a_leaf():
    assert import_graph()["services.common.paths"] <= {
        "services.common.errors",
        "services.engine.model.tiny",
        "services.engine.model.config",
        "services.engine.model.loader",
    }
