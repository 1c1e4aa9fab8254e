"""The layers of spark-state, as their package docstrings state them, checked on the code's imports; and the
repository holds only what belongs in it.

Every import of ``spark_state`` and ``datasources`` (at module level, inside functions and under
``TYPE_CHECKING`` alike) must go down the table ``MAY_IMPORT``; no two modules import each other in a circle;
only the Spark edge imports pyspark.
"""

from __future__ import annotations

import ast
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE = {"spark_state.errors", "spark_state.redaction"}
LAYERS = ("keyspace", "model", "storage", "store", "executor", "hosts", "driver", "spark", "ops")
MAY_IMPORT = {
    "base": {"base"},
    "keyspace": {"base", "keyspace"},
    "model": {"base", "keyspace", "model"},
    "storage": {"base", "storage"},
    "store": {"base", "keyspace", "model", "storage", "store"},
    "executor": {"base", "keyspace", "model", "storage", "store", "executor"},
    "hosts": {"base", "storage", "store", "executor", "hosts"},
    "driver": {"base", "keyspace", "model", "storage", "store", "executor", "driver"},
    "spark": {"base", "keyspace", "model", "storage", "store", "executor", "hosts", "driver", "spark", "datasources"},
    "ops": {"base", "keyspace", "model", "storage", "store", "executor", "hosts", "driver", "spark", "ops"},
    "datasources": {"base", "keyspace", "model", "storage", "store", "driver", "ops", "datasources"},
    "top": set(LAYERS) | {"base", "top"},
}
"""Which layers each layer's modules may import (as the packages' docstrings say)."""
PYSPARK_ALLOWED = {"spark", "datasources", "hosts", "ops"}
"""Layers that may import pyspark: the Spark edge, the data sources, the hosts (cloudpickle, TaskContext and
Broadcast only) and the main job; everything below them imports and runs without it."""
HOSTS_PYSPARK = {"pyspark", "pyspark.cloudpickle", "pyspark.core.broadcast", "pyspark.taskcontext"}


def _modules() -> dict[str, Path]:
    found = {}
    for package in ("spark_state", "datasources"):
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def layer_of(module: str) -> str | None:
    if module in BASE:
        return "base"
    parts = module.split(".")
    if parts[0] == "datasources":
        return "datasources"
    if parts[0] != "spark_state":
        return None
    if len(parts) == 1 or parts[1] in ("__main__",):
        return "top"
    return parts[1] if parts[1] in LAYERS else None


def _imports(path: Path, module: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) of every import in ``path``."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    for node in tree.body:  # ``if TYPE_CHECKING:`` blocks count as module level
        if isinstance(node, ast.If):
            top_level.update(id(child) for child in node.body)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                base = ".".join(module.split(".")[: -node.level] + [node.module])
            found.append((base, node.lineno, id(node) in top_level))
            known = _modules()
            found += [
                (f"{base}.{alias.name}", node.lineno, id(node) in top_level)
                for alias in node.names
                if f"{base}.{alias.name}" in known
            ]
    return found


def test_every_module_belongs_to_a_layer():
    assert [m for m in _modules() if layer_of(m) is None] == []


def test_imports_go_down_the_layers():
    wrong = []
    for module, path in _modules().items():
        here = layer_of(module)
        for imported, line, _ in _imports(path, module):
            there = layer_of(imported)
            if there is not None and there not in MAY_IMPORT[here]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {here} imports {imported} ({there})")
    assert wrong == []


def test_only_the_spark_edge_imports_pyspark():
    wrong = []
    for module, path in _modules().items():
        here = layer_of(module)
        for imported, line, _ in _imports(path, module):
            if imported.split(".")[0] != "pyspark":
                continue
            if (
                here not in PYSPARK_ALLOWED
                or (here == "hosts" and imported not in HOSTS_PYSPARK)
                or (here == "ops" and module != "spark_state.ops.main")
            ):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {imported}")
    assert wrong == []


def test_no_module_level_import_circle():
    graph: dict[str, set[str]] = defaultdict(set)
    modules = _modules()
    for module, path in modules.items():
        for imported, _, top in _imports(path, module):
            if top and imported in modules and imported != module:
                graph[module].add(imported)
    circles, state = [], {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            # a package's __init__ importing its own submodules is its own business, not a circle of layers
            if nxt.startswith(node + "."):
                continue
            if state.get(nxt) == "open":
                circles.append(trail[trail.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []


def test_each_package_says_what_it_owns_and_may_import():
    for layer in LAYERS:
        doc = ast.get_docstring(ast.parse((ROOT / "spark_state" / layer / "__init__.py").read_text())) or ""
        assert "May import" in doc or "may import" in doc, layer


ALLOWED_AT_ROOT = {
    ".ci",
    ".gitignore",
    "README.md",
    "benchmarks",
    "datasources",
    "docs",
    "mkdocs.yml",
    "pyproject.toml",
    "pyspark_replayable.py",
    "pyspark_spark_state.py",
    "run",
    "scripts",
    "spark_state",
    "tests",
}
BINARY_SUFFIXES = {".whl", ".zip", ".tar", ".gz", ".jar", ".so", ".pyc", ".parquet", ".arrow", ".bin", ".exe"}


def _tracked() -> list[str]:
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: nothing is tracked to check")
    return listed.stdout.splitlines()


def test_the_root_holds_only_the_project_s_own_files():
    stray = sorted({path.split("/", 1)[0] for path in _tracked()} - ALLOWED_AT_ROOT)
    assert stray == [], f"files at the root that are not the project's layout: {stray}"


def test_no_binary_or_progress_file_is_tracked():
    wrong = [p for p in _tracked() if Path(p).suffix in BINARY_SUFFIXES or p.endswith(".progress.json")]
    images = [p for p in _tracked() if Path(p).suffix == ".png" and not p.startswith(("benchmarks/results/", "docs/"))]
    assert wrong + images == []
