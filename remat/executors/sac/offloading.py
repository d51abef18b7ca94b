"""Which regions offload their inputs, and the plan with offload against the plan without.

A checkpointed region's activation inputs may wait in host memory from its forward to its
backward (:mod:`remat.executors.sac.offload`). Which ones: the earliest first (they wait
longest, and the step's peak, at the backward's start, holds them all), each checkpointed
and followed by another region (whose forward hides its copy-out and whose backward hides
its prefetch), while the host budget holds them all at once (no prefetch starts before the
forward ends, so every copy is in host memory together).

The planner then solves twice: without offload, and with it, every candidate plan traced
with its offload (the traces have the last word, as everywhere in this executor), the exact
MILP solving for the budget plus what offload frees (the dataflow it solves on knows no
copies; a traced plan over the budget is solved again for less). The cheaper traced plan
wins, its exposed copy time counted (:attr:`StepTrace.added_time_s`): where copies cannot
hide (a CPU device's host store copies synchronously), offload wins only where it lets the
plan recompute less by more than the copies cost, or where nothing fits without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from remat.executors.sac.policies import fixed_policies
from remat.executors.sac.regions import Policy
from remat.executors.sac.solution import NativeProblem, Solution, Tracer, added_ms, cost_of
from remat.executors.sac.trace import StepTrace
from remat.solver.config import BudgetError
from remat.solver.plan import fmt_bytes

__all__ = ["OffloadChoice", "choice_of", "offloading_tracer", "with_or_without"]


@dataclasses.dataclass(frozen=True)
class OffloadChoice:
    """Each region's input bytes (0: nothing to offload) and the host budget."""

    input_bytes: tuple[int, ...]
    host_budget_bytes: int

    def __call__(self, policies: Sequence[Policy]) -> tuple[bool, ...]:
        """The regions that offload under ``policies`` (see the module doc)."""
        flags = [False] * len(policies)
        used = 0
        for k, (policy, nbytes) in enumerate(zip(policies, self.input_bytes, strict=True)):
            last = k == len(policies) - 1
            if policy is None or last or not nbytes:
                continue
            if used + nbytes > self.host_budget_bytes:
                break
            flags[k] = True
            used += nbytes
        return tuple(flags)

    @property
    def headroom_bytes(self) -> int:
        """What offload frees at most: the inputs it takes with every region checkpointed."""
        chosen = self([frozenset()] * len(self.input_bytes))
        return sum(b for b, f in zip(self.input_bytes, chosen, strict=True) if f)


def choice_of(problem: NativeProblem, tracer: Tracer, host_budget_bytes: int) -> OffloadChoice:
    """Each region's input bytes, from one trace with every region recomputed and every
    region but the last offloading (:class:`OffloadChoice`)."""
    n = len(problem.blocks)
    probe = tracer(fixed_policies(problem, "block"), False, (True,) * (n - 1) + (False,))
    index = {path: k for k, path in enumerate(problem.blocks)}
    sizes = [0] * n
    for m in probe.copies:
        if m.kind == "out":
            sizes[index[m.region]] += m.nbytes
    return OffloadChoice(tuple(sizes), host_budget_bytes)


def offloading_tracer(tracer: Tracer, choice: OffloadChoice) -> Tracer:
    """``tracer`` with each plan's offload (:class:`OffloadChoice`)."""

    def traced(
        policies: Sequence[Policy], schedule: bool = True, offload: Sequence[bool] | None = None
    ) -> StepTrace:
        return tracer(policies, schedule, choice(policies) if offload is None else offload)

    return traced


def with_or_without(
    problem: NativeProblem,
    tracer: Tracer,
    host_budget_bytes: int,
    solve: Callable[[Tracer, int], Solution],
    progress: Callable[[str], object],
) -> Solution:
    """The cheaper of ``solve``'s plans without offload and with it (``solve(tracer,
    headroom_bytes)``); where neither fits, the error with the lower least peak."""
    plain: Solution | BudgetError
    try:
        plain = solve(tracer, 0)
    except BudgetError as e:
        plain = e
    choice = choice_of(problem, tracer, host_budget_bytes)
    if not choice.headroom_bytes:
        progress("native: no region input fits the host budget: no offload")
        if isinstance(plain, BudgetError):
            raise plain
        return plain
    progress(
        f"native: planning again with region inputs offloaded (up to "
        f"{fmt_bytes(choice.headroom_bytes)} of {fmt_bytes(host_budget_bytes)} on the host)"
    )
    try:
        offloaded = solve(offloading_tracer(tracer, choice), choice.headroom_bytes)
    except BudgetError as e:
        if isinstance(plain, BudgetError):
            raise (e if e.least_peak_bytes < plain.least_peak_bytes else plain) from None
        return _because(plain, f"with offload no plan fits ({e})")
    if isinstance(plain, BudgetError):
        return _because(offloaded, "nothing fits without offload")
    if not offloaded.trace.offloaded or cost_of(offloaded) >= cost_of(plain):
        return _because(
            plain,
            f"offload was not cheaper ({added_ms(offloaded)} against {added_ms(plain)} added)",
        )
    return _because(
        offloaded, f"{added_ms(offloaded)} added against {added_ms(plain)} without offload"
    )


def _because(solution: Solution, why: str) -> Solution:
    return dataclasses.replace(solution, reason=f"{solution.reason}; {why}")
