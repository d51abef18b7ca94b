"""Which values belong to which repeated block (``layers.3``), from module paths alone.

Used by the block baseline (what ``gradient_checkpointing_enable()`` does: every block fully
checkpointed). Blocks are the children of a ModuleList, i.e. stack entries whose path ends in
an integer; by default the list with the most children, else those the user names.
"""

from __future__ import annotations

import fnmatch
import re
from collections import Counter
from collections.abc import Mapping

from remat.problem import Problem, Value

INDEXED = re.compile(r"^(.*)\.(\d+)$")
"""A module path ending in a list index (``model.layers.3``): (list path, index)."""


def matches(path: str, cls: str, patterns: tuple[str, ...]) -> bool:
    """A module (its path and class name) is named by one of ``patterns`` (class names, or
    path patterns with ``*``)."""
    return any(cls == p or fnmatch.fnmatchcase(path, p) for p in patterns)


def block_of(problem: Problem, block_types: tuple[str, ...] = ()) -> Mapping[str, str | None]:
    """The block path of every value (``None`` outside blocks)."""
    if block_types:
        chosen = {
            path
            for v in problem.values
            for path, cls in v.module_stack
            if matches(path, cls, block_types)
        }
    else:
        lists: Counter[str] = Counter()
        seen: set[str] = set()
        for v in problem.values:
            for path, _ in v.module_stack:
                m = INDEXED.match(path)
                if m and path not in seen:
                    seen.add(path)
                    lists[m.group(1)] += 1
        if not lists:
            return {v.name: None for v in problem.values}
        prefix, count = max(lists.items(), key=lambda kv: (kv[1], -len(kv[0])))
        if count < 2:
            return {v.name: None for v in problem.values}
        chosen = {p for p in seen if INDEXED.match(p) and INDEXED.match(p).group(1) == prefix}  # type: ignore[union-attr]
    return {v.name: _outermost(v, chosen) for v in problem.values}


def _outermost(v: Value, chosen: set[str]) -> str | None:
    return next((path for path, _ in v.module_stack if path in chosen), None)
