"""The package's modules form layers: no import cycle, function-local imports included.

A cycle held together by imports inside functions works until someone moves one to the top of
its file; this walks every import statement of every module (top level, inside functions,
under ``TYPE_CHECKING``) and fails on any cycle among remat's own modules, naming it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).parents[1] / "remat"


def _modules(root: Path) -> dict[str, Path]:
    mods = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def import_graph(root: Path = ROOT) -> nx.DiGraph:
    """Module -> the package's modules it imports. ``from pkg import sub`` is an edge to
    ``pkg.sub`` when ``sub`` is a module (the package itself is a parent, imported first
    anyway)."""
    mods = _modules(root)
    graph = nx.DiGraph()
    for name, path in mods.items():
        graph.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
                ]
            graph.add_edges_from((name, t) for t in targets if t in mods and t != name)
    return graph


def import_cycles(root: Path = ROOT) -> list[list[str]]:
    components = nx.strongly_connected_components(import_graph(root))
    return sorted(sorted(c) for c in components if len(c) > 1)


def test_the_walk_finds_a_cycle_held_by_a_function_local_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import f\n")
    (pkg / "a.py").write_text("from pkg.sub import b\n\ndef f():\n    return b.g()\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import H\n"
        "def g():\n    from pkg import a\n    return a\n"
    )
    (pkg / "c.py").write_text("import pkg.sub.b\nH = 1\n")
    graph = import_graph(pkg)
    assert graph.has_edge("pkg.sub.b", "pkg.c")  # relative, under TYPE_CHECKING
    assert graph.has_edge("pkg.c", "pkg.sub.b")
    assert import_cycles(pkg) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    (pkg / "sub" / "b.py").write_text("def g():\n    return 1\n")
    assert import_cycles(pkg) == []


def test_no_import_cycle_in_remat() -> None:
    assert len(import_graph()) > 50
    cycles = import_cycles()
    assert not cycles, "import cycles among remat's modules: " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
    return names


def test_the_solver_core_never_imports_torch() -> None:
    """``remat/solver/`` and the problem it reads see numbers and a DAG only: no torch, and
    nothing of remat's torch side (every import statement, function-local ones included)."""
    core = [*sorted((ROOT / "solver").glob("*.py")), ROOT / "problem.py"]
    assert len(core) > 20
    allowed = ("remat.solver", "remat.problem", "remat._version")
    for path in core:
        for name in _imported(path):
            assert name.split(".")[0] != "torch", f"{path.name} imports {name}"
            if name.split(".")[0] == "remat":
                assert name.startswith(allowed), f"{path.name} imports {name}"
