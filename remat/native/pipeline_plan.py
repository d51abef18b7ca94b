"""``remat.plan_pipeline``: every stage of a pipeline planned at once, and the step it runs.

A stage's plan changes the pipeline's step only through that stage's backwards, which the
recompute lengthens; the step (:func:`remat.solver.stages.simulate_pipeline`: each stage runs
its schedule's action order, a forward waits for the previous stage's, a backward for the
next stage's) is a max-plus expression of the actions' times, so it never falls when one
action gets longer. Under one budget per stage the stages' plans do not constrain each
other, so the plans of least recompute per stage are together the plans of least step
time: no stage's slack can buy memory for another stage. What the pipeline adds is where
the recompute lands: on the stages that hold the most microbatches (stage 0 under 1F1B),
and whether it lengthens the step or only fills a stage's idle time. The report says that
per stage, with and without the plans.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn
from typing_extensions import Unpack

from remat.native.api import apply, unapply
from remat.native.pipelining import (
    MULTI_STAGE,
    SINGLE_STAGE,
    Pipeline,
    PipelineError,
    ScheduleTrace,
)
from remat.native.state import Applied, applied
from remat.request import Request, RequestArgs, request_of
from remat.solver.stages import PipelineTiming, StageTimes, simulate_pipeline

__all__ = ["PipelinePlan", "StageReport", "plan_pipeline"]


@dataclass(frozen=True)
class StageReport:
    """One stage under its plan, over a whole ``schedule.step()``."""

    stage: int
    in_flight: int
    """The most microbatches whose saved activations the stage holds at once."""
    budget_bytes: int | None
    peak_bytes: int
    """Predicted at the allocator over the step, with the plan."""
    eager_peak_bytes: int
    """The same with no checkpoint."""
    recompute_s: float
    """Estimated time of what the stage's backwards recompute, all microbatches."""
    idle_s: float
    """The step's time less the stage's busy time, with the plan."""
    eager_idle_s: float


@dataclass(frozen=True)
class PipelinePlan:
    """What :func:`plan_pipeline` planned: each stage's plan (on its module:
    ``remat.plan_of(stages[i])``) and the pipeline's simulated step with and without them."""

    schedule: str
    microbatches: int
    stages: tuple[StageReport, ...]
    timing: PipelineTiming
    eager_timing: PipelineTiming

    @property
    def step_s(self) -> float:
        return self.timing.step_s

    @property
    def bubble_share(self) -> float:
        return self.timing.bubble_share

    def summary(self) -> str:
        """A table per stage, then the step and its bubble share with and without the plans."""
        from rich.console import Console
        from rich.table import Table

        table = Table(
            title=f"{self.schedule}, {len(self.stages)} stages, {self.microbatches} microbatches"
        )
        for col in ("stage", "in flight", "budget", "peak (no ckpt -> plan)"):
            table.add_column(col, justify="right")
        for col in ("recompute ms", "idle ms (no ckpt -> plan)"):
            table.add_column(col, justify="right")
        for s in self.stages:
            table.add_row(
                str(s.stage),
                str(s.in_flight),
                "-" if s.budget_bytes is None else f"{s.budget_bytes:,}",
                f"{s.eager_peak_bytes:,} -> {s.peak_bytes:,}",
                f"{s.recompute_s * 1e3:.3f}",
                f"{s.eager_idle_s * 1e3:.3f} -> {s.idle_s * 1e3:.3f}",
            )
        console = Console(width=120, record=True, file=io.StringIO())
        console.print(table)
        before, after = self.eager_timing, self.timing
        return (
            console.export_text()
            + f"step {before.step_s * 1e3:.3f} ms -> {after.step_s * 1e3:.3f} ms "
            f"({after.step_s / before.step_s - 1:+.1%}); bubble share "
            f"{before.bubble_share:.1%} -> {after.bubble_share:.1%} (simulated from each "
            "stage's action order and estimated op times)\n"
        )


def plan_pipeline(
    stages: Sequence[nn.Module],
    stage_inputs: Sequence[Any],
    *,
    schedule: str,
    microbatches: int,
    loss_fn: Callable[[Any, Any], Any],
    target: Any,
    stage_budgets: Sequence[int | None] | None = None,
    request: Request | None = None,
    **flat: Unpack[RequestArgs],
) -> PipelinePlan:
    """Plan every stage of a ``torch.distributed.pipelining`` pipeline and wrap each stage's
    blocks **in place**, as :func:`remat.apply` does for one (``stages[i]`` is stage ``i``'s
    module; ``stage_inputs[i]`` one microbatch's inputs of it: token ids for the first, the
    activations it receives for the others; ``target`` one microbatch's target, for the last
    stage's ``loss_fn``).

    Budgets are per stage: the request's (``budget_gb``, ``activation_budget_bytes``, ...)
    for every stage, or ``stage_budgets[i]`` bytes of activations for stage ``i``. Each
    stage gets its plan of least recompute that fits its budget over a whole
    ``schedule.step()``; together these are the plans of least simulated step time (the
    module docstring says why). If a stage cannot fit, the stages already wrapped are
    unwrapped and the :class:`remat.BudgetError` names the stage and its least peak.
    In a real run each rank holds one stage: plan ahead here (FakeTensor modules cost no
    memory), then ``remat.save_plan(stages[i], path)`` and ``remat.apply(stage,
    ..., pipeline=..., plan=path)`` on rank ``i``.
    """
    req = request_of(request, flat)
    n = len(stages)
    if len(stage_inputs) != n:
        raise ValueError(f"{len(stage_inputs)} stage inputs for {n} stages")
    if stage_budgets is not None and len(stage_budgets) != n:
        raise ValueError(f"{len(stage_budgets)} stage budgets for {n} stages")
    if schedule.lower() in {m.lower() for m in MULTI_STAGE}:
        raise PipelineError(
            f"plan_pipeline plans one stage per rank ({', '.join(SINGLE_STAGE)}); under "
            f"{schedule} plan each rank's stages with remat.apply(nn.ModuleList(stages), "
            "inputs, pipeline=remat.Pipeline(..., stages_per_rank=V))"
        )
    pipes = [Pipeline(schedule, i, n, microbatches, loss_fn=loss_fn) for i in range(n)]
    states: list[Applied] = []
    budgets: list[int | None] = []
    try:
        for i, (module, x, pipe) in enumerate(zip(stages, stage_inputs, pipes, strict=True)):
            stage_req = req
            if stage_budgets is not None:
                stage_req = replace(
                    req, budget_bytes=None, activation_budget_bytes=stage_budgets[i]
                )
            budgets.append(stage_req.step_budget(stage_req.device(module)))
            apply(
                module,
                x,
                request=stage_req,
                pipeline=pipe,
                target=target if pipe.last else None,
            )
            states.append(applied(module))
    except BaseException:
        for module in stages[: len(states)]:
            unapply(module)
        raise
    return _report(pipes[0].schedule, microbatches, states, budgets)


def _report(
    schedule: str, microbatches: int, states: Sequence[Applied], budgets: Sequence[int | None]
) -> PipelinePlan:
    schedules = [_schedule(s) for s in states]
    orders = [[(a.kind, a.microbatch) for a in t.actions] for t in schedules]
    planned, eager = [], []
    for s in states:
        sim = s.plan.simulation
        planned.append(StageTimes(sim.forward_time_s, sim.backward_time_s))
        eager.append(StageTimes(*s.eager_times_s))
    timing = simulate_pipeline(orders, planned)
    eager_timing = simulate_pipeline(orders, eager)
    reports = tuple(
        StageReport(
            stage=i,
            in_flight=t.max_in_flight,
            budget_bytes=budgets[i],
            peak_bytes=s.plan.predicted_peak_bytes,
            eager_peak_bytes=s.eager_peak_bytes,
            recompute_s=s.plan.simulation.recompute_time_s * microbatches,
            idle_s=timing.idle_s[i],
            eager_idle_s=eager_timing.idle_s[i],
        )
        for i, (s, t) in enumerate(zip(states, schedules, strict=True))
    )
    return PipelinePlan(schedule, microbatches, reports, timing, eager_timing)


def _schedule(state: Applied) -> ScheduleTrace:
    assert state.schedule is not None  # applied with pipeline=
    return state.schedule
