"""config/ is in no package cycle: the engines and the cluster declare their settings and import nothing
from config/, which reads them (a package-level graph of every import in shmbroker/, lazy ones too)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "shmbroker"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every shmbroker module `path` imports, at its top or inside a function."""
    name = module_name(path)
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out |= {f"{module}.{a.name}" for a in node.names} if node.module is None else {module}
    return {m for m in out if m.startswith("shmbroker.")}


def package_of(module: str) -> str:
    return module.split(".")[1]


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        source = package_of(module_name(path)) if module_name(path) != "shmbroker" else "shmbroker"
        for target in imported(path):
            if package_of(target) != source:
                graph[source].add(package_of(target))
    return graph


def reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_config_is_in_no_package_cycle():
    graph = package_graph()
    assert "config" not in reaches(graph, "config"), {p: sorted(graph[p]) for p in reaches(graph, "config")}


def test_engines_and_cluster_import_nothing_from_config():
    graph = package_graph()
    assert "config" not in graph["engines"]
    assert "config" not in graph["cluster"]
    assert "config" in graph["supervisor"]  # the graph sees imports at all
