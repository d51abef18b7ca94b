"""``remat.apply``'s planning passes: the step traced on a FakeTensor copy with every region
eager (:func:`analyze`), then a plan file loaded, a fixed plan, or a solve on the blocks and
the modules outside them, and, where that recomputes, on the blocks' sub-modules
(:func:`plan_step`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat._torch_compat import is_fake
from remat.executors.sac import offloading, planner, policies, regions, shallow
from remat.executors.sac.files import file_regions, solution_from_file
from remat.executors.sac.trace import FSDP_PARAM_DTYPES, FakeModel, StepTrace, TraceError
from remat.measure.autocast import AUTOCAST
from remat.measure.meter import Loss
from remat.measure.profiles import DeviceProfile
from remat.parallel.pipelining import Pipeline
from remat.plan.files import read_plan
from remat.request import Request
from remat.solver.config import BudgetError
from remat.solver.formula import FitError

__all__ = [
    "FINER_PASS_EVENTS",
    "Analyzed",
    "Stage",
    "Traced",
    "analyze",
    "plan_step",
    "uniform_costs",
]


@dataclass(frozen=True)
class Stage:
    """A pipeline stage's place (:class:`Pipeline`) and one microbatch's target."""

    pipeline: Pipeline
    target: Any = None


@dataclass(frozen=True)
class Traced:
    """A model's step as the ``sac`` executor runs it, traced on a copy: the copy, and how
    every trace of it is taken (profile, autocast)."""

    fake: FakeModel
    profile: DeviceProfile
    autocast: torch.dtype | None

    def trace(
        self,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        policies: Any,
        schedule: bool = True,
        offload: Sequence[bool] | None = None,
        **stage: Any,
    ) -> StepTrace:
        """``stage``: a pipeline stage's ``target`` and ``schedule_events``
        (:meth:`FakeModel.trace`)."""
        return self.fake.trace(
            args,
            kwargs,
            policies,
            profile=self.profile,
            autocast=self.autocast,
            schedule=schedule,
            offload=offload,
            **stage,
        )


def analyze(
    model: nn.Module,
    blocks: tuple[str, ...],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    req: Request,
    profile: DeviceProfile,
    *,
    fsdp_units: tuple[str, ...] | None = None,
    stage: Stage | None = None,
    reuse: FakeModel | None = None,
    loss: Loss | None = None,
) -> tuple[Traced, planner.NativeProblem]:
    """The step with every region (``blocks``) eager, traced on a FakeTensor copy of
    ``model`` (sharded with FSDP2 for ``zero_stage=3`` over several ranks: ``fsdp_units``, by
    default the regions), or on a real copy of a CPU model whose step FakeTensors cannot run.
    ``reuse``: an earlier analysis's copy of ``model``, given other regions where its FSDP2
    units are these (:meth:`FakeModel.with_regions`). The regions are put in the order their
    forwards run. The model's KV cache must be off."""
    options = req.training
    precision = options.precision
    autocast, mp = AUTOCAST.get(precision), FSDP_PARAM_DTYPES.get(precision)
    fsdp = options.world_size if options.zero_stage == 3 and options.world_size > 1 else None

    def traced_on(real: bool) -> tuple[FakeModel, planner.NativeProblem]:
        fake = FakeModel(
            model,
            blocks,
            real=real,
            fsdp_world=fsdp,
            fsdp_param_dtype=mp,
            fsdp_units=fsdp_units,
            pipeline=stage.pipeline if stage is not None else None,
            target=stage.target if stage is not None else None,
            loss=loss,
        )
        return fake, planner.analyze(fake, args, kwargs, profile=profile, autocast=autocast)

    if reuse is not None and reuse.units == (fsdp_units or blocks):
        fake = reuse.with_regions(blocks)
        problem = planner.analyze(fake, args, kwargs, profile=profile, autocast=autocast)
        return Traced(fake, profile, autocast), problem
    try:
        fake, problem = traced_on(real=False)
    except TraceError as e:
        if stage is not None or not _real_fallback(model):
            raise
        if req.progress:
            req.progress(f"tracing on a real copy of the model: {e}")
        fake, problem = traced_on(real=True)
    return Traced(fake, profile, autocast), problem


Analyzed = tuple[planner.NativeProblem, planner.Tracer, shallow.UniformCosts | None]
"""A step traced with every region eager, how to trace it under other policies, and how to
cost its uniform plans on shallow copies (None: a pipeline stage, or a real copy)."""


class _Analyzer:
    """The step analyzed on given regions (:func:`analyze`), on the model or on a shallow
    copy of it; the model's first copy is reused by the later passes on it."""

    def __init__(
        self,
        model: nn.Module,
        blocks: tuple[str, ...],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        req: Request,
        profile: DeviceProfile,
        stage: Stage | None,
        loss: Loss | None,
    ) -> None:
        self.model, self.blocks, self.args, self.kwargs = model, blocks, args, kwargs
        self.req, self.profile, self.stage, self.loss = req, profile, stage, loss
        self.first: FakeModel | None = None

    def __call__(
        self,
        regions_: tuple[str, ...],
        of: nn.Module | None = None,
        units: tuple[str, ...] | None = None,
    ) -> Analyzed:
        """``of``: a copy of the model (default the model), with its FSDP2 ``units`` (default
        the blocks)."""
        of = self.model if of is None else of
        args, kwargs = self.args, self.kwargs
        traced, problem = analyze(
            of,
            regions_,
            args,
            kwargs,
            self.req,
            self.profile,
            fsdp_units=self.blocks if units is None else units,
            stage=self.stage,
            reuse=self.first if of is self.model else None,
            loss=self.loss,
        )
        if of is self.model and self.first is None:
            self.first = traced.fake
        uniform = None
        if self.stage is None and not traced.fake.real:  # a stack of blocks, else None
            uniform = uniform_costs(
                of, regions_, self.blocks if units is None else units, args, kwargs, self.req,
                self.profile, self.loss,
            )  # fmt: skip
        return (
            problem,
            lambda policies, schedule=True, offload=None: traced.trace(
                args, kwargs, policies, schedule, offload
            ),
            uniform,
        )


def plan_step(
    model: nn.Module,
    blocks: tuple[str, ...],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    req: Request,
    step_budget: int | None,
    profile: DeviceProfile,
    stage: Stage | None = None,
    loss: Loss | None = None,
) -> tuple[planner.NativeProblem, planner.Solution]:
    """Trace the step with every region eager, then load the plan file, fix the named plan
    (the blocks'), or solve (:func:`_solve`)."""
    on = _Analyzer(model, blocks, args, kwargs, req, profile, stage, loss)
    plan = req.plan
    if req.is_plan_file():
        assert isinstance(plan, (str, Path))
        f = read_plan(plan)
        problem, tracer, _ = on(file_regions(f, model, blocks))
        return problem, solution_from_file(problem, f, plan, tracer)
    if isinstance(plan, str):
        problem, tracer, _ = on(blocks)
        solution = planner.fixed(problem, plan, tracer)
        over = step_budget is not None and solution.trace.peak_bytes > step_budget
        if over and req.host_budget_bytes:  # offload where the plan does not fit without
            choice = offloading.choice_of(problem, tracer, req.host_budget_bytes)
            solution = planner.fixed(problem, plan, offloading.offloading_tracer(tracer, choice))
        if step_budget is not None and solution.trace.peak_bytes > step_budget:
            raise BudgetError(step_budget, solution.trace.peak_bytes, f"plan {plan!r}")
        return problem, solution
    return _solve(on, step_budget)


def _solve(
    on: _Analyzer, step_budget: int | None
) -> tuple[planner.NativeProblem, planner.Solution]:
    """A solver plans on the blocks and the modules outside them
    (:func:`remat.executors.sac.regions.outside_blocks`; on the blocks alone where those
    cannot be regions); where that recomputes, ``auto`` also plans with each block's
    sub-modules in place of the blocks (:func:`remat.executors.sac.regions.split_blocks`): the
    cheaper traced plan that fits wins, on steps of up to :data:`FINER_PASS_EVENTS` events.
    Each pass runs the exact MILP first, and the chain DP as its fallback; the blocks' pass
    also asks the chain DP (on a deep stack's shallow copies) or the per-block family for
    a second opinion (:func:`planner.solve`). Which passes and solvers run depends on the
    model and the budget, never on the clock: the time limit is each solver's counted work
    (:mod:`remat.solver.clock`)."""
    model, blocks, req, stage = on.model, on.blocks, on.req, on.stage
    solver, config = req.solver or "auto", req.solver_config()
    progress = config.progress or (lambda _: None)
    outside = regions.outside_blocks(model, blocks)

    def solved(
        regions_: tuple[str, ...], analyzed: Analyzed | None = None, second: bool = True
    ) -> tuple[planner.NativeProblem, planner.Solution]:
        """The plan on ``regions_``, each solver with the request's time limit of work
        (``second``: :func:`planner.solve`'s ``second_opinions``)."""
        problem, tracer, uniform = analyzed or on(regions_)
        return problem, planner.solve(
            problem,
            tracer,
            budget_bytes=step_budget,
            config=config,
            solver=solver,
            uniform=uniform,
            milp_first=True,
            second_opinions=second,
            host_budget_bytes=req.host_budget_bytes,
        )

    best: tuple[planner.NativeProblem, planner.Solution] | None = None
    error: BudgetError | None = None
    analyzed: Analyzed | None = None
    try:
        if outside:
            outside, analyzed = _worth_a_region(on, model, blocks, outside, progress, stage)
    except TraceError as e:
        progress(f"native: the modules outside the blocks cannot be regions ({e})")
        outside = ()
    try:
        best = solved(blocks + outside, analyzed)
    except BudgetError as e:
        error = e
    split = regions.split_blocks(model, blocks)
    if solver != "auto" or step_budget is None or len(split) <= len(blocks):
        return _best(best, error)
    if best is not None and best[1].trace.recompute_time_s == 0:
        return best
    events = len(best[0].baseline.events) if best is not None else 0
    if best is not None and events > FINER_PASS_EVENTS:
        # A count, not the time left: the plan must not depend on the machine's load.
        progress(
            f"native: the step has {events:,} events (more than {FINER_PASS_EVENTS:,}): the "
            "blocks' sub-modules are not planned, the blocks' plan stands"
        )
        return best
    progress(f"native: planning again on the blocks' sub-modules ({len(split)} regions)")
    try:
        finer, solution = solved(split + outside, second=best is None)
    except BudgetError as e:
        if error is None or e.least_peak_bytes < error.least_peak_bytes:
            error = e
        return _best(best, error)
    except TraceError as e:  # a sub-module the step does not call, say: the blocks' plan
        progress(f"native: the sub-modules cannot be regions ({e})")
        return _best(best, error)
    solution = replace(
        solution, reason=f"regions: the blocks' {len(split)} sub-modules; {solution.reason}"
    )
    if best is None or _cost(solution) < _cost(best[1]):
        return finer, solution
    return best


FINER_PASS_EVENTS = 20_000
"""Events of the blocks' eager step above which the finer pass (each block's sub-modules as
regions) is not run: it traces the step again with several times the regions and solves a
finer MILP. A count, so that the plan never depends on the machine's load."""


def uniform_costs(
    model: nn.Module,
    regions_: tuple[str, ...],
    units: tuple[str, ...],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    req: Request,
    profile: DeviceProfile,
    loss: Loss | None = None,
) -> shallow.UniformCosts | None:
    """How the chain DP costs the uniform plans of ``model`` (its ``regions_``, FSDP2
    ``units``) on two shallow copies (:mod:`remat.executors.sac.shallow`), each analyzed as the
    model is; None where the regions are not a ModuleList's children (sub-modules)."""

    def copy_of(
        copy: nn.Module, copy_regions: tuple[str, ...], copy_units: tuple[str, ...]
    ) -> Callable[[str], StepTrace]:
        traced, problem = analyze(
            copy, copy_regions, args, kwargs, req, profile, fsdp_units=copy_units, loss=loss
        )
        plans = planner.uniform_plans(problem)
        return lambda name: traced.trace(args, kwargs, plans[name])

    return shallow.uniform_costs(model, regions_, units, copy_of, req.workers)


def _worth_a_region(
    on: Callable[..., Analyzed],
    model: nn.Module,
    blocks: tuple[str, ...],
    outside: tuple[str, ...],
    progress: Callable[[str], object],
    stage: Stage | None = None,
) -> tuple[tuple[str, ...], Analyzed | None]:
    """The modules of ``outside`` whose recomputation holds less from their forward to their
    backward than running them eagerly, measured by one trace with only those recomputed;
    and the step analyzed on the blocks and them, where all are measured so. Why: an
    embedding saves nothing but its indices and a checkpoint saves the RNG state (5 KiB of
    CPU state per region), so recomputing one gains nothing; left out, it cannot hold a plan
    above the blocks' least peak. What a module outside the blocks holds does not depend on
    how many blocks run between them: on a deep stack (:data:`shallow.MIN_REGIONS` regions)
    it is measured on a copy with :data:`shallow.SHALLOW` ``[0]`` blocks."""
    useful: tuple[str, ...] | None = None
    analyzed: Analyzed | None = None
    if stage is None and len(blocks) + len(outside) >= shallow.MIN_REGIONS:
        try:
            copy, kept = shallow.truncated(model, blocks + outside, shallow.SHALLOW[0])
            useful = _held_less(on(kept, copy, tuple(p for p in kept if p in blocks)), outside)
        except FitError:  # the blocks are not a ModuleList's children
            pass
        except Exception as e:  # any failure of the copy: the model's own trace decides
            progress(f"native: the modules outside the blocks measured on the model ({e})")
    if useful is None:
        analyzed = on(blocks + outside)
        useful = _held_less(analyzed, outside)
    if useful == outside:
        return outside, analyzed
    left = ", ".join(p for p in outside if p not in useful)
    progress(f"native: recomputing {left} (outside the blocks) gains nothing: kept eager")
    return useful, None


def _held_less(analyzed: Analyzed, outside: tuple[str, ...]) -> tuple[str, ...]:
    """The modules of ``outside`` (regions of ``analyzed``) that hold less from their forward
    to their backward recomputed than eager: one trace with only those recomputed."""
    problem, tracer, _ = analyzed
    trace = tracer(
        [
            None
            if path not in outside
            else policies.required_keys(problem.streams[problem.class_of(k)])
            for k, path in enumerate(problem.blocks)
        ],
        schedule=False,  # what a region holds is one microbatch's: no pipeline step needed
    )

    def held(t: StepTrace, path: str) -> int:
        start, end = t.forward_live[problem.blocks.index(path)]
        return end - start

    return tuple(p for p in outside if held(trace, p) < held(problem.baseline, p))


def _cost(solution: planner.Solution) -> tuple[float, int]:
    return solution.trace.added_time_s, solution.trace.peak_bytes


def _best(
    best: tuple[planner.NativeProblem, planner.Solution] | None, error: BudgetError | None
) -> tuple[planner.NativeProblem, planner.Solution]:
    if best is None:
        assert error is not None
        raise error from None  # the least peak of both passes, not a chain of two
    return best


def _real_fallback(model: nn.Module) -> bool:
    """Whether a step that cannot run on FakeTensors may be traced on a real copy: only for
    a model on the CPU (a copy there is cheap next to what it plans; on an accelerator it
    would take the device memory the plan is for)."""
    tensors = [*model.parameters(), *model.buffers()]
    return all(t.device.type == "cpu" and not is_fake(t) for t in tensors)
