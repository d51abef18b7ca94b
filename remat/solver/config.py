"""Configuration every solver receives, and the error a budget too small raises."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal


class BudgetError(ValueError):
    """No plan fits the requested budget; the message states the least feasible peak.

    ``least_peak_bytes`` is the least peak of a plan remat found (a budget of that size works)
    unless ``achievable`` is False: then it is only a proven lower bound (the exact solver ran
    out of time and no heuristic plan was at hand).
    """

    def __init__(
        self, budget_bytes: int, least_peak_bytes: int, detail: str = "", *, achievable: bool = True
    ) -> None:
        self.budget_bytes = budget_bytes
        self.least_peak_bytes = least_peak_bytes
        self.achievable = achievable
        self.hints: tuple[str, ...] = ()
        what = "the least feasible peak" if achievable else "a lower bound on every plan's peak"
        super().__init__(
            f"activation budget {budget_bytes:,} B ({budget_bytes / 2**30:.3f} GiB) is below "
            f"{what}, {least_peak_bytes:,} B ({least_peak_bytes / 2**30:.3f} GiB)"
            + (f" ({detail})" if detail else "")
        )

    def add_hint(self, hint: str) -> None:
        """Append ``hint`` (what would make a plan fit) to the message: the caller that
        catches this knows the training setup behind the least peak, the solver that raised
        it does not."""
        self.hints += (hint,)
        self.args = (f"{self.args[0]}. {hint}",)


SolverName = Literal[
    "auto",
    "exact",
    "lp_round",
    "chain",
    "block",
    "megatron",
    "chen_sqrt",
    "chen_greedy",
    "keep_all",
    "keep_inputs",
    "keep_matmuls",
]
"""Every name ``solver=`` takes (:data:`remat.solver.registry.SOLVERS` and ``auto``)."""

WALL_FACTOR = 5.0
"""The default wall-clock safety net is this many times ``time_limit_s`` (counted work) ..."""
WALL_EXTRA_S = 30.0
"""... plus this much: a busy or slow machine takes longer for the same work, and not every
step of planning is counted."""


@dataclass(frozen=True, kw_only=True)
class SolverConfig:
    time_limit_s: float = 60.0
    """Work an optimizing solver may do before it returns its best plan and proven gap, in
    reference seconds: counted (simplex iterations, branch-and-bound nodes, simulated steps,
    :mod:`remat.solver.clock`), not read from the clock, so the same request gives the same
    plan on a busy machine, about as many seconds as this on an idle one. ``exact`` and
    ``auto`` run the heuristics, the LP rounding and the MILP within it; where the MILP
    proves nothing in it, the chain solver runs with this limit too (on models with
    repeated blocks), so no solver's plan is cheaper than theirs: up to twice the limit in
    all."""
    wall_limit_s: float | None = None
    """The wall-clock safety net of one planning call: past it every solver stops with its
    best plan, and the plan's reason says the net expired (that plan may differ from run to
    run). None: ``WALL_FACTOR * time_limit_s + WALL_EXTRA_S``."""
    backend: str = "auto"
    """MILP backend: ``highs``, ``cbc`` or ``auto`` (HiGHS when installed)."""
    block_types: tuple[str, ...] = ()
    """Module class names (e.g. ``GPT2Block``) or paths with ``*`` (e.g. ``layers.*``) that the
    block baseline checkpoints; empty: the repeated children of the largest ModuleList."""
    progress: Callable[[str], None] | None = None
    """Called with a short status line during long solves."""
    max_milp_values: int = 1500
    """``auto`` skips the flat LP and MILP above this many forward values (after compression):
    building them would take minutes and gigabytes (GPT-2 small has ~800)."""
    floor_time_s: float = 0.0
    """Seconds the chain solver spends, on top of ``time_limit_s``, on a tighter floor under
    its plan: the blocks' exact fronts at the head of the backward
    (:mod:`remat.solver.block_bound`; 0: only the backward's moments,
    :mod:`remat.solver.bound`, within the time limit)."""

    def wall_limit(self) -> float:
        """:attr:`wall_limit_s`, or its default for this ``time_limit_s``."""
        if self.wall_limit_s is not None:
            return self.wall_limit_s
        return WALL_FACTOR * self.time_limit_s + WALL_EXTRA_S

    def __post_init__(self) -> None:
        if self.time_limit_s <= 0:
            raise ValueError("time_limit_s must be positive")
        if self.wall_limit_s is not None and self.wall_limit_s <= 0:
            raise ValueError("wall_limit_s must be positive (or None for the default)")
        if self.floor_time_s < 0:
            raise ValueError("floor_time_s must be 0 or more")
        if self.backend not in ("auto", "highs", "cbc"):
            raise ValueError(f"unknown MILP backend {self.backend!r}; valid: auto, highs, cbc")
