"""A lower bound on recompute time that scales to 70B graphs: the moment the backward starts.

When the backward starts (:mod:`remat.solver.simulate`), every saved value, every user output
and every output gradient is live. So a plan whose peak fits a budget ``B`` has

    bytes(storages of the saved values and the user outputs) + bytes(output gradients) <= B,

and it recomputes, once each, what the backward reads and it did not save, with whatever those
recomputations read in turn. Keeping only that moment of the step leaves a MILP with one binary
per forward value and no time index -- small enough for a 70B Llama, whose exact MILP cannot
even be built -- and its optimum, or any dual bound HiGHS proves for it, is a lower bound on the
recompute time of every plan that fits ``B``. The chain solver records it, so a plan for a
large model says how far from the optimum it can at most be.

It is weak where the peak is elsewhere (inside the backward, when recomputation and gradients
pile up): it sees none of that.
"""

from __future__ import annotations

import math

import pulp

from remat.problem import Problem, Role
from remat.solver.backend import backend, best_bound, objective_scale
from remat.solver.config import SolverConfig


def backward_start_bound(problem: Problem, budget_bytes: int, config: SolverConfig) -> float | None:
    """Seconds of recomputation every plan that fits ``budget_bytes`` needs at least; ``None``
    if the solver proved nothing in ``config.time_limit_s`` (or no plan can fit: then the
    budget is below the least peak, which the solvers report themselves)."""
    values = problem.by_name
    forward = [v for v in problem.values if v.role is Role.FORWARD]
    fwd = {v.name for v in forward}
    # Live whatever the plan: user outputs and output gradients (each storage counted once).
    held = {s for n in problem.user_outputs for s in values[n].storages}
    held |= {s for v in problem.values if v.role is Role.TANGENT for s in v.storages}
    fixed = problem.storages_bytes(held)
    if fixed > budget_bytes:
        return None
    scale = objective_scale([v.time_s for v in forward])
    lp = pulp.LpProblem("backward_start", pulp.LpMinimize)
    names = sorted(fwd)
    saved = {n: lp.add_variable(f"s{k}", 0, 1, cat=pulp.LpBinary) for k, n in enumerate(names)}
    # Recomputation may be fractional: a relaxation of a relaxation is still a lower bound.
    redo = {
        n: lp.add_variable(f"r{k}", 0, 0 if values[n].random else 1) for k, n in enumerate(names)
    }
    lp += pulp.lpSum(scale * values[n].time_s * redo[n] for n in fwd)
    for n in problem.backward_reads:
        lp += saved[n] + redo[n] >= 1
    for n in fwd:
        for i in values[n].inputs:
            if i in fwd:
                lp += saved[i] + redo[i] >= redo[n]
    live: dict[str, pulp.LpVariable] = {}
    for n in names:
        for s in values[n].storages:
            if s in held or problem.storage_bytes.get(s, 0) == 0:
                continue
            if s not in live:
                live[s] = lp.add_variable(f"m{len(live)}", 0, 1)
            lp += live[s] >= saved[n]
    lp += pulp.lpSum(problem.storage_bytes[s] * x for s, x in live.items()) <= budget_bytes - fixed
    lp.solve(backend(config, max(1.0, config.time_limit_s), {}))
    # The dual bound, not the objective: "optimal" means within the solver's relative gap.
    raw = best_bound(lp) if pulp.LpStatus[lp.status] != "Infeasible" else None
    if raw is None or not math.isfinite(raw):
        return None
    return max(0.0, raw) / scale
