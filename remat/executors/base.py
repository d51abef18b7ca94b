"""The executor type: what every executor does (:class:`Executor`), the model it plans
(:class:`Planned`), and the step it analyzes once for every solver (:class:`Comparison`).
The two executors and their registry are in :mod:`remat.executors`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from remat.fit.peak import MemoryFormula
from remat.fit.questions import FitQuestion, FormulaQuestion
from remat.fit.search import FitReport
from remat.measure.meter import Loss
from remat.request import Request
from remat.solver.config import SolverConfig
from remat.solver.plan import Plan, Proof


@dataclass(frozen=True)
class Solved:
    """A compared plan's figures (``remat compare``'s row)."""

    step_peak_bytes: int
    recompute_pct: float
    """Recomputation, in % of the step's op time."""
    added_pct: float
    """All the plan adds to the step, in % of its op time: recomputation, and on the sac
    executor selective checkpointing's own dispatch, by which its solvers rank plans (so a
    plan that recomputes more can add less)."""
    bound_pct: float | None
    """The proven floor on the recomputation, in %, where a solver proved one."""
    proof: Proof


@dataclass(frozen=True)
class Planned:
    """A model planned by an executor: the module that trains with the plan, and the plan."""

    module: nn.Module
    plan: Plan
    timings: Mapping[str, float]
    """Seconds per planning stage (capture, analysis, solve, ...)."""
    report: Callable[[int], str]
    """The plan explained, at a width."""
    writer: Callable[[Path], Path]
    """Writes the plan file."""
    document: Callable[[], Mapping[str, Any]]
    """The plan file's JSON document (what :attr:`writer` writes)."""

    def explain(self, width: int = 120) -> str:
        """What the plan keeps and recomputes, and its predicted peak and time."""
        return self.report(width)

    def save(self, path: str | Path) -> Path:
        """Write the plan file (the executor's entry point loads it with ``plan=path``)."""
        return self.writer(Path(path))


class Comparison(ABC):
    """Every solver of an executor on one analyzed step, for ``remat compare``: the model is
    not modified."""

    solvers: list[str]

    @abstractmethod
    def __init__(
        self,
        model: nn.Module,
        example_inputs: Any,
        kwargs: Mapping[str, Any],
        request: Request,
        loss: Loss | None,
    ) -> None:
        """Analyze the step of ``model`` once."""

    @abstractmethod
    def peak_range(self, config: SolverConfig) -> tuple[int, int]:
        """The least step peak a plan reaches, and keep-all's."""

    @abstractmethod
    def solve(self, name: str, budget: int, config: SolverConfig) -> Solved:
        """Solver ``name``'s plan at a step budget (:class:`BudgetError` where none fits)."""


DEEP = {"shallow": "one shallow copy", "copies": "copies of two depths"}
"""How each executor fits a deep stack: ``remat.fit.fit``'s argument -> what it is."""


class Executor(ABC):
    """What turns a plan into a running step: :data:`EXECUTORS` holds one per name."""

    name: ClassVar[str]
    """The name the solver core knows the executor by (``Problem.executor``)."""
    entry: ClassVar[str]
    """The public function that plans and runs on it."""
    description: ClassVar[str]
    """One line: what it is and what it runs under."""
    distributed: ClassVar[bool]
    """Whether it runs under FSDP2, DDP, tensor and pipeline parallelism."""
    own_forward: ClassVar[bool]
    """Whether the planned module runs the model's own forward (under the user's autocast),
    rather than graphs that carry their casts."""
    comparison: ClassVar[type[Comparison]]
    """How ``remat compare`` runs every solver of this executor."""
    deep: ClassVar[str]
    """The argument of :func:`remat.fit.fit` that fits a deep stack on shallower models
    (:data:`DEEP`)."""

    def __str__(self) -> str:
        return self.description

    def plan(
        self,
        model: nn.Module,
        example_inputs: Any,
        *,
        example_kwargs: Mapping[str, Any] | None = None,
        request: Request | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        target: Any = None,
        **flat: Any,
    ) -> Planned:
        """Plan ``model``'s step for ``request`` (or the request's fields as keywords, ``flat``)
        with the executor's entry point: :func:`remat.optimize` leaves ``model`` as it is,
        :func:`remat.apply` wraps its blocks in place."""
        module = self._entry(
            model,
            example_inputs,
            example_kwargs=example_kwargs,
            request=request,
            loss_fn=loss_fn,
            target=target,
            **flat,
        )
        return self._planned(module)

    def compare(
        self,
        model: nn.Module,
        example_inputs: Any,
        *,
        request: Request,
        example_kwargs: Mapping[str, Any] | None = None,
        loss: Loss | None = None,
    ) -> Comparison:
        """The step analyzed once, for every solver of this executor."""
        return self.comparison(model, example_inputs, example_kwargs or {}, request, loss)

    @abstractmethod
    def _entry(self, model: nn.Module, example_inputs: Any, **kwargs: Any) -> nn.Module:
        """The entry point's module for ``model``."""

    @abstractmethod
    def _planned(self, module: nn.Module) -> Planned:
        """The entry point's module, with its plan, report and plan file."""

    @abstractmethod
    def fit(self, question: FitQuestion) -> FitReport:
        """What fits on this executor (:func:`remat.fit.fit`, which resolved
        ``question.request.max_seq``); a deep stack is fitted on shallower models, through
        the argument this executor takes (:attr:`deep`)."""

    @abstractmethod
    def memory_formula(self, question: FormulaQuestion) -> MemoryFormula:
        """``plan``'s device peak as a formula in ``(b, s)`` (:func:`remat.memory_formula`)."""

    def _only_deep(self, **given: Any) -> None:
        """Refuse the other executor's deep-stack argument by name rather than ignore it."""
        for name, value in given.items():
            if value is not None and name != self.deep:
                raise ValueError(
                    f"{name}= is not for executor {self.name!r}: it fits a deep stack on "
                    f"{DEEP[self.deep]} ({self.deep}=)"
                )
