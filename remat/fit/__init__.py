"""Will it fit? A step's peak as an exact formula in batch and sequence length, and from it
the longest sequence and the largest batch each plan fits in a device budget.

:mod:`~remat.fit.table` (``remat.fit.fit``) answers for one model, on the search of
:mod:`~remat.fit.search`; :mod:`~remat.fit.pipeline` (``remat.fit_pipeline``) for every rank of
a pipeline; :mod:`~remat.fit.formula` (``remat.memory_formula``) gives the formula. Each asks
the executor (:meth:`remat.executors.Executor.fit`). The whole-graph executor's step comes
from concrete captures (:mod:`~remat.fit.graph_shapes`, :mod:`~remat.fit.graph_formula`), the
``sac`` executor's from traces (:mod:`~remat.fit.sac_shapes`, :mod:`~remat.fit.sac_formula`),
deep stacks from two shallow copies (:mod:`~remat.fit.deep`), on several cores
(:mod:`~remat.fit.workers`).

The names below are loaded on first use: the executors import this package's shape fitting
and search, and :mod:`~remat.fit.table` and :mod:`~remat.fit.formula` import the executors.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from remat.fit.formula import memory_formula
    from remat.fit.peak import MemoryFormula
    from remat.fit.pipeline import PipelineFitReport, fit_pipeline
    from remat.fit.search import (
        CAPS,
        FIXED,
        FIXED_SAC,
        Candidate,
        Choice,
        FitReport,
        FitRow,
        fit_dynamic,
        fit_native,
    )
    from remat.fit.table import fit

__all__ = [
    "CAPS",
    "FIXED",
    "FIXED_SAC",
    "Candidate",
    "Choice",
    "FitReport",
    "FitRow",
    "MemoryFormula",
    "PipelineFitReport",
    "fit",
    "fit_dynamic",
    "fit_native",
    "fit_pipeline",
    "memory_formula",
]

_SEARCH = ("CAPS", "FIXED", "FIXED_SAC", "Candidate", "Choice", "FitReport", "FitRow")
_HOME = {
    **dict.fromkeys((*_SEARCH, "fit_dynamic", "fit_native"), "remat.fit.search"),
    "fit": "remat.fit.table",
    "MemoryFormula": "remat.fit.peak",
    "memory_formula": "remat.fit.formula",
    "PipelineFitReport": "remat.fit.pipeline",
    "fit_pipeline": "remat.fit.pipeline",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'remat.fit' has no attribute {name!r}")
