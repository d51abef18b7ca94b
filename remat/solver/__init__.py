"""Solvers: choose which forward values to save. Sees only :class:`remat.problem.Problem`."""

from remat.solver.fixed import FIXED_PLANS, fixed_saved_set
from remat.solver.plan import Plan, Proof, make_plan
from remat.solver.schedule import InvalidPlanError, Schedule, build_schedule
from remat.solver.simulate import Simulation, TimelineStep, simulate

__all__ = [
    "FIXED_PLANS",
    "InvalidPlanError",
    "Plan",
    "Proof",
    "Schedule",
    "Simulation",
    "TimelineStep",
    "build_schedule",
    "fixed_saved_set",
    "make_plan",
    "simulate",
]
