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
from collections.abc import Mapping
from dataclasses import dataclass

import pulp

from remat.problem import EXTERNAL_ROLES, Problem, Role, Value
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
    """Checkmate's MILP on ``problem`` under ``budget_bytes``, solved within
    ``config.time_limit_s``: a lower bound on remat's least recompute time (module docstring)."""
    config = config or SolverConfig()
    t0 = time.perf_counter()
    c0 = clock.now()
    g = _graph(compress(problem).problem)
    lp = pulp.LpProblem("checkmate", pulp.LpMinimize)
    x = _Vars(R=_compute_vars(lp, g), S=_keep_vars(lp, g))
    _dependency_rows(lp, g, x)
    _view_rows(lp, g, x)
    _memory_rows(lp, g, x, budget_bytes / KIB)
    scale = objective_scale([g.values[i].time_s for i in g.fwd])
    lp += _cost(g, x, scale)
    # pulp stores binaries as integers in [0, 1].
    binaries = sum(1 for v in lp.variables() if v.cat == pulp.LpInteger)
    _solve(lp, config, c0)
    return _result(lp, scale, time.perf_counter() - t0, binaries)


@dataclass(frozen=True)
class _Graph:
    """The view-merged problem in Checkmate's terms: its nodes in stage order and the bytes
    each allocates and holds, in :data:`KIB`."""

    problem: Problem
    """The view-merged problem (:func:`~remat.solver.compress.compress`)."""
    values: Mapping[str, Value]
    core: set[str]
    """Nodes the executor computes whatever the plan (:func:`~remat.solver.compress._core`)."""
    fwd: list[str]
    order: list[str]
    """Forward nodes, then tangents, then backward nodes: one stage each."""
    stage: dict[str, int]
    first_backward: int
    charge: dict[str, str]
    """Each storage's node: the one whose liveness keeps it."""
    alloc: dict[str, float]
    """Bytes a node's op allocates..."""
    mem: dict[str, float]
    """...and bytes charged while it is live."""
    deps: dict[str, list[str]]
    """A node's inputs that are nodes (not parameters or inputs), each once..."""
    users: dict[str, list[str]]
    """...and the nodes that read it."""

    @property
    def n_stages(self) -> int:
        return len(self.order)


def _graph(p: Problem) -> _Graph:
    """``p``'s stages and bytes, read by every group of rows: computed once, before any
    variable, so that the rows only read them."""
    values = p.by_name
    core = _core(p)
    fwd = [v.name for v in p.values if v.role is Role.FORWARD]
    back = [v.name for v in p.values if v.role is Role.TANGENT] + [
        v.name for v in p.values if v.role is Role.BACKWARD
    ]
    order = fwd + back
    charge = _charges(p)
    held: dict[str, list[str]] = {}
    for st, n in charge.items():
        held.setdefault(n, []).append(st)
    deps = {
        n: [i for i in dict.fromkeys(values[n].inputs) if values[i].role not in EXTERNAL_ROLES]
        for n in order
    }
    users: dict[str, list[str]] = {n: [] for n in order}
    for n in order:
        for i in deps[n]:
            users[i].append(n)
    return _Graph(
        problem=p,
        values=values,
        core=core,
        fwd=fwd,
        order=order,
        stage={n: t for t, n in enumerate(order)},
        first_backward=len(fwd),
        charge=charge,
        alloc={n: p.storages_bytes(values[n].allocates) / KIB for n in order},
        mem={n: p.storages_bytes(held.get(n, ())) / KIB for n in order},
        deps=deps,
        users=users,
    )


def _charges(p: Problem) -> dict[str, str]:
    """Each storage's node. A tuple op's storages are charged to the getitems that project
    them, as they keep them alive after the tuple itself is dropped: each storage to exactly
    one node, so that no moment counts more than the simulator."""
    values = p.by_name
    charge = {st: v.name for v in p.values for st in v.allocates}
    for v in p.values:
        if v.inputs and len(values[v.inputs[0]].allocates) > 1 and not v.allocates:
            for st in v.storages:
                if charge.get(st) == v.inputs[0]:
                    charge[st] = v.name
    return charge


@dataclass(frozen=True)
class _Vars:
    """Checkmate's ``R`` and ``S`` (module docstring), each 1 where the plan has no choice;
    a pair not in them is 0, which keeps the model to the stages where a choice exists."""

    R: dict[tuple[int, str], pulp.LpVariable | int]
    S: dict[tuple[int, str], pulp.LpVariable | int]

    def r(self, t: int, i: str) -> pulp.LpVariable | int:
        return self.R.get((t, i), 0)

    def s(self, t: int, i: str) -> pulp.LpVariable | int:
        return self.S.get((t, i), 0)


def _binary(lp: pulp.LpProblem, name: str) -> pulp.LpVariable:
    """Every choice of Checkmate's is a binary; only the memory ``U`` is continuous."""
    return lp.add_variable(name, 0, 1, cat="Binary")


def _compute_vars(lp: pulp.LpProblem, g: _Graph) -> dict[tuple[int, str], pulp.LpVariable | int]:
    """``R[t, i]``: forward stages compute only their own node (forced unless the executor
    may skip it); backward stages their own node and any non-random forward node."""
    R: dict[tuple[int, str], pulp.LpVariable | int] = {}
    for t, n in enumerate(g.order):
        forced = n in g.core or t >= g.first_backward
        R[t, n] = 1 if forced else _binary(lp, f"R_{t}_{t}")
        if t >= g.first_backward:
            for i in g.fwd:
                if not g.values[i].never_recomputed:
                    R[t, i] = _binary(lp, f"R_{t}_{g.stage[i]}")
    return R


def _keep_vars(lp: pulp.LpProblem, g: _Graph) -> dict[tuple[int, str], pulp.LpVariable | int]:
    """``S[t, i]``: ``i`` live entering stage ``t`` (``i`` computed in an earlier stage), fixed
    to 1 while the simulator holds it whatever the plan, so that no moment counts less."""
    p, n_stages = g.problem, g.n_stages
    # User outputs and gradients to the end of the step, tangents all backward, new buffer
    # values to the end of the forward.
    held_until = {n: n_stages for n in p.user_outputs}
    held_until |= {n: n_stages for n in p.grad_outputs if p.grads_held}
    held_until |= {v.name: n_stages for v in p.values if v.role is Role.TANGENT}
    held_until |= {n: g.first_backward for n in p.mutation_outputs}
    S: dict[tuple[int, str], pulp.LpVariable | int] = {}
    for t in range(1, n_stages):
        for i in g.order[:t]:
            S[t, i] = 1 if t < held_until.get(i, -1) else _binary(lp, f"S_{t}_{g.stage[i]}")
    return S


def _dependency_rows(lp: pulp.LpProblem, g: _Graph, x: _Vars) -> None:
    """A node is computed only from inputs computed or kept in the same stage, and kept into
    the next stage only if it was kept into or computed in this one."""
    for t in range(g.n_stages):
        for i in g.order[: t + 1]:
            ri = x.r(t, i)
            if isinstance(ri, int) and ri == 0:
                continue
            for d in g.deps[i]:
                lp += ri <= x.r(t, d) + x.s(t, d)
        if t + 1 < g.n_stages:
            for i in g.order[: t + 1]:
                if not isinstance(x.S[t + 1, i], int):
                    lp += x.S[t + 1, i] <= x.s(t, i) + x.r(t, i)


def _view_rows(lp: pulp.LpProblem, g: _Graph, x: _Vars) -> None:
    """A live view keeps its storage: in Checkmate terms, keeping a value that holds a
    storage charged to another node keeps that node (which then may also be used without
    cost)."""
    for holder in g.order:
        for st in g.values[holder].storages:
            b = g.charge.get(st)
            if b is None or b == holder or b not in g.stage:
                continue
            for t in range(g.stage[holder] + 1, g.n_stages):
                sv, sb = x.s(t, holder), x.s(t, b)
                if not isinstance(sb, int) and not (isinstance(sv, int) and sv == 0):
                    lp += sb >= sv


def _memory_rows(lp: pulp.LpProblem, g: _Graph, x: _Vars, budget: float) -> None:
    """Memory ``U[t, k]`` after each computation of a stage, within ``budget`` (KiB) at the
    moment the simulator checks: the new node allocated, its inputs still live. ``FREE[t, i, k]``
    is 1 exactly where ``k`` is computed, ``i`` (an input of ``k`` or ``k`` itself) is not kept
    into the next stage and nothing later in the stage reads it: freed after its last use."""
    for t in range(g.n_stages):
        computed = [
            i for i in g.order[: t + 1] if not (isinstance(x.r(t, i), int) and x.r(t, i) == 0)
        ]
        u_prev: pulp.LpAffineExpression = pulp.lpSum(g.mem[i] * x.s(t, i) for i in g.order[:t])
        for k in computed:
            rk = x.r(t, k)
            lp += u_prev + g.alloc[k] * rk <= budget  # k allocated, its inputs still live
            frees = []
            for i in [*g.deps[k], k]:
                if g.mem[i] == 0:
                    continue
                later = [x.r(t, j) for j in g.users[i] if g.stage[j] > g.stage[k] and (t, j) in x.R]
                keep = x.s(t + 1, i) if t + 1 < g.n_stages else 0
                free = _binary(lp, f"F_{t}_{g.stage[i]}_{g.stage[k]}")
                hazards = (1 - rk) + keep + pulp.lpSum(later)
                lp += 1 - free <= hazards
                lp += (2 + len(later)) * (1 - free) >= hazards
                frees.append(g.mem[i] * free)
            u = lp.add_variable(f"U_{t}_{g.stage[k]}", None, None)
            lp += u == u_prev + g.mem[k] * rk - pulp.lpSum(frees)
            u_prev = pulp.lpSum([u])


def _cost(g: _Graph, x: _Vars, scale: float) -> pulp.LpAffineExpression:
    """The backward stages' recompute time (forward stages cost nothing: remat counts
    recompute time only), in the objective's units."""
    return pulp.lpSum(
        scale * g.values[i].time_s * x.R[t, i]
        for t in range(g.first_backward, g.n_stages)
        for i in g.fwd
        if (t, i) in x.R and not isinstance(x.R[t, i], int)
    )


def _solve(lp: pulp.LpProblem, config: SolverConfig, c0: float) -> None:
    """Solve within the time limit counted from ``c0``; an infeasible answer is confirmed
    without presolve, which once called a feasible model infeasible."""
    lp.solve(backend(config, config.time_limit_s, {}))
    if lp.status == pulp.LpStatusInfeasible:
        left = max(1.0, config.time_limit_s - (clock.now() - c0))
        lp.solve(backend(config, left, {}, presolve=False))


def _result(lp: pulp.LpProblem, scale: float, elapsed: float, binaries: int) -> CheckmateBound:
    """The solved model's bound in seconds: the optimum less the gaps HiGHS may stop at, or
    its best dual bound if stopped early."""
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
