"""The planning pipeline: capture -> joint graph -> problem -> plan, each stage timed."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from remat import _torch_compat as tc
from remat.executors.graph.capture import Captured, capture
from remat.executors.graph.joint import JointGraph, build_joint
from remat.executors.graph.loss import capture_loss, splice
from remat.executors.graph.to_problem import build_problem
from remat.measure.autocast import AUTOCAST, policy_of
from remat.measure.meter import Loss
from remat.measure.profiles import DeviceProfile
from remat.measure.scratch import measure_graph, where_measured
from remat.plan.files import plan_from_file
from remat.problem import Problem
from remat.solver import offload_search
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.fixed import FIXED_PLANS
from remat.solver.plan import Plan, make_plan
from remat.solver.registry import solve

__all__ = ["Analysis", "BudgetError", "analyze", "choose_plan", "fixed_plan"]


@dataclass(frozen=True)
class Analysis:
    """A model's step as a graph and as numbers, ready to plan."""

    captured: Captured
    joint: JointGraph
    problem: Problem
    """The step planned: with a loss, the module's and the loss's
    (:mod:`remat.executors.graph.loss`)."""
    timings: Mapping[str, float]
    """Seconds spent in ``capture``, ``joint`` and ``annotate``."""
    module_problem: Problem | None = None
    """With a loss: the module's own problem, whose part of the plan the executor runs."""

    @property
    def executed(self) -> Problem:
        """The problem the executor's graphs are cut from."""
        return self.module_problem or self.problem


def analyze(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    device_profile: str | DeviceProfile = "cpu",
    precision: str = "fp32",
    grads_held: bool = True,
    loss: Loss | None = None,
) -> Analysis:
    """Capture ``model`` and reduce its training step to a :class:`Problem`.

    ``precision``: ``fp32``, or ``bf16-mixed`` / ``fp16-mixed`` to trace under autocast.
    ``grads_held``: False when gradients leave the device as they are produced (ZeRO 2-3).
    ``loss``: the loss the training loop computes from the outputs, planned with them.
    """
    if precision not in AUTOCAST:
        raise ValueError(f"unknown precision {precision!r}; valid: {', '.join(AUTOCAST)}")
    t0 = time.perf_counter()
    name = device_profile.name if isinstance(device_profile, DeviceProfile) else device_profile
    captured = capture(
        model, args, kwargs, autocast=AUTOCAST[precision], autocast_policy=policy_of(name)
    )
    t1 = time.perf_counter()
    joint = build_joint(captured)
    t2 = time.perf_counter()
    metadata = {"model": type(model).__name__, "capture": captured.method, "precision": precision}

    def problem_of(graph: JointGraph) -> Problem:
        scratch, output_bytes, where = _scratch(model, graph, device_profile)
        problem = build_problem(
            graph,
            device_profile=device_profile,
            metadata={**metadata, "scratch": where},
            scratch=scratch,
            output_bytes=output_bytes,
        )
        return problem if grads_held else dataclasses.replace(problem, grads_held=False)

    problem = module_problem = problem_of(joint)
    if loss is not None:
        graph = capture_loss(
            loss.fn,
            loss.target,
            captured,
            joint,
            autocast=AUTOCAST[precision],
            autocast_policy=policy_of(name),
            problem_of=problem_of,
        )
        problem = splice(module_problem, graph)
    t3 = time.perf_counter()
    return Analysis(
        captured,
        joint,
        problem,
        {"capture": t1 - t0, "joint": t2 - t1, "annotate": t3 - t2},
        module_problem if loss is not None else None,
    )


def _scratch(
    model: nn.Module, joint: JointGraph, device_profile: str | DeviceProfile
) -> tuple[dict[str, int], dict[str, int], str]:
    """Kernel scratch and output bytes per node where they can be measured for the device
    planned for (:func:`remat.measure.scratch.where_measured`), and a line saying where (or
    why not)."""
    name = device_profile.name if isinstance(device_profile, DeviceProfile) else device_profile
    where = where_measured(model, name)
    if where is None:
        return {}, {}, f"not measured ({_why_not(model, name)}): counts 0"
    measured = measure_graph(joint.graph_module)  # one measurement, both figures
    scratch = {n: s for n, (s, _) in measured.items() if s}
    return scratch, {n: held for n, (_, held) in measured.items()}, where


def _why_not(model: nn.Module, profile: str) -> str:
    if tc.fake_mode_of(model) is not None:
        return "a FakeTensor model"
    return f"planned for {profile} on a CPU model"


def fixed_plan(problem: Problem, name: str) -> Plan:
    """One of the fixed plans (``keep_all``, ``keep_inputs``, ``keep_matmuls``)."""
    if name not in FIXED_PLANS:
        raise ValueError(f"unknown plan {name!r}; valid plans: {', '.join(sorted(FIXED_PLANS))}")
    return solve(problem, solver=name, budget_bytes=None)


def choose_plan(
    problem: Problem,
    *,
    plan: str | Path | Plan | None = None,
    solver: str | None = None,
    activation_budget_bytes: int | None = None,
    config: SolverConfig | None = None,
    host_budget_bytes: int = 0,
    copy_ops: Collection[str] | None = None,
) -> Plan:
    """Resolve the user's request (a named plan, an existing plan, or a solver and a budget;
    with a host budget, the search over offload, :mod:`remat.solver.offload_search`, its
    copies waited on and started at ``copy_ops``: the ops the executor runs, None for all)."""
    if plan is not None and (solver is not None or activation_budget_bytes is not None):
        raise ValueError("pass either plan= or solver=/activation_budget_bytes=, not both")
    if host_budget_bytes:
        if activation_budget_bytes is None:
            raise ValueError(
                "a host budget offloads to fit a device budget: pass budget_gb= or "
                "activation_budget_bytes= too"
            )
        keep_all = solve(problem, solver="keep_all", budget_bytes=None).predicted_peak_bytes
        # The search solves LADDER + 1 budgets: each gets its share of the time limit.
        config = config or SolverConfig()
        share = dataclasses.replace(
            config, time_limit_s=config.time_limit_s / (offload_search.LADDER + 1)
        )
        return offload_search.search(
            problem,
            activation_budget_bytes,
            host_budget_bytes,
            lambda b: solve(problem, solver=solver or "auto", budget_bytes=b, config=share),
            keep_all,
            copy_ops,
        )
    if isinstance(plan, Path) or (isinstance(plan, str) and plan.endswith(".json")):
        return plan_from_file(plan, problem)
    if isinstance(plan, Plan):
        unknown = sorted(plan.saved - set(problem.by_name))
        if unknown:
            raise ValueError(f"the plan saves values this graph does not have: {unknown[:5]}")
        return make_plan(
            problem,
            plan.saved,
            solver=plan.solver,
            reason=plan.reason,
            proof=plan.proof,
            offloads=plan.schedule.offloaded,
        )
    if isinstance(plan, str):
        return fixed_plan(problem, plan)
    return solve(
        problem,
        solver=solver or "auto",
        budget_bytes=activation_budget_bytes,
        config=config,
    )
