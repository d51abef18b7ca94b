"""The MILP backend: HiGHS through highspy (warm-started, with its proven dual bound), else CBC.

Shared by every model remat solves (:mod:`remat.solver.milp`, :mod:`remat.solver.checkmate`,
:mod:`remat.solver.bound`, :mod:`remat.solver.lp_round`), so that the workarounds for HiGHS's
bugs and the objective's units live in one place.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
import pulp

try:
    import highspy
except ImportError:  # CBC (bundled with pulp) is the fallback
    highspy = None  # type: ignore[assignment]

from remat.solver import clock
from remat.solver.config import SolverConfig

NS = 1e9
"""The objective is in nanoseconds of recompute time..."""
MAX_COEF = 1e7
"""...unless an op costs more than 10 ms (hand-built problems with seconds-long ops): then in
units making the costliest op 1e7, as larger objective coefficients break HiGHS's simplex."""


def objective_scale(times: list[float]) -> float:
    """Objective units per second of recompute time."""
    top = max(times, default=0.0)
    return NS if top * NS <= MAX_COEF else MAX_COEF / top


GAP_REL, GAP_ABS = 1e-7, 1e-2
"""Optimality tolerances: "optimal" means within 1e-7 relative or 0.01 ns absolute."""


@functools.cache
def _silence_highs_banner() -> None:
    """highspy prints a banner to stdout the first time a solver is created in a process."""
    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


class _WarmHiGHS(pulp.HiGHS):  # type: ignore[misc, valid-type]
    """HiGHS through highspy, started from a known plan (pulp's class has no warm start)."""

    def __init__(
        self,
        start: Mapping[pulp.LpVariable, float],
        options: Mapping[str, object],
        work_s: float,
        **kwargs: object,
    ) -> None:
        super().__init__(**kwargs)
        self.start = start
        self.options = options
        self.work_s = work_s

    def callSolver(self, lp: pulp.LpProblem) -> None:  # noqa: N802 - pulp's name
        highs = lp.solverModel
        for key, option in self.options.items():
            highs.setOptionValue(key, option)
        nonzeros = highs.getNumNz()
        highs.setOptionValue("mip_max_nodes", clock.node_limit(self.work_s, nonzeros))
        self.checkpoints = _Checkpoints(clock.checkpoint_limit(self.work_s, nonzeros))
        highs.cbMipInterrupt += self.checkpoints
        self._run(highs)
        if self.start and not _consistent(highs):
            # HiGHS 1.16, warm-started with presolve probing off, has reported an optimum
            # whose column values were the start's (a 13-node graph: objective 1 s, values
            # worth 4 s; tests/solver/test_exact.py). Without presolve it is right.
            highs.clearSolver()
            highs.setOptionValue("presolve", "off")
            self._run(highs)

    def _run(self, highs: Any) -> None:
        if self.start:
            index = np.array([v.index for v in self.start], dtype=np.int32)
            value = np.array(list(self.start.values()), dtype=np.float64)
            highs.setSolution(len(index), index, value)
        before = self.checkpoints.calls
        highs.run()
        clock.charge_solve(
            highs.getInfo().simplex_iteration_count,
            highs.getNumNz(),
            self.checkpoints.calls - before,
        )
        if highs.getModelStatus() == highspy.HighsModelStatus.kTimeLimit:
            clock.mark_expired()

    def findSolutionValues(self, lp: pulp.LpProblem) -> tuple[int, int]:  # noqa: N802
        # pulp 3.3 does not know the status a node limit ends with: read it as the iteration
        # limit it knows (the best solution found, not proven optimal).
        highs = lp.solverModel
        lp.solverModel = _NodeLimitAsIterationLimit(highs)
        try:
            return super().findSolutionValues(lp)  # type: ignore[no-any-return]
        finally:
            lp.solverModel = highs


class _Checkpoints:
    """HiGHS's MIP interrupt callback: stops the solve at its ``limit``-th call. HiGHS calls
    it where it checks its limits (in the root's cut and heuristic loops, at each node), at
    the same points on every run: a work limit for the root, which ``mip_max_nodes`` does
    not bound (a 90,000-nonzero model spent 150 s there)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.calls = 0

    def __call__(self, event: Any) -> None:
        self.calls += 1
        if self.calls >= self.limit:
            event.interrupt()


class _NodeLimitAsIterationLimit:
    """A ``highspy.Highs`` whose model status reads ``kIterationLimit`` for a node limit or
    an interrupt (:class:`_Checkpoints`)."""

    def __init__(self, highs: Any) -> None:
        self._highs = highs

    def getModelStatus(self) -> Any:  # noqa: N802 - highspy's name
        status = self._highs.getModelStatus()
        limit = highspy.HighsModelStatus
        stopped = status in (limit.kSolutionLimit, limit.kInterrupt)
        return limit.kIterationLimit if stopped else status

    def __getattr__(self, name: str) -> Any:
        return getattr(self._highs, name)


def _consistent(highs: Any) -> bool:
    """Whether the column values HiGHS returns are worth the objective it reports."""
    info = highs.getInfo()
    if info.primal_solution_status != 2:  # no feasible solution: nothing to check
        return True
    cost = np.asarray(highs.getLp().col_cost_)
    values = np.asarray(highs.getSolution().col_value)
    worth = float(cost @ values) + float(highs.getLp().offset_)
    reported = float(info.objective_function_value)
    return abs(worth - reported) <= 1e-6 * max(1.0, abs(reported))


PROBING = 1 << 15
"""HiGHS's ``presolve_rule_off`` bit for probing (rule 15 in HiGHS 1.16's log, "Probing")."""


def backend(
    config: SolverConfig,
    work_s: float,
    start: Mapping[pulp.LpVariable, float],
    *,
    probing: bool = True,
    presolve: bool = True,
    gap_rel: float = GAP_REL,
) -> pulp.LpSolver:
    """The MILP solver, allowed ``work_s`` reference seconds of work
    (:mod:`remat.solver.clock`): HiGHS explores at most :func:`~remat.solver.clock.node_limit`
    branch-and-bound nodes, a limit that does not depend on the machine's speed or load (its
    root node, presolve and heuristics run to their own ends), and stops at the planning
    call's wall-clock safety net. CBC has no such limit: it gets
    ``work_s`` seconds of the wall clock, so its plans may change with load.

    ``probing``: HiGHS's presolve probing (off for remat's MILP: on a 4-layer Llama it took 7
    of 9 s and often ran out of time before branching began; without it the MILP proved the
    same optima about twice as fast, experiments/chain_gap.py. On Checkmate's MILP turning it
    off made some small random graphs time out instead.) ``presolve``: off to confirm an
    "infeasible" verdict (HiGHS's presolve declared a feasible 17-node Checkmate model
    infeasible, its postsolved solutions violating a constraint; tests/solver/test_exact.py).
    CBC ignores both. ``gap_rel``: the relative gap at which a solution counts as optimal.
    """
    if config.backend in ("auto", "highs") and highspy is not None:
        _silence_highs_banner()
        options: dict[str, object] = {} if presolve else {"presolve": "off"}
        if not probing:
            options["presolve_rule_off"] = PROBING
        return _WarmHiGHS(
            start,
            options,
            work_s,
            msg=False,
            timeLimit=max(0.01, clock.wall_left_s()),
            gapRel=gap_rel,
            gapAbs=GAP_ABS,
        )
    if config.backend == "highs":
        raise ValueError("MILP backend 'highs' requested but highspy is not installed")
    for var, value in start.items():
        var.setInitialValue(value)
    return pulp.PULP_CBC_CMD(
        msg=False, timeLimit=work_s, warmStart=bool(start), gapRel=gap_rel, gapAbs=GAP_ABS
    )


def best_bound(lp: pulp.LpProblem) -> float | None:
    """The solver's proven lower bound on the objective (HiGHS only)."""
    model = getattr(lp, "solverModel", None)
    try:
        return float(model.getInfo().mip_dual_bound)  # type: ignore[union-attr]
    except AttributeError:
        return None
