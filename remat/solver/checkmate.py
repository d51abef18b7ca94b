"""Checkmate's MILP (Jain et al., MLSys 2020) as a reference lower bound for small graphs.

Checkmate schedules the joint graph in *stages*, one per node in topological order; in stage
``t`` node ``t`` is computed and any earlier node may be (re)computed first. Binaries
``R[t, i]`` (computed in stage t), ``S[t, i]`` (in memory entering stage t) and ``FREE[t, i, k]``
(freed after node k of stage t), and memory ``U[t, k]`` after each computation. Unlike remat's
executor it may recompute a value several times, in any stage, and keep or drop it freely, so
over the same graph its optimum bounds remat's exact MILP from below. It is O(n^2) binaries:
use it on graphs of a few hundred nodes at most.

To keep it a *valid* lower bound under remat's accounting (and not just a similar number):

* memory is per node (the bytes it allocates; a tuple op's parts charged to the getitems that
  project them; a node kept alive by a kept view of it), freed after its last use
  in a stage unless kept, except what the simulator holds whatever the plan (user outputs and
  gradients to the end, tangents all backward, buffer updates to the end of the forward) —
  never more than the storage-level simulator charges at the same moment;
* a moment is checked with the new node's bytes allocated and its inputs still live, as the
  simulator does;
* forward ops the executor may skip (no output, buffer update or random op needs them) are not
  forced at their own stage; forward stages compute only their own node and cost nothing
  (remat counts recompute time only), and random ops are never recomputed;
* it runs on the view-merged problem (:mod:`remat.solver.compress`), whose optimum is remat's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pulp

from remat.problem import EXTERNAL_ROLES, Problem, Role
from remat.solver import clock
from remat.solver.backend import GAP_ABS, GAP_REL, backend, best_bound, objective_scale
from remat.solver.compress import _core, compress
from remat.solver.config import SolverConfig

KIB = 1024.0
"""Memory unit of the model (bytes would make the constraint matrix badly scaled)."""


@dataclass(frozen=True)
class CheckmateBound:
    lower_bound_s: float | None
    """A proven lower bound on the least recompute time under the budget (None: none found
    in time). ``inf`` when the budget is infeasible even for Checkmate."""
    objective_s: float | None
    """Recompute time of Checkmate's best schedule (None if none found)."""
    optimal: bool
    solve_s: float
    binaries: int


@clock.counted
def checkmate_bound(
    problem: Problem, *, budget_bytes: int, config: SolverConfig | None = None
) -> CheckmateBound:
    config = config or SolverConfig()
    t0 = time.perf_counter()
    c0 = clock.now()
    p = compress(problem).problem
    values = p.by_name
    core = _core(p)
    fwd = [v.name for v in p.values if v.role is Role.FORWARD]
    back = [v.name for v in p.values if v.role is Role.TANGENT] + [
        v.name for v in p.values if v.role is Role.BACKWARD
    ]
    order = fwd + back
    stage = {n: t for t, n in enumerate(order)}
    first_backward = len(fwd)
    n_stages = len(order)
    # alloc: bytes a node's op allocates; hold: bytes charged while the node is live. A tuple
    # op's storages are charged to the getitems that project them (they keep them alive after
    # the tuple itself is dropped), each storage to exactly one node.
    charge = {st: v.name for v in p.values for st in v.allocates}
    for v in p.values:
        if v.inputs and len(values[v.inputs[0]].allocates) > 1 and not v.allocates:
            for st in v.storages:
                if charge.get(st) == v.inputs[0]:
                    charge[st] = v.name
    held: dict[str, list[str]] = {}
    for st, n in charge.items():
        held.setdefault(n, []).append(st)
    alloc = {n: p.storages_bytes(values[n].allocates) / KIB for n in order}
    mem = {n: p.storages_bytes(held.get(n, ())) / KIB for n in order}
    deps = {
        n: [i for i in dict.fromkeys(values[n].inputs) if values[i].role not in EXTERNAL_ROLES]
        for n in order
    }
    users: dict[str, list[str]] = {n: [] for n in order}
    for n in order:
        for i in deps[n]:
            users[i].append(n)

    lp = pulp.LpProblem("checkmate", pulp.LpMinimize)

    def var(name: str, cat: str = "Binary") -> pulp.LpVariable:
        return lp.add_variable(name, 0, 1, cat=cat)

    # R[t, i]: forward stages compute only their own node; backward stages their own node and
    # any non-random forward node.
    R: dict[tuple[int, str], pulp.LpVariable | int] = {}
    for t, n in enumerate(order):
        forced = n in core or t >= first_backward
        R[t, n] = 1 if forced else var(f"R_{t}_{t}")
        if t >= first_backward:
            for i in fwd:
                if not values[i].never_recomputed:
                    R[t, i] = var(f"R_{t}_{stage[i]}")
    # S[t, i]: i live entering stage t (i computed in an earlier stage).
    # What the simulator holds whatever the plan: user outputs and gradients to the end of
    # the step, tangents all backward, new buffer values to the end of the forward.
    held_until = {n: n_stages for n in p.user_outputs}
    held_until |= {n: n_stages for n in p.grad_outputs if p.grads_held}
    held_until |= {v.name: n_stages for v in p.values if v.role is Role.TANGENT}
    held_until |= {n: first_backward for n in p.mutation_outputs}
    S: dict[tuple[int, str], pulp.LpVariable | int] = {}
    for t in range(1, n_stages):
        for i in order[:t]:
            S[t, i] = 1 if t < held_until.get(i, -1) else var(f"S_{t}_{stage[i]}")

    def r(t: int, i: str) -> pulp.LpVariable | int:
        return R.get((t, i), 0)

    def s(t: int, i: str) -> pulp.LpVariable | int:
        return S.get((t, i), 0)

    for t in range(n_stages):
        for i in order[: t + 1]:
            ri = r(t, i)
            if isinstance(ri, int) and ri == 0:
                continue
            for d in deps[i]:
                lp += ri <= r(t, d) + s(t, d)
        if t + 1 < n_stages:
            for i in order[: t + 1]:
                if not isinstance(S[t + 1, i], int):
                    lp += S[t + 1, i] <= s(t, i) + r(t, i)

    # A live view keeps its storage: in Checkmate terms, keeping a value that holds a storage
    # charged to another node keeps that node (which then may also be used without cost).
    for holder in order:
        for st in values[holder].storages:
            b = charge.get(st)
            if b is None or b == holder or b not in stage:
                continue
            for t in range(stage[holder] + 1, n_stages):
                sv, sb = s(t, holder), s(t, b)
                if not isinstance(sb, int) and not (isinstance(sv, int) and sv == 0):
                    lp += sb >= sv

    budget = budget_bytes / KIB
    for t in range(n_stages):
        computed = [i for i in order[: t + 1] if not (isinstance(r(t, i), int) and r(t, i) == 0)]
        u_prev: pulp.LpAffineExpression = pulp.lpSum(mem[i] * s(t, i) for i in order[:t])
        for k in computed:
            rk = r(t, k)
            lp += u_prev + alloc[k] * rk <= budget  # k allocated, its inputs still live
            frees = []
            for i in [*deps[k], k]:
                if mem[i] == 0:
                    continue
                later = [r(t, j) for j in users[i] if stage[j] > stage[k] and (t, j) in R]
                keep = s(t + 1, i) if t + 1 < n_stages else 0
                free = var(f"F_{t}_{stage[i]}_{stage[k]}")
                hazards = (1 - rk) + keep + pulp.lpSum(later)
                lp += 1 - free <= hazards
                lp += (2 + len(later)) * (1 - free) >= hazards
                frees.append(mem[i] * free)
            u = lp.add_variable(f"U_{t}_{stage[k]}", None, None)
            lp += u == u_prev + mem[k] * rk - pulp.lpSum(frees)
            u_prev = pulp.lpSum([u])

    scale = objective_scale([values[i].time_s for i in fwd])
    cost = pulp.lpSum(
        scale * values[i].time_s * R[t, i]
        for t in range(first_backward, n_stages)
        for i in fwd
        if (t, i) in R and not isinstance(R[t, i], int)
    )
    lp += cost
    # pulp stores binaries as integers in [0, 1].
    binaries = sum(1 for v in lp.variables() if v.cat == pulp.LpInteger)
    lp.solve(backend(config, config.time_limit_s, {}))
    if lp.status == pulp.LpStatusInfeasible:
        # Confirmed without presolve, which once called a feasible model infeasible.
        left = max(1.0, config.time_limit_s - (clock.now() - c0))
        lp.solve(backend(config, left, {}, presolve=False))
    elapsed = time.perf_counter() - t0
    if lp.status == pulp.LpStatusInfeasible:
        return CheckmateBound(float("inf"), None, True, elapsed, binaries)
    optimal = lp.sol_status == pulp.LpSolutionOptimal
    feasible = lp.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    objective = float(pulp.value(lp.objective) or 0.0) / scale if feasible else None
    if optimal:
        bound: float | None = max(0.0, (objective or 0.0) - GAP_ABS / scale) * (1 - GAP_REL)
    else:
        raw = best_bound(lp)
        bound = max(0.0, raw) / scale if raw is not None and raw == raw else None
    return CheckmateBound(bound, objective, optimal, elapsed, binaries)
