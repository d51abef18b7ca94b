"""``remat.plan_pipeline``: every stage of a pipeline planned at once, and the step it runs.

A stage's plan changes the pipeline's step only through that stage's backwards, which the
recompute lengthens; the step (:func:`remat.solver.stages.simulate_ranks`: each rank runs
its schedule's action order, a forward waits for the previous stage's, a backward for the
next stage's) is a max-plus expression of the actions' times, so it never falls when one
action gets longer. Under one budget per rank the ranks' plans do not constrain each
other, so the plans of least recompute per rank are together the plans of least step
time: no rank's slack can buy memory for another. What the pipeline adds is where
the recompute lands: on the stages that hold the most microbatches (stage 0 under 1F1B),
and whether it lengthens the step or only fills a stage's idle time. The report says that
per rank (its stage, or under a multi-stage schedule its stages), with and without the
plans.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn
from typing_extensions import Unpack

from remat.executors.sac.apply import apply, unapply
from remat.executors.sac.state import Applied, applied
from remat.parallel.pipelining import (
    Pipeline,
    ScheduleTrace,
)
from remat.request import Request, RequestArgs, request_of
from remat.solver.stages import PipelineTiming, RankAction, simulate_ranks

__all__ = ["PipelinePlan", "StageReport", "plan_pipeline"]


@dataclass(frozen=True)
class StageReport:
    """One rank under its plan, over a whole ``schedule.step()``: its stage, or under a
    multi-stage schedule its stages (:attr:`stages`)."""

    stage: int
    """The rank's index: its stage's, or its first stage's under a multi-stage schedule."""
    in_flight: int
    """The most microbatches whose saved activations the rank holds at once (several
    stages: microbatch-stage pairs)."""
    budget_bytes: int | None
    peak_bytes: int
    """Predicted at the allocator over the step, with the plan."""
    eager_peak_bytes: int
    """The same with no checkpoint."""
    recompute_s: float
    """Estimated time of what the stage's backwards recompute, all microbatches."""
    idle_s: float
    """The step's time less the rank's busy time, with the plan."""
    eager_idle_s: float
    stages: tuple[int, ...] = ()
    """The stages the rank holds (its own index alone under one stage per rank)."""


@dataclass(frozen=True)
class PipelinePlan:
    """What :func:`plan_pipeline` planned: each rank's plan (on the module it was planned
    on, :attr:`modules`: ``remat.plan_of(modules[r])``) and the pipeline's simulated step
    with and without them."""

    schedule: str
    microbatches: int
    stages: tuple[StageReport, ...]
    """One per rank."""
    timing: PipelineTiming
    eager_timing: PipelineTiming
    modules: tuple[nn.Module, ...] = ()
    """Per rank, what was planned and wrapped: its stage module, or under a multi-stage
    schedule its stages as one ``nn.ModuleList`` (``remat.save_plan(modules[r], path)``, then
    ``remat.apply(that list, ..., plan=path)`` on rank ``r``)."""

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

        n = sum(len(s.stages) for s in self.stages)
        on = f" on {len(self.stages)} ranks" if n > len(self.stages) else ""
        table = Table(title=f"{self.schedule}, {n} stages{on}, {self.microbatches} microbatches")
        several = any(len(s.stages) > 1 for s in self.stages)
        first = "rank (stages)" if several else "stage"
        for col in (first, "in flight", "budget", "peak (no ckpt -> plan)"):
            table.add_column(col, justify="right")
        for col in ("recompute ms", "idle ms (no ckpt -> plan)"):
            table.add_column(col, justify="right")
        for s in self.stages:
            table.add_row(
                f"{s.stage} ({', '.join(map(str, s.stages))})" if several else str(s.stage),
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
            "rank's action order and estimated op times)\n"
        )


def plan_pipeline(
    stages: Sequence[nn.Module],
    stage_inputs: Sequence[Any],
    *,
    schedule: str,
    microbatches: int,
    loss_fn: Callable[[Any, Any], Any],
    target: Any,
    stages_per_rank: int = 1,
    stage_budgets: Sequence[int | None] | None = None,
    request: Request | None = None,
    **flat: Unpack[RequestArgs],
) -> PipelinePlan:
    """Plan every stage of a ``torch.distributed.pipelining`` pipeline and wrap each stage's
    blocks **in place**, as :func:`remat.apply` does for one (``stages[i]`` is stage ``i``'s
    module; ``stage_inputs[i]`` one microbatch's inputs of it: token ids for the first, the
    activations it receives for the others; ``target`` one microbatch's target, for the last
    stage's ``loss_fn``).

    Multi-stage schedules (``Interleaved1F1B``, ``LoopedBFS``): ``stages_per_rank`` stages
    on each rank, rank ``r`` holding stages ``r, r + ranks, ...``; each rank's stages are
    planned together, as one ``nn.ModuleList`` (:attr:`PipelinePlan.modules`), each stage
    taking one tensor input.

    Budgets are per rank (one device each): the request's (``budget_gb``,
    ``activation_budget_bytes``, ...) for every rank, or ``stage_budgets[r]`` bytes of
    activations for rank ``r``. Each rank gets its plan of least recompute that fits its
    budget over a whole ``schedule.step()``; together these are the plans of least simulated
    step time (the module docstring says why). If a rank cannot fit, the ranks already
    wrapped are unwrapped and the :class:`remat.BudgetError` names the stage and its least
    peak. In a real run each rank holds its stages: plan ahead here (FakeTensor modules cost
    no memory), then ``remat.save_plan(plan.modules[r], path)`` and ``remat.apply(...,
    pipeline=..., plan=path)`` on rank ``r``.
    """
    req = request_of(request, flat)
    pipes = rank_pipelines(stages, stage_inputs, schedule, microbatches, loss_fn, stages_per_rank)
    if stage_budgets is not None and len(stage_budgets) != len(pipes):
        what = "stages" if stages_per_rank == 1 else "ranks"
        raise ValueError(f"{len(stage_budgets)} stage budgets for {len(pipes)} {what}")
    modules: list[nn.Module] = []
    states: list[Applied] = []
    budgets: list[int | None] = []
    try:
        for r, pipe in enumerate(pipes):
            module, x = rank_module(stages, stage_inputs, pipe)
            stage_req = req
            if stage_budgets is not None:
                stage_req = replace(
                    req, budget_bytes=None, activation_budget_bytes=stage_budgets[r]
                )
            budgets.append(stage_req.step_budget(stage_req.device(module)))
            apply(
                module,
                x,
                request=stage_req,
                pipeline=pipe,
                target=target if pipe.last else None,
            )
            modules.append(module)
            states.append(applied(module))
    except BaseException:
        for module in modules:
            unapply(module)
        raise
    return _report(pipes, states, budgets, modules)


def rank_pipelines(
    stages: Sequence[nn.Module],
    stage_inputs: Sequence[Any],
    schedule: str,
    microbatches: int,
    loss_fn: Callable[[Any, Any], Any],
    stages_per_rank: int,
) -> list[Pipeline]:
    """Each rank's place in the pipeline of ``stages`` (one input each), rank by rank."""
    n = len(stages)
    if len(stage_inputs) != n:
        raise ValueError(f"{len(stage_inputs)} stage inputs for {n} stages")
    pipe0 = Pipeline(schedule, 0, n, microbatches, loss_fn=loss_fn, stages_per_rank=stages_per_rank)
    return [replace(pipe0, stage=r) for r in range(pipe0.ranks)]


def rank_module(
    stages: Sequence[nn.Module], stage_inputs: Sequence[Any], pipe: Pipeline
) -> tuple[nn.Module, Any]:
    """What ``remat.apply`` plans for ``pipe``'s rank: its stage and that stage's inputs, or
    its stages as one ``nn.ModuleList`` and one input each."""
    if pipe.stages_per_rank == 1:
        return stages[pipe.stage], stage_inputs[pipe.stage]
    return nn.ModuleList(stages[i] for i in pipe.indices), tuple(
        stage_inputs[i] for i in pipe.indices
    )


def _report(
    pipes: Sequence[Pipeline],
    states: Sequence[Applied],
    budgets: Sequence[int | None],
    modules: Sequence[nn.Module],
) -> PipelinePlan:
    schedules = [_schedule(s.schedule) for s in states]
    timing = simulate_ranks([_actions(t) for t in schedules])
    eager_timing = simulate_ranks([_actions(_schedule(s.eager_schedule)) for s in states])
    microbatches = pipes[0].microbatches
    reports = tuple(
        StageReport(
            stage=r,
            in_flight=t.max_in_flight,
            budget_bytes=budgets[r],
            peak_bytes=s.plan.predicted_peak_bytes,
            eager_peak_bytes=s.eager_peak_bytes,
            recompute_s=s.plan.simulation.recompute_time_s * microbatches,
            idle_s=timing.idle_s[r],
            eager_idle_s=eager_timing.idle_s[r],
            stages=pipes[r].indices,
        )
        for r, (s, t) in enumerate(zip(states, schedules, strict=True))
    )
    return PipelinePlan(
        pipes[0].schedule, microbatches, reports, timing, eager_timing, tuple(modules)
    )


def _actions(schedule: ScheduleTrace) -> list[RankAction]:
    """A rank's traced schedule as the simulator's actions, each with its traced time."""
    return [RankAction(a.stage, a.kind, a.microbatch, a.time_s) for a in schedule.actions]


def _schedule(schedule: ScheduleTrace | None) -> ScheduleTrace:
    assert schedule is not None  # applied with pipeline=
    return schedule
