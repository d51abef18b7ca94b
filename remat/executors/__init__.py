"""The executors a plan runs on, as one type.

A plan targets an executor:

- ``graph``: remat's whole-graph executor (:func:`remat.optimize`). It captures the step whole
  and rewrites its graphs. It runs as one module, under no distributed engine.
- ``sac``: PyTorch's selective checkpointing on the model's own blocks (:func:`remat.apply`).
  It runs under FSDP2, DDP, tensor and pipeline parallelism, ``torch.compile`` and the
  Hugging Face Trainer.

Each is an :class:`Executor`; :data:`EXECUTORS` holds one per name. The name is the one thing
that crosses into the solver core (:attr:`remat.problem.Problem.executor`), whose model of
each executor's schedule lives in :mod:`remat.solver.executor` and never imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from remat.executors.base import Comparison, Executor, Planned, Solved
from remat.executors.graph.analyze import analyze
from remat.executors.graph.module import RematModule
from remat.executors.graph.optimize import optimize
from remat.executors.sac.apply import NATIVE_SOLVERS, apply
from remat.executors.sac.apply import save_plan as native_save_plan
from remat.executors.sac.events import StepTrace
from remat.executors.sac.files import plan_document as native_plan_document
from remat.executors.sac.hf import kv_cache_off
from remat.executors.sac.passes import analyze as native_analyze
from remat.executors.sac.planner import NATIVE_PLANS
from remat.executors.sac.planner import fixed as native_fixed
from remat.executors.sac.planner import solve as native_solve
from remat.executors.sac.regions import find_blocks
from remat.executors.sac.report import explain_applied
from remat.executors.sac.state import applied
from remat.fit.graph_formula import analyze_dynamic, formula_of
from remat.fit.peak import MemoryFormula
from remat.fit.questions import FitQuestion, FormulaQuestion
from remat.fit.sac_formula import formula_of as native_formula_of
from remat.fit.sac_formula import native_dynamic
from remat.fit.search import FitReport, fit_graph, fit_sac
from remat.measure.meter import Loss
from remat.measure.profiles import get_profile
from remat.plan.files import plan_document
from remat.plan.report import explain_plan
from remat.request import Request, as_args, resolve_profile
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.plan import Proof, proven
from remat.solver.registry import HEURISTICS, SOLVERS, least_peak, solve


class _GraphComparison(Comparison):
    """Every solver on the captured joint graph."""

    def __init__(
        self,
        model: nn.Module,
        example_inputs: Any,
        kwargs: Mapping[str, Any],
        request: Request,
        loss: Loss | None,
    ) -> None:
        options = request.training
        self.problem = analyze(
            model,
            example_inputs,
            kwargs,
            device_profile=request.device_profile,
            precision=options.precision,
            grads_held=not options.grads_released,
            loss=loss,
        ).problem
        self.solvers = [*SOLVERS, "auto"]

    def peak_range(self, config: SolverConfig) -> tuple[int, int]:
        keep_all = solve(self.problem, solver="keep_all", budget_bytes=None)
        least = min(least_peak(self.problem, n, config) for n in HEURISTICS)
        return least, keep_all.predicted_peak_bytes

    def solve(self, name: str, budget: int, config: SolverConfig) -> Solved:
        plan = solve(self.problem, solver=name, budget_bytes=budget, config=config)
        sim = plan.simulation
        step = sim.step_time_s
        bound = None if plan.lower_bound_s is None else 100 * plan.lower_bound_s / step
        pct = 100 * sim.recompute_time_s / step
        added = 100 * sim.added_time_s / step
        return Solved(plan.predicted_peak_bytes, pct, added, bound, proven(plan))


class _SacComparison(Comparison):
    """``remat.apply``'s fixed plans, its ``auto`` and each of remat's solvers for its
    executor, every plan traced."""

    def __init__(
        self,
        model: nn.Module,
        example_inputs: Any,
        kwargs: Mapping[str, Any],
        request: Request,
        loss: Loss | None,
    ) -> None:
        profile = get_profile(resolve_profile(model, request.device_profile))
        blocks = find_blocks(model)
        self.args, self.kwargs = as_args(example_inputs), dict(kwargs)
        with kv_cache_off(model):
            self.traced, self.problem = native_analyze(
                model, blocks, self.args, self.kwargs, request, profile, loss=loss
            )
        self.model = model
        self.solvers = [*(f"plan:{n}" for n in NATIVE_PLANS), "auto", *NATIVE_SOLVERS]

    def _tracer(
        self, policies: Any, schedule: bool = True, offload: Sequence[bool] | None = None
    ) -> StepTrace:
        with kv_cache_off(self.model):
            return self.traced.trace(self.args, self.kwargs, policies, schedule, offload)

    def peak_range(self, config: SolverConfig) -> tuple[int, int]:
        least = native_fixed(self.problem, "block", self._tracer).trace.peak_bytes
        return least, self.problem.baseline.peak_bytes

    def solve(self, name: str, budget: int, config: SolverConfig) -> Solved:
        if name.startswith("plan:"):  # remat.apply(plan=...)
            solution = native_fixed(self.problem, name.removeprefix("plan:"), self._tracer)
            if solution.trace.peak_bytes > budget:
                raise BudgetError(budget, solution.trace.peak_bytes, f"plan {name!r}")
        else:
            solution = native_solve(
                self.problem, self._tracer, budget_bytes=budget, config=config, solver=name
            )
        trace = solution.trace
        step = sum(e.time_s for e in trace.events)
        pct = 100 * trace.recompute_time_s / step if step else 0.0
        added = 100 * trace.added_time_s / step if step else 0.0
        return Solved(
            trace.peak_bytes, pct, added, None, Proof.OPTIMAL if pct == 0 else solution.proof
        )


class GraphExecutor(Executor):
    name = "graph"
    entry = "remat.optimize"
    description = "remat's whole-graph executor (remat.optimize): one module, no distributed engine"
    distributed = False
    own_forward = False
    comparison = _GraphComparison
    deep = "shallow"

    def _entry(self, model: nn.Module, example_inputs: Any, **kwargs: Any) -> nn.Module:
        return optimize(model, example_inputs, **kwargs)

    def _planned(self, module: nn.Module) -> Planned:
        assert isinstance(module, RematModule)
        plan, problem = module.plan, module._first.problem
        return Planned(
            module,
            plan,
            module._first.timings,
            lambda width: explain_plan(plan, problem, width=width),
            module.save_plan,
            lambda: plan_document(plan, problem),
        )

    def fit(self, question: FitQuestion) -> FitReport:
        self._only_deep(shallow=question.shallow, copies=question.copies)
        return fit_graph(question)

    def memory_formula(self, question: FormulaQuestion) -> MemoryFormula:
        self._only_deep(copies=question.copies)
        q, options = question, question.request.training
        dynamic = analyze_dynamic(
            q.model, q.args, example_kwargs=q.kwargs, precision=options.precision,
            grads_held=not options.grads_released, device_profile=q.request.device_profile,
            max_seq=q.request.max_seq, seq=q.seq, progress=q.request.progress, loss=q.loss,
        )  # fmt: skip
        return formula_of(dynamic, q.plan, q.static)


class SacExecutor(Executor):
    name = "sac"
    entry = "remat.apply"
    description = (
        "PyTorch's selective checkpointing on the model's blocks (remat.apply): runs under "
        "FSDP2, DDP, torch.compile, the Trainer"
    )
    distributed = True
    own_forward = True
    comparison = _SacComparison
    deep = "copies"

    def _entry(self, model: nn.Module, example_inputs: Any, **kwargs: Any) -> nn.Module:
        return apply(model, example_inputs, **kwargs)

    def _planned(self, module: nn.Module) -> Planned:
        state = applied(module)
        return Planned(
            module,
            state.plan,
            state.timings,
            lambda width: explain_applied(state, width=width),
            lambda path: native_save_plan(module, path),
            lambda: native_plan_document(module),
        )

    def fit(self, question: FitQuestion) -> FitReport:
        self._only_deep(shallow=question.shallow, copies=question.copies)
        return fit_sac(question)

    def memory_formula(self, question: FormulaQuestion) -> MemoryFormula:
        q = question
        if not isinstance(q.plan, str) or q.plan not in NATIVE_PLANS:
            raise ValueError(
                f"executor='sac' takes one of remat.apply's fixed plans ({', '.join(NATIVE_PLANS)})"
            )
        native, _ = native_dynamic(
            q.model, q.args, q.kwargs, q.request, plans=(q.plan,), seq=q.seq, copies=q.copies,
            loss=q.loss,
        )  # fmt: skip
        return native_formula_of(native, q.plan, q.static)


GRAPH = GraphExecutor()
SAC = SacExecutor()
EXECUTORS: Mapping[str, Executor] = {e.name: e for e in (GRAPH, SAC)}
"""Every executor by name."""


def executor_named(executor: str | Executor) -> Executor:
    """The executor ``executor`` names (or ``executor`` itself); :class:`ValueError` naming
    the valid ones otherwise."""
    if isinstance(executor, Executor):
        return executor
    found = EXECUTORS.get(executor)
    if found is None:
        raise ValueError(f"unknown executor {executor!r}; valid: {', '.join(EXECUTORS)}")
    return found


__all__ = [
    "EXECUTORS",
    "GRAPH",
    "SAC",
    "Comparison",
    "Executor",
    "GraphExecutor",
    "Planned",
    "SacExecutor",
    "executor_named",
]
