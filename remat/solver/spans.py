"""The MILP for executors whose lifetimes do not depend on the plan: a multi-moment knapsack.

Under PyTorch's checkpoint (the ``sac`` executor) a region is replayed at its first backward
op whatever its policy keeps, so keeping a value changes only that value's life: it holds its
bytes from where the plan keeping nothing would free it after the forward to where that plan
would make it again (:class:`remat.solver.executor.Lifetime`), and saves its recompute time.
With one binary ``s[v]`` per candidate the memory at every moment is linear:

    base[m] + sum_v held[v, m] * s[v] <= budget    for every moment m,

and the objective, recompute time, is ``sum time[v] * (1 - s[v])``. A 7B model has tens of
thousands of moments and a 70B one thousands of candidates: written as they stand, the rows
are dense (every candidate held across a moment is in its row; on a 70B Llama, millions of
nonzeros, which took minutes to build and solve). Between two ends of lifetimes every moment
holds the same candidates, so only the one of most base bytes is written, and only where
keeping everything could exceed the budget there; and each row is a running sum, the row
before plus the candidates whose lifetimes start since, less those that ended since:

    m[i] = m[i - 1] + sum_{v starts} held[v] * s[v] - sum_{v ended} held[v] * s[v]
    m[i] <= budget - base[moment i]

Each lifetime's piece is in two rows at most, and the model is the same (the same solutions,
the same LP relaxation). On Llama-70B (3,129 candidates) it solves to a 0.1% gap in about 2
seconds where the rows written lazily took minutes. The model is only as exact as the
lifetimes (the executor's simulation of the plan that keeps nothing): :func:`solve_spans`
simulates its plan, and if that is over the budget, solves again for a budget smaller by
the excess. The rounds before one's plan fits are solved to a looser gap
(:data:`SCOUT_GAP`), that one again to :data:`GAP`.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict

import numpy as np
import pulp

from remat.problem import Problem
from remat.solver import clock
from remat.solver.backend import backend, objective_scale
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.executor import Lifetimes, executor_of
from remat.solver.plan import Plan, Proof, fmt_bytes, make_plan, proven

ROUNDS = 12
"""Solves per call, each for a budget smaller by the last plan's simulated excess."""
LEVELS = 16
"""Most thresholds the LP rounding simulates."""
GAP = 1e-3
"""Relative gap at which the MILP stops, in its objective: the recompute time the plan saves.
On a Llama-7B's dataflow (bf16-fsdp, ZeRO-3 x 8, 40 GB, 1,257 candidates) 0.1% of the 73 ms
saved is 1.4% of the 5.35 ms recomputed, and HiGHS found its solution in 1.4 s and took 17 s
to prove that gap; the model itself is further than 0.1% from the executor (its plans are
simulated, then traced)."""
UNIT = float(1 << 20)
"""Rows are written in MiB: byte-sized coefficients (up to 1e10) leave the solver's
feasibility tolerance meaningless."""
SCOUT_GAP = 5e-2
"""Relative gap of the MILP's rounds until one's plan fits (then solved again to :data:`GAP`
from it): those rounds only find how far below the budget the model must aim. On a 7B
Llama's sub-modules (1,289 candidates, 24 GB) HiGHS found its plan at a 1.04% gap in 0.8 s
and took 12 s more to prove 1%: the polish from that plan, not the scout, narrows it."""
POLISH_WORK_S = 4.0
"""Counted seconds of work (:mod:`remat.solver.clock`) the polish to :data:`GAP` may take at
most. Its branch and bound starts from the scout's plan, so a polish stopped by this limit
returns that plan or a cheaper one. The limit also changes how HiGHS searches. On the 7B
Llama's sub-modules (above) the polish proved the same optimum in 1.4 s with 4 s of work,
and took 8.2 s with the 59 s a call's default limit leaves. On the 70B preset (3,129
candidates, 80 GB) it took 1.7 s either way."""


class _Held:
    """The bytes each candidate holds at each moment, for rows and for evaluating plans."""

    def __init__(self, lt: Lifetimes) -> None:
        rows = [(k, n, a, b) for k, c in enumerate(lt.candidates) for n, a, b in c.pieces]
        self.k = np.array([r[0] for r in rows], dtype=np.int64)
        self.n = np.array([r[1] for r in rows], dtype=np.float64)
        self.a = np.array([r[2] for r in rows], dtype=np.int64)
        self.b = np.array([r[3] for r in rows], dtype=np.int64)
        self.base = np.array(lt.base, dtype=np.float64)
        # Between two piece ends every moment holds the same candidates: the one of most
        # base bytes there stands for all (its row implies theirs).
        ends = np.unique(np.concatenate([[0, len(self.base)], self.a, self.b + 1]))
        self.rep = np.empty(len(self.base), dtype=np.int64)
        for a, b in zip(ends[:-1], ends[1:], strict=True):
            if a < b <= len(self.base):
                self.rep[a:b] = a + int(np.argmax(self.base[a:b]))

    def memory(self, x: np.ndarray, positive: bool = False) -> np.ndarray:
        """Bytes at every moment with candidate ``k`` kept to the extent ``x[k]``
        (``positive``: its pieces that hold more than keeping nothing alone, which bounds
        every plan's memory from above)."""
        delta = np.zeros(len(self.base) + 1)
        w = x[self.k] * (np.maximum(self.n, 0) if positive else self.n)
        np.add.at(delta, self.a, w)
        np.add.at(delta, self.b + 1, -w)
        return self.base + np.cumsum(delta)[:-1]


def _model(
    lt: Lifetimes, held: _Held, budget: int, relax: bool
) -> tuple[pulp.LpProblem, list[pulp.LpVariable]]:
    """The objective, the exclusions, and the memory rows through running sums (the module
    docstring)."""
    lp = pulp.LpProblem("remat_spans", pulp.LpMinimize)
    cat = "Continuous" if relax else "Binary"
    cands = lt.candidates
    s = [lp.add_variable(f"s{k}", 0, 1, cat=cat) for k in range(len(cands))]
    scale = objective_scale([c.time_s for c in cands])
    size = [max((n for n, _, _ in c.pieces), default=0) for c in cands]
    total = max(1, sum(size))
    # Ties go to fewer kept bytes (worth less than the smallest time step).
    lp += pulp.lpSum(
        (-c.time_s * scale + 1e-3 * size[k] / total) * s[k] for k, c in enumerate(cands)
    )
    groups: dict[str, list[int]] = defaultdict(list)
    for k, c in enumerate(cands):
        if not c.whole_group:
            groups[c.group].append(k)
    for k, c in enumerate(cands):
        if c.whole_group and groups[c.group]:
            members = groups[c.group]
            lp += pulp.lpSum(s[j] for j in members) <= len(members) * (1 - s[k])
    _memory_rows(lp, s, held, budget)
    return lp, s


def _memory_rows(lp: pulp.LpProblem, s: list[pulp.LpVariable], held: _Held, budget: int) -> None:
    """One running sum per moment that can exceed the budget (of those between two piece
    ends, the one of most base bytes), each the previous one plus the pieces that start
    since and less those that ended, bounded by the budget less the moment's base bytes."""
    reps = np.unique(held.rep)
    most = held.memory(np.ones(len(s)), positive=True)
    moments = [int(m) for m in reps if most[m] > budget]
    if not moments:
        return
    order = np.asarray(moments)
    # Each piece enters the first running sum at or after its start, and leaves the first
    # one past its end; a piece between two of them enters none.
    enter = np.searchsorted(order, held.a, side="left")
    leave = np.searchsorted(order, held.b, side="right")
    terms: list[dict[int, float]] = [defaultdict(float) for _ in moments]
    for k, n, i, j in zip(
        held.k.tolist(), held.n.tolist(), enter.tolist(), leave.tolist(), strict=True
    ):
        if i < j:  # alive at moments[i..j-1]
            terms[i][k] += n / UNIT
            if j < len(moments):
                terms[j][k] -= n / UNIT
    previous = None
    for i, m in enumerate(moments):
        total = lp.add_variable(f"m{i}", None, (budget - held.base[m]) / UNIT)
        row = [(total, -1.0)] + [(s[k], c) for k, c in terms[i].items() if c]
        if previous is not None:
            row.append((previous, 1.0))
        lp += pulp.LpAffineExpression(row) == 0
        previous = total


def _solve(
    lt: Lifetimes,
    held: _Held,
    budget: int,
    relax: bool,
    config: SolverConfig,
    deadline: float,
    gap: float = GAP,
    start: list[float] | None = None,
) -> tuple[list[float], bool] | None:
    """The model's optimum within ``gap`` (values of ``s``), warm-started from ``start``,
    and whether the gap was closed (not where the work limit stopped the solver first); None
    when infeasible or out of time before a solution."""
    lp, s = _model(lt, held, budget, relax)
    warm = {x: round(v) for x, v in zip(s, start, strict=True)} if start else {}
    left = deadline - clock.now()
    if left <= 0:
        return None
    lp.solve(backend(config, max(1.0, left), warm, gap_rel=gap))
    values = [x.value() for x in s]
    status = pulp.LpStatus[lp.status]
    if status not in ("Optimal", "Not Solved") or None in values:
        return None
    return [float(v) for v in values], status == "Optimal"


def _plans(
    problem: Problem, lt: Lifetimes, values: list[float], relax: bool, reason: str
) -> list[Plan]:
    """The plans a solution of the model stands for, simulated: the MILP's, or the LP's
    rounded at each of its distinct values (at most :data:`LEVELS`)."""
    name = "lp_round" if relax else "exact"
    levels = sorted({v for v in values if v > 1e-6}) if relax else [0.5]
    if len(levels) > LEVELS:  # each level is a simulation: take quantiles
        levels = [levels[i * (len(levels) - 1) // (LEVELS - 1)] for i in range(LEVELS)]
    plans = []
    for level in levels:
        kept = {c.name for c, x in zip(lt.candidates, values, strict=True) if x >= level}
        # Solved to a relative gap, and maybe for less than the budget: no proof.
        plans.append(
            make_plan(problem, kept | lt.forced, solver=name, reason=reason, proof=Proof.HEURISTIC)
        )
    return plans


@clock.counted
def solve_spans(
    problem: Problem, *, budget_bytes: int | None, config: SolverConfig, relax: bool = False
) -> Plan:
    """Least recompute time under ``budget_bytes`` for an executor with fixed lifetimes.
    ``relax``: solve the LP relaxation instead and round it, Checkmate's way: keep the
    candidates at or above each distinct fractional value in turn, simulate each, and take
    the cheapest that fits. Either is re-solved for less while its simulation is over."""
    ex = executor_of(problem)
    if ex.lifetimes is None:
        raise ValueError(f"the {ex.name} executor's lifetimes depend on the plan: use 'exact'")
    name = "lp_round" if relax else "exact"
    t0 = time.perf_counter()
    lt = ex.lifetimes(problem)
    everything = {c.name for c in lt.candidates if not c.whole_group} | lt.forced
    if budget_bytes is None:
        plan = make_plan(
            problem,
            everything,
            solver=name,
            reason="no budget: keep every candidate",
            proof=Proof.HEURISTIC,
        )
        return dataclasses.replace(plan, proof=proven(plan))
    least = make_plan(problem, lt.forced, solver=name, reason="", proof=Proof.HEURISTIC)
    target = budget_bytes
    held = _Held(lt)
    deadline = clock.now() + config.time_limit_s
    for round_ in range(ROUNDS):
        if max(lt.base, default=0) > target:
            break
        gap = GAP if relax else SCOUT_GAP
        solved = _solve(lt, held, target, relax, config, deadline, gap)
        if solved is None:
            break  # infeasible for this budget, or out of time
        found, closed = solved

        def reason(gap: float, closed: bool, round_: int = round_) -> str:
            to = f"to a {gap:.1%} gap" if closed else f"its work limit before a {gap:.1%} gap"
            how = "LP relaxation, rounded" if relax else f"MILP ({to} in the time saved)"
            return (
                f"{how} over {len(lt.candidates)} candidates' fixed lifetimes ({ex.name} "
                f"executor), round {round_ + 1}, {time.perf_counter() - t0:.1f} s"
            )

        plans = _plans(problem, lt, found, relax, reason(gap, closed))
        fitting = [p for p in plans if p.predicted_peak_bytes <= budget_bytes]
        if fitting and not relax:
            polish_by = min(deadline, clock.now() + POLISH_WORK_S)
            polished = _solve(lt, held, target, relax, config, polish_by, GAP, found)
            if polished is not None:
                plans = _plans(problem, lt, polished[0], relax, reason(GAP, polished[1]))
                # First: on a tie the polished plan is returned, under the gap it was
                # solved to.
                fitting[:0] = [p for p in plans if p.predicted_peak_bytes <= budget_bytes]
        if config.progress:
            config.progress(
                f"{name} round {round_ + 1}: simulated peak "
                f"{fmt_bytes(min(p.predicted_peak_bytes for p in plans))} for a budget of "
                f"{fmt_bytes(budget_bytes)} (the model's {fmt_bytes(target)})"
            )
        if fitting:
            # Rounded: the same plan's time summed in another order is no cheaper.
            return min(fitting, key=lambda p: (round(p.added_time_s, 12), p.predicted_peak_bytes))
        target -= min(p.predicted_peak_bytes for p in plans) - budget_bytes
    if least.predicted_peak_bytes <= budget_bytes:
        return dataclasses.replace(
            least, reason="keeps only what must be kept: the model found nothing that fits"
        )
    raise BudgetError(budget_bytes, least.predicted_peak_bytes, f"{name} ({ex.name})")


__all__ = ["solve_spans"]
