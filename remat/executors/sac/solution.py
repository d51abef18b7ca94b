"""What the ``sac`` planner works on and returns: a model's blocks with the op streams their
policies see (:class:`NativeProblem`), a menu option (:class:`Option`), a policy per block
with its traced step (:class:`Solution`), and the tracer that measures a choice."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from remat.executors.sac.dataflow import problem_of
from remat.executors.sac.regions import Policy
from remat.executors.sac.trace import OpEvent, StepTrace
from remat.problem import DispatchCosts, Problem
from remat.solver.plan import Proof


@dataclass(frozen=True)
class NativeProblem:
    """A model's blocks, their classes and the op streams their policies see."""

    blocks: tuple[str, ...]
    classes: tuple[tuple[int, ...], ...]
    """Indices of blocks with identical forward streams."""
    streams: Mapping[int, tuple[OpEvent, ...]]
    """Per class (by its first block), that block's keyed forward ops."""
    baseline: StepTrace
    """The step with every block eager."""
    device_profile: str = "cpu"
    dispatch: DispatchCosts = DispatchCosts()
    """The profile's cost of SAC's own dispatch (what the solvers' view counts)."""

    @functools.cached_property
    def dataflow(self) -> Problem:
        """The baseline step as a problem for the ``sac`` executor (the solvers' view)."""
        return problem_of(self.baseline, self.device_profile, self.dispatch)

    def class_of(self, block: int) -> int:
        return next(c[0] for c in self.classes if block in c)


@dataclass(frozen=True)
class Option:
    name: str
    policy: Policy


@dataclass(frozen=True)
class Solution:
    policies: tuple[Policy, ...]
    trace: StepTrace
    solver: str
    reason: str
    proof: Proof
    """What is proven about the plan (:class:`remat.solver.plan.Proof`)."""
    options: tuple[str, ...] = ()
    """Per block, the name of the menu option chosen (for reports)."""


class Tracer(Protocol):
    """The step traced under one policy per block
    (:meth:`remat.executors.sac.trace.FakeModel.trace`);
    ``schedule=False`` skips a pipeline stage's schedule step (one microbatch's step only);
    ``offload[k]``: block ``k``'s activation inputs wait in host memory."""

    def __call__(
        self,
        policies: Sequence[Policy],
        schedule: bool = True,
        offload: Sequence[bool] | None = None,
    ) -> StepTrace: ...


def cost_of(solution: Solution | StepTrace | None) -> tuple[float, float]:
    """What ``auto`` minimises: added time (recompute and SAC's dispatch), then peak (None:
    no plan, infinite)."""
    if solution is None:
        return math.inf, math.inf
    trace = solution.trace if isinstance(solution, Solution) else solution
    return trace.added_time_s, trace.peak_bytes


def added_ms(solution: Solution) -> str:
    """The time a plan adds to the step, for reasons."""
    return f"{solution.trace.added_time_s * 1e3:.3f} ms"
