"""Planning time counted as work, so that the same request gives the same plan under any load.

Every decision a solver takes by the time it has left (a deadline, a share of
``time_limit_s``, how many branch-and-bound nodes HiGHS may explore) reads this clock instead
of the wall clock. It advances by the work the solvers count: HiGHS's simplex iterations
or the limit checks it passed (whichever is worth more), each simulated schedule step (every
plan a search tries is simulated), each step of building a MILP model, each event the
``sac`` planner traces. Each kind of work has a price in reference seconds, about what it
takes on one idle core of the reference machine, so ``time_limit_s`` still reads as seconds
there; a busier or slower machine takes longer and returns the same plan.

The wall clock remains as a safety net only (:attr:`SolverConfig.wall_limit_s`): once it
passes, :func:`now` reads past every deadline, so every solver stops with its best plan, and
:func:`expiry_note` says so in the plan's reason, since that plan may differ from run to run.

The clock is per planning call: :func:`planning` opens one (or joins the one already open, so
a solver called by another shares its caller's), held in a context variable.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from remat.solver.config import SolverConfig

F = TypeVar("F", bound=Callable[..., Any])

REFERENCE_NONZEROS = 2500
"""The model size the prices below are for; each grows with the nonzeros of the model.
Measured on one idle core with remat's own MILPs (TinyGPT of 1-4 layers, the zoo's
blocks): the prices are about those, so that ``time_limit_s`` reads as seconds there."""
ITERATION_S = 3.4e-5
"""A simplex iteration of HiGHS, its MIP work per iteration included (cuts, heuristics,
sub-MIPs): 3.5e-5 s at 3,000 nonzeros, 9.4e-5 at 15,000, 2e-4 at 48,000 (whole solves).
Half this price ran the test suite 37% longer than the wall-clock limits did..."""
ITERATION_GROWTH = 0.6
"""... so the price grows as ``(nonzeros / REFERENCE_NONZEROS) ** ITERATION_GROWTH``."""
NODE_S = 1e-3
"""A branch-and-bound node: 0.5 ms at 2,000-3,000 nonzeros, 9 ms at 15,000..."""
NODE_GROWTH = 1.1
"""... so the price grows as ``(nonzeros / REFERENCE_NONZEROS) ** NODE_GROWTH``."""
CHECKPOINT_S = 0.03
"""The work between two of HiGHS's limit checks (its MIP interrupt callback) per 10,000
nonzeros: 0.01 s at 2,000, 0.02-0.03 at 9,000-10,000, 0.1 at 15,000, 0.19 at 48,000 and
0.25 at 100,000 between them (presolve, root cuts and heuristics included)."""
CHECKPOINT_FLOOR_S = 0.005
"""The least price of one limit check, however small the model."""
SOLVE_S = 0.005
"""Each MILP or LP solve's own price (building and loading the model into HiGHS)."""
SIMULATED_STEP_S = 5e-6
"""One step of a simulated schedule (:func:`remat.solver.simulate.simulate`)."""
EXPIRED_STEP_S = 1e9
"""Once the safety net has passed, each reading of the clock jumps this far."""
MODEL_TICK_S = 2e-5
"""One variable or constraint loop step while a MILP model is built."""
TRACED_EVENT_S = 2e-5
"""One event of a step traced under a plan (the ``sac`` executor's planner)."""


@dataclass
class Clock:
    """The work done so far in one planning call, and its wall-clock safety net."""

    wall_limit_s: float
    started: float = field(default_factory=time.perf_counter)
    spent_s: float = 0.0
    expired: bool = False

    def now(self) -> float:
        if not self.expired and time.perf_counter() - self.started > self.wall_limit_s:
            self.expired = True
        if self.expired:
            # Past every deadline set before, and past any set since by the next reading;
            # finite, so that ``deadline - now()`` stays a number.
            self.spent_s += EXPIRED_STEP_S
        return self.spent_s

    def wall_left_s(self) -> float:
        """Wall-clock seconds until the safety net (for HiGHS's own ``time_limit``)."""
        return max(0.0, self.wall_limit_s - (time.perf_counter() - self.started))


_CLOCK: contextvars.ContextVar[Clock | None] = contextvars.ContextVar("remat_clock", default=None)


@contextmanager
def planning(config: SolverConfig) -> Iterator[Clock]:
    """The planning call's clock: a new one, or the one a caller already opened."""
    clock = _CLOCK.get()
    if clock is not None:
        yield clock
        return
    clock = Clock(wall_limit_s=config.wall_limit())
    token = _CLOCK.set(clock)
    try:
        yield clock
    finally:
        _CLOCK.reset(token)


def counted(fn: F) -> F:
    """Run the solver ``fn`` (it takes a :class:`SolverConfig`) on the open clock, or on a
    clock of its own; a clock of its own that expired is noted in the plan's reason
    (:func:`expiry_note`)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        given = [a for a in (*args, *kwargs.values()) if isinstance(a, SolverConfig)]
        config = given[0] if given else SolverConfig()
        outermost = _CLOCK.get() is None
        with planning(config) as clock:
            plan = fn(*args, **kwargs)
        if outermost and clock.expired and isinstance(getattr(plan, "reason", None), str):
            plan = dataclasses.replace(plan, reason=plan.reason + expiry_note(config))
        return plan

    return wrapper  # type: ignore[return-value]


def now() -> float:
    """Reference seconds of work done in this planning call (past every deadline once the
    wall-clock safety net has passed): use it wherever a deadline was read from the wall
    clock. Outside a planning call nothing is counted and it reads 0: a deadline set there
    (a test's) never passes, and every loop runs to its own end."""
    clock = _CLOCK.get()
    return 0.0 if clock is None else clock.now()


def charge(seconds: float) -> None:
    """Count ``seconds`` (reference) of work done (nothing outside a planning call: a plan
    simulated to check or report it)."""
    clock = _CLOCK.get()
    if clock is not None:
        clock.spent_s += seconds


def node_limit(work_s: float, nonzeros: int) -> int:
    """HiGHS's ``mip_max_nodes`` for ``work_s`` reference seconds on a model this size."""
    scale = max(1.0, nonzeros / REFERENCE_NONZEROS) ** NODE_GROWTH
    return max(1, int(work_s / (NODE_S * scale)))


def checkpoint_limit(work_s: float, nonzeros: int) -> int:
    """How many of HiGHS's limit checks a solve of ``work_s`` reference seconds may pass."""
    return max(1, int(work_s / _checkpoint_price(nonzeros)))


def _checkpoint_price(nonzeros: int) -> float:
    """Reference seconds between two of HiGHS's limit checks on a model this size."""
    return max(CHECKPOINT_FLOOR_S, CHECKPOINT_S * nonzeros / 10_000)


def charge_solve(iterations: int, nonzeros: int, checks: int = 0) -> None:
    """Count one HiGHS solve of ``iterations`` simplex iterations that passed ``checks`` of
    its limit checks, on a model this size: the larger of the two prices, since a MIP solve
    spends most of its root in cuts and heuristics, which no simplex iteration counts (a
    9,000-nonzero block solve passed its 35 checks in 1 s of wall time with 3,000
    iterations, worth 0.25 s)."""
    scale = max(1.0, nonzeros / REFERENCE_NONZEROS) ** ITERATION_GROWTH
    simplex = max(0, iterations) * ITERATION_S * scale
    charge(SOLVE_S + max(simplex, checks * _checkpoint_price(nonzeros)))


def wall_left_s() -> float:
    """Wall-clock seconds until the planning call's safety net (no net outside one)."""
    clock = _CLOCK.get()
    return math.inf if clock is None else clock.wall_left_s()


def mark_expired() -> None:
    """A solver hit the wall-clock safety net itself (HiGHS's ``time_limit``)."""
    clock = _CLOCK.get()
    if clock is not None:
        clock.expired = True


def expired() -> bool:
    clock = _CLOCK.get()
    return clock is not None and clock.expired


def expiry_note(config: SolverConfig) -> str:
    """The words a plan's reason gains when the safety net cut its solve short."""
    return (
        f"; the wall-clock safety net ({config.wall_limit():.0f} s) expired before the "
        "counted work limit: on a less busy machine this plan may differ"
    )


__all__ = [
    "Clock",
    "charge",
    "counted",
    "expired",
    "expiry_note",
    "mark_expired",
    "now",
    "planning",
    "wall_left_s",
]
