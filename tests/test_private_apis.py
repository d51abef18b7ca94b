"""Private PyTorch APIs are used only in ``remat/_torch_compat/``.

A torch upgrade should only ever have to touch that package (its docstring says why). This test
walks every other module of ``remat/`` with ``ast`` and fails, naming ``file:line``, on

(a) an import of a ``torch`` module path with a private component (``import torch._dynamo``,
    ``from torch.utils._pytree import tree_map``, ``from torch import _C``);
(b) an attribute chain on ``torch``, or on a name imported from torch (``nn``, ``F``, ...),
    with a private component (``torch._C._foo``, ``nn.modules.batchnorm._BatchNorm``);
(c) a private attribute of a torch object that ``_torch_compat`` routes
    (:data:`ROUTED_ATTRIBUTES`, on any object: ``op._schema``, ``module._buffers``).

Not flagged: remat's own private names (``self._foo``, ``regions._observers``,
``remat._torch_compat``), dunders (``torch.__version__``), and ATen operator names under
``torch.ops`` (``torch.ops.aten._to_copy``: an operator's registered name, not a Python API).
"""

from __future__ import annotations

import ast
from pathlib import Path

REMAT = Path(__file__).resolve().parent.parent / "remat"

ROUTED_ATTRIBUTES = frozenset(
    {
        "_schema",  # tc.op_schema(op), tc.is_mutable_op(op), tc.op_arguments(op)
        "_parameters",  # tc.local_parameters(module)
        "_buffers",  # tc.local_buffers(module)
        "_modules",  # tc.child_modules(module)
        "_non_persistent_buffers_set",  # tc.non_persistent_buffer_names(module)
    }
)

PENDING: frozenset[tuple[str, str]] = frozenset()
"""Uses not yet routed: ``(path under remat/, the expression as ast.unparse writes it)``."""


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_path(module: str | None) -> bool:
    return module is not None and module.split(".")[0] == "torch"


def _chain(node: ast.Attribute) -> tuple[ast.expr, list[str]]:
    """The root expression of ``a.b.c`` and the names after it (``["b", "c"]``)."""
    names: list[str] = []
    cur: ast.expr = node
    while isinstance(cur, ast.Attribute):
        names.append(cur.attr)
        cur = cur.value
    return cur, names[::-1]


def violations(source: str, path: str) -> list[tuple[int, str, str]]:
    """``(line, expression, reason)`` for each private torch use in ``source``."""
    tree = ast.parse(source, filename=path)
    torch_names = set()  # names bound to torch or to something imported from torch
    found: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _torch_path(alias.name):
                    continue
                torch_names.add(alias.asname or alias.name.split(".")[0])
                if any(_private(p) for p in alias.name.split(".")):
                    found.append((node.lineno, ast.unparse(node), "private torch module"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _torch_path(node.module):
            assert node.module is not None
            torch_names.update(a.asname or a.name for a in node.names)
            parts = node.module.split(".") + [a.name for a in node.names]
            if any(_private(p) for p in parts):
                found.append((node.lineno, ast.unparse(node), "private torch module or name"))
    seen: set[int] = set()  # inner Attribute nodes of a chain already checked
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in seen:
            continue
        inner: ast.expr = node.value
        while isinstance(inner, ast.Attribute):
            seen.add(id(inner))
            inner = inner.value
        root, names = _chain(node)
        expr = ast.unparse(node)
        if isinstance(root, ast.Name) and root.id in torch_names:
            if root.id == "torch" and names[:1] == ["ops"]:
                continue  # ATen operator names
            if any(_private(n) for n in names):
                found.append((node.lineno, expr, "private attribute of torch"))
                continue
        # (c): the routed attributes anywhere in the chain (``m._buffers.get``).
        cur: ast.expr = node
        while isinstance(cur, ast.Attribute):
            if cur.attr in ROUTED_ATTRIBUTES:
                found.append((cur.lineno, ast.unparse(cur), "private torch attribute"))
            cur = cur.value
    return sorted(set(found))


def test_no_private_torch_api_outside_compat() -> None:
    bad, used = [], set()
    for file in sorted(REMAT.rglob("*.py")):
        rel = file.relative_to(REMAT).as_posix()
        if rel.startswith("_torch_compat/"):
            continue
        for line, expr, reason in violations(file.read_text(), rel):
            if (rel, expr) in PENDING:
                used.add((rel, expr))
            else:
                bad.append(f"remat/{rel}:{line}: {expr} ({reason}; use remat._torch_compat)")
    assert not bad, "private torch APIs outside remat/_torch_compat/:\n" + "\n".join(bad)
    stale = sorted(PENDING - used)
    assert not stale, f"PENDING entries no longer found (remove them): {stale}"


def test_checker_flags_each_kind() -> None:
    source = """
import torch
import torch._dynamo
import torch.utils._pytree as pytree
from torch import _C, nn
from torch._ops import OpOverload
from torch.utils import checkpoint

torch._C._current_graph_task_id()
nn.modules.batchnorm._BatchNorm
checkpoint._internal
x = op._schema.arguments
m._buffers.get("running_mean")
"""
    lines = {line for line, _, _ in violations(source, "t.py")}
    assert lines == {3, 4, 5, 6, 9, 10, 11, 12, 13}


def test_checker_passes_remat_and_public_names() -> None:
    source = """
import torch
from torch import nn
from remat import _torch_compat as tc
import remat._torch_compat

self._schema_cache = 1
regions._observers.append(f)
torch.__version__
torch.ops.aten._to_copy.default
nn.Linear(2, 2).weight
tc.local_buffers(m)
super()._free(1, 2)
"""
    assert violations(source, "t.py") == []
