"""Configuration every solver receives, and the error a budget too small raises."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


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


@dataclass(frozen=True, kw_only=True)
class SolverConfig:
    time_limit_s: float = 60.0
    """Wall-clock limit of an optimizing solver; it returns its best plan and proven gap.
    ``exact`` and ``auto`` run the heuristics, the LP rounding and the MILP within it; where
    the MILP proves nothing in that time, the chain solver runs with this limit too (on
    models with repeated blocks), so no solver's plan is cheaper than theirs: up to twice the
    limit in all."""
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

    def __post_init__(self) -> None:
        if self.time_limit_s <= 0:
            raise ValueError("time_limit_s must be positive")
        if self.floor_time_s < 0:
            raise ValueError("floor_time_s must be 0 or more")
        if self.backend not in ("auto", "highs", "cbc"):
            raise ValueError(f"unknown MILP backend {self.backend!r}; valid: auto, highs, cbc")
