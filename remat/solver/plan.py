"""A plan: which forward values the backward gets saved, everything else being recomputed.

Solvers decide the saved set; :func:`make_plan` turns it into a complete, immutable record: the
schedule the executor will run, the simulated memory timeline and the recompute cost, and a
reason for every decision, so a report can say why each value is kept or recomputed.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from remat.problem import Problem
from remat.solver.executor import executor_of
from remat.solver.offload import Offload
from remat.solver.schedule import Schedule
from remat.solver.simulate import Simulation, simulate


class Proof(str, enum.Enum):
    """What the solver proved about a plan's recompute time under the budget it was solved
    for. Read it from :attr:`Plan.proof`, never from the reason text."""

    OPTIMAL = "optimal"
    """Proven least recompute time, for the executor and the budget: the exact MILP solved to
    optimality (within HiGHS's tolerances), a plan that recomputes nothing, or a plan whose
    cost meets a proven lower bound."""
    NEIGHBOURHOOD = "neighbourhood"
    """Optimal only within a restricted set of plans: the chain DP over per-block menus, or the
    exact MILP with only some values free (``exact(..., free=)``). Nothing is claimed about
    plans outside it."""
    TIME_LIMIT = "time_limit"
    """An optimizing solver stopped by its time limit: the best plan it had (maybe its start),
    with its dual bound in :attr:`Plan.lower_bound_s` when it has one."""
    HEURISTIC = "heuristic"
    """Rule-based or greedy (baselines, peak descent, roundings of the LP relaxation), or not
    known (a plan file written before plans recorded their proof): no optimality claim."""


STEP_WITHOUT_LOSS = (
    "the module's forward and a backward from a dense output gradient, the output alive "
    "until the backward ends (no loss_fn: the loss computed outside the module is not planned)"
)

STEP_WITH_LOSS = "the training step with its loss (loss_fn), the output freed before the backward"


@dataclass(frozen=True)
class Plan:
    saved: frozenset[str]
    """Forward values kept for the backward (names of the problem's values), as the
    executor runs the plan (:attr:`remat.solver.executor.ExecutorModel.kept`)."""
    solver: str
    reason: str
    """Why this plan was chosen, in one sentence."""
    proof: Proof
    """What is proven about its recompute time (:class:`Proof`)."""
    decisions: Mapping[str, str]
    """For every forward value the backward reads (directly or to recompute): why it is saved
    or recomputed."""
    schedule: Schedule
    simulation: Simulation
    lower_bound_s: float | None = None
    """A proven lower bound on the least recompute time under the same budget, when the
    solver has one (the exact MILP: its optimum, or its dual bound when time ran out; the LP
    rounding: the LP's; the chain solver: :mod:`remat.solver.bound`'s)."""
    step: str = ""
    """The step the predicted peak covers: with the user's loss (``loss_fn=``), or the
    forward and a backward from a dense output gradient (:data:`STEP_WITHOUT_LOSS`)."""
    device_memory: Mapping[str, int] | None = None
    """With a whole-device budget (``remat.optimize(..., budget_gb=)``): bytes per device of
    ``parameters``, ``gradient_shards``, ``optimizer_state``, ``reserve``, ``step_peak`` (this
    plan's predicted peak), ``total`` and ``budget``; see :mod:`remat.budget`."""

    @property
    def predicted_peak_bytes(self) -> int:
        """Peak bytes allocated during one training step (forward and backward, parameter
        gradients included; parameters and optimizer state excluded) at the allocator: live
        storages plus the running kernel's scratch, where it was measured
        (:mod:`remat.measure.scratch`; the problem's ``metadata["scratch"]`` says where).
        Budgets are enforced against it."""
        return self.simulation.peak_bytes

    @property
    def predicted_tensor_peak_bytes(self) -> int:
        """The same peak without kernel scratch: what a live-storage meter measures."""
        return self.simulation.tensor_peak_bytes

    @property
    def saved_bytes(self) -> int:
        return self.simulation.saved_bytes

    @property
    def recompute_flops(self) -> int:
        return self.simulation.recompute_flops

    @property
    def recompute_time_s(self) -> float:
        return self.simulation.recompute_time_s

    @property
    def added_time_s(self) -> float:
        """Recompute time and the executor's own dispatch (``sac``): what the plan adds."""
        return self.simulation.added_time_s

    @property
    def recomputed(self) -> tuple[str, ...]:
        return self.schedule.recomputed

    @property
    def offloaded(self) -> tuple[str, ...]:
        """Saved values copied to host memory after the forward and back before the backward
        reads them (:mod:`remat.solver.offload`); empty without a host budget."""
        return tuple(o.value for o in self.schedule.offloaded)

    @property
    def offloaded_bytes(self) -> int:
        return self.simulation.offloaded_bytes

    @property
    def predicted_host_peak_bytes(self) -> int:
        """Host memory the offloaded values take at once, at most (the host budget bounds it)."""
        return self.simulation.host_peak_bytes

    @property
    def step_time_s(self) -> float:
        """The step's predicted time: forward, backward with recomputation, the executor's
        dispatch and the copy time not hidden behind compute."""
        return self.simulation.step_time_s

    @property
    def proof_text(self) -> str:
        """What is proven, for people: ``optimal``, ``within 3.1% of the floor`` (its recompute
        time against its proven lower bound), or the kind of plan with ``no floor``. Read from
        :attr:`proof` and :attr:`lower_bound_s`, never from the reason text."""
        proof = proven(self)
        if proof is Proof.OPTIMAL:
            return "optimal"
        bound = self.lower_bound_s
        if bound is not None and bound > 0:
            return f"within {self.recompute_time_s / bound - 1:.1%} of the floor"
        return {
            Proof.NEIGHBOURHOOD: "optimal in its neighbourhood, no floor",
            Proof.TIME_LIMIT: "time limit, no floor",
        }.get(proof, "heuristic, no floor")

    def summary(self) -> str:
        sim = self.simulation
        overhead = sim.added_time_s / sim.step_time_s if sim.step_time_s else 0.0
        dispatch = sim.dispatch_time_s
        return (
            f"plan {self.solver!r}: predicted peak {fmt_bytes(sim.peak_bytes)} "
            f"(at {sim.peak_step}); saved for backward {fmt_bytes(sim.saved_bytes)} "
            f"in {len(self.schedule.saved)} values; {len(self.schedule.recomputed)} ops "
            f"recomputed, {sim.recompute_flops / 1e9:.3f} GFLOP, "
            f"{overhead:.1%} of the estimated step time"
            + (f" with SAC's dispatch ({dispatch * 1e3:.3f} ms)" if dispatch else "")
            + (
                f"; {len(self.offloaded)} saved values offloaded "
                f"({fmt_bytes(sim.offloaded_bytes)} in host memory at most, "
                f"{sim.copy_exposed_s * 1e3:.3f} ms of copies not hidden)"
                if self.offloaded
                else ""
            )
            + f"; {self.proof_text}"
            + (f"; the peak covers {self.step}" if self.step else "")
            + f". {self.reason}"
        )


def make_plan(
    problem: Problem,
    saved: Iterable[str],
    *,
    solver: str,
    reason: str,
    proof: Proof,
    why_saved: Mapping[str, str] | None = None,
    lower_bound_s: float | None = None,
    offloads: Iterable[Offload] = (),
) -> Plan:
    """Schedule and simulate ``saved``, of which ``offloads`` go to host memory and back;
    raises :class:`InvalidPlanError` (or :class:`remat.solver.offload.OffloadError`) if it
    cannot run."""
    saved_set = frozenset(saved)
    executor = executor_of(problem)
    schedule = executor.schedule(problem, saved_set)
    offloads = tuple(offloads)
    if offloads:
        schedule = dataclasses.replace(schedule, offloaded=offloads)
    why_saved = why_saved or {}
    decisions = {n: why_saved.get(n, "saved") for n in schedule.saved}
    for n in schedule.recomputed:
        decisions[n] = "recomputed: not saved by the plan"
    for o in offloads:
        decisions[o.value] = (
            f"offloaded: copied to host memory after {o.wait}, back from before {o.prefetch}"
        )
    return Plan(
        saved=executor.kept(problem, saved_set, schedule),
        solver=solver,
        reason=reason,
        proof=proof,
        decisions=decisions,
        schedule=schedule,
        simulation=simulate(problem, schedule),
        lower_bound_s=lower_bound_s,
    )


def floor_of(plans: Iterable[Plan]) -> float | None:
    """The best (largest) proven lower bound on the recompute time among ``plans`` solved for
    one budget (a proven optimum's cost is one): it holds for every plan at that budget."""
    bounds: list[float] = []
    for p in plans:
        if p.lower_bound_s is not None:
            bounds.append(p.lower_bound_s)
        if proven(p) is Proof.OPTIMAL:
            bounds.append(p.recompute_time_s)
    return max(bounds) if bounds else None


def gap_text(plan: Plan, floor: float | None) -> str:
    """``opt`` when ``plan`` is proven least (its own proof, or its cost at ``floor``),
    ``+3.1%`` above a positive ``floor``, empty without one."""
    cost = plan.recompute_time_s
    if proven(plan) is Proof.OPTIMAL or (floor is not None and cost <= floor * (1 + 1e-9)):
        return "opt"
    if floor is not None and floor > 0:
        return f"+{cost / floor - 1:.1%}"
    return ""


def proven(plan: Plan) -> Proof:
    """``plan``'s proof, or :attr:`Proof.OPTIMAL` when its recompute time meets its proven
    lower bound (or is zero: no plan costs less), unless it offloads."""
    if plan.schedule.offloaded:  # its cost is copies too, which no bound covers
        return plan.proof
    cost = plan.recompute_time_s
    bound = plan.lower_bound_s
    if cost == 0 or (bound is not None and cost <= bound * (1 + 1e-9) + 1e-12):
        return Proof.OPTIMAL
    return plan.proof


def fmt_bytes(n: float) -> str:
    """Binary units at one decimal (``1.5 MiB``), for progress lines and plan summaries."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"
