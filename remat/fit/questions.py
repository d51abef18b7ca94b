"""What :func:`remat.fit.fit` and :func:`remat.memory_formula` ask an executor
(:meth:`remat.executors.Executor.fit`, :meth:`~remat.executors.Executor.memory_formula`): the
arguments checked and resolved once by the public functions, as records, so that each
executor answers one question rather than repeating ten parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from remat.budget import DeviceBudget, StaticMemory
from remat.fit.sac_formula import Copies
from remat.measure.meter import Loss
from remat.request import Request
from remat.solver.plan import Plan

__all__ = ["FitQuestion", "FormulaQuestion"]


@dataclass(frozen=True, kw_only=True)
class FitQuestion:
    """What fits ``budget``: the longest sequence and the largest batch per plan."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    request: Request
    """Its ``max_seq`` resolved (the longest length searched)."""
    budget: DeviceBudget
    max_batch: int
    loss: Loss | None
    shallow: tuple[nn.Module, int, int] | None = None
    """The graph executor's deep stack: a copy with fewer layers, its layers, the model's."""
    copies: Copies | None = None
    """The ``sac`` executor's deep stack: a builder of copies with ``n`` blocks."""


@dataclass(frozen=True, kw_only=True)
class FormulaQuestion:
    """``plan``'s device peak as an exact formula in the batch and the sequence length."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    request: Request
    plan: str | Plan
    static: StaticMemory
    seq: bool | None
    """Whether dim 1 of the first input is a sequence (None: guessed)."""
    loss: Loss | None
    copies: Copies | None = None
    """The ``sac`` executor's deep stack: a builder of copies with ``n`` blocks."""
