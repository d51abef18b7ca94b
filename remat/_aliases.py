"""The modules' names before remat's folders showed its pipeline, kept for one release.

``import remat.native.parallel``, ``from remat.graph import profiles`` and
``remat.native.parallel.tensor_parallel`` after ``import remat`` still work: each returns the
module under its new name (:data:`MOVED`) and warns once with that name. The old packages
whose modules went to several folders are stand-ins (:data:`PACKAGES`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

MOVED: dict[str, str] = {
    "remat.api": "remat.executors.graph.optimize",
    "remat.pipeline": "remat.executors.graph.analyze",
    "remat.lengths": "remat.executors.graph.lengths",
    "remat.graph": "remat.executors.graph",
    "remat.graph.capture": "remat.executors.graph.capture",
    "remat.graph.joint": "remat.executors.graph.joint",
    "remat.graph.buffers": "remat.executors.graph.buffers",
    "remat.graph.loss": "remat.executors.graph.loss",
    "remat.graph.problem": "remat.executors.graph.to_problem",
    "remat.graph.profiles": "remat.measure.profiles",
    "remat.graph.costs": "remat.measure.costs",
    "remat.graph.scratch": "remat.measure.scratch",
    "remat.graph.autocast": "remat.measure.autocast",
    "remat.graph.dynamic": "remat.fit.graph_shapes",
    "remat.rewrite": "remat.executors.graph",
    "remat.rewrite.executor": "remat.executors.graph.run",
    "remat.rewrite.module": "remat.executors.graph.module",
    "remat.rewrite.partition": "remat.executors.graph.partition",
    "remat.rewrite.export": "remat.executors.graph.export",
    "remat.meter": "remat.measure.meter",
    "remat.formula": "remat.fit.formula",
    "remat.peak_formula": "remat.fit.peak",
    "remat.pipeline_fit": "remat.fit.pipeline",
    "remat.native": "remat.executors.sac",
    "remat.native.api": "remat.executors.sac.apply",
    "remat.native.regions": "remat.executors.sac.regions",
    "remat.native.planner": "remat.executors.sac.planner",
    "remat.native.trace": "remat.executors.sac.trace",
    "remat.native.events": "remat.executors.sac.events",
    "remat.native.recorder": "remat.executors.sac.recorder",
    "remat.native.dataflow": "remat.executors.sac.dataflow",
    "remat.native.shallow": "remat.executors.sac.shallow",
    "remat.native.state": "remat.executors.sac.state",
    "remat.native.report": "remat.executors.sac.report",
    "remat.native.hf": "remat.executors.sac.hf",
    "remat.native.agree": "remat.executors.sac.agree",
    "remat.native.dynamic": "remat.fit.sac_shapes",
    "remat.native.formula": "remat.fit.sac_formula",
    "remat.native.deep": "remat.fit.deep",
    "remat.native.workers": "remat.fit.workers",
    "remat.native.parallel": "remat.parallel.tensor",
    "remat.native.pipelining": "remat.parallel.pipelining",
    "remat.native.split": "remat.parallel.split",
    "remat.native.pipeline_plan": "remat.parallel.pipeline_plan",
    "remat.planfile": "remat.plan.files",
    "remat.report": "remat.plan.report",
    "remat.plots": "remat.plan.plots",
    "remat.memory_table": "remat.plan.memory_table",
}
"""Old module name -> the module it now is."""

PACKAGES: dict[str, dict[str, str]] = {
    "remat.graph": {},
    "remat.native": {},
    "remat.rewrite": {
        "Executor": "remat.executors.graph.run",
        "build_executor": "remat.executors.graph.run",
        "RematModule": "remat.executors.graph.module",
    },
}
"""Old packages, whose modules went to several folders: each is a stand-in package that
finds its old modules through :data:`MOVED`, with the names its ``__init__`` exported."""


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"{old} is now {new}; the old name goes in the next release",
        DeprecationWarning,
        stacklevel=3,
    )


def _child(package: str, name: str) -> object:
    """``package.name`` for a stand-in package: an old module, or a name it exported."""
    if f"{package}.{name}" in MOVED:
        return importlib.import_module(f"{package}.{name}")
    home = PACKAGES[package].get(name)
    if home is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def old_module(name: str) -> ModuleType | None:
    """``remat.<name>`` where ``name`` is a module's old name (``remat.api``, ``remat.graph``),
    for ``remat.__getattr__``; None otherwise."""
    full = f"remat.{name}"
    return importlib.import_module(full) if full in MOVED else None


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        _warn(spec.name, self.new)
        if spec.name in PACKAGES:
            package = ModuleType(spec.name, f"Old name of {self.new}; see remat._aliases.")
            package.__path__ = []  # a package: its old modules are found through MOVED
            package.__getattr__ = functools.partial(_child, spec.name)  # type: ignore[method-assign]
            return package
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module is the new one, already executed: only its spec, which the import
        system has just overwritten with the old name's, is put back."""
        if self.spec is not None:
            module.__spec__ = self.spec


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(
            fullname, _Alias(new), is_package=fullname in PACKAGES
        )


def install() -> None:
    """Resolve the old names (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
