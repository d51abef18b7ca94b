"""Will it fit a pipeline? The longest sequence and the largest microbatch each plan fits on
every rank of a ``torch.distributed.pipelining`` pipeline, each rank within its own budget.

    report = remat.fit_pipeline(stages, inputs, schedule="1F1B", microbatches=8,
                                loss_fn=loss, target=target, budget_gb=80)
    report.plans["every block"].max_microbatch

A rank's peak is not one microbatch's step but a whole ``schedule.step()``'s: every microbatch
in flight, the receive buffers. So each rank's plans are traced through the schedule at the
fit's shapes and every moment of that step fitted (:func:`remat.fit.sac_formula.stage_dynamic`);
the search then evaluates formulas, as :func:`remat.fit.fit` does on one device. A row holds
when every rank fits: the fixed plans alike on every rank, ``least peak`` and
``remat <= N%`` each rank's own choice (a rank's recompute share is of its own step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from typing_extensions import Unpack

from remat.budget import DeviceBudget
from remat.fit.graph_shapes import Dims
from remat.fit.sac_formula import stage_dynamic
from remat.fit.sac_shapes import NativeDynamic, NativeRange
from remat.fit.search import FIXED_SAC, Choice, _largest, _row_choice, _row_names
from remat.measure.profiles import DeviceProfile, get_profile
from remat.parallel.pipeline_plan import rank_module, rank_pipelines
from remat.parallel.pipelining import Pipeline
from remat.request import Request, RequestArgs, request_of, resolve_profile

__all__ = ["PipelineFitReport", "PipelineFitRow", "fit_pipeline"]


@dataclass(frozen=True)
class PipelineFitRow:
    """Where one plan stops fitting the pipeline."""

    max_seq: int | None
    """The longest sequence at the report's microbatch size (None: not even the shortest)."""
    max_microbatch: int | None
    """The largest microbatch at the report's sequence; a step's batch is this times the
    microbatches."""
    at_max_seq: tuple[Choice | None, ...]
    """Per rank, its saved set, step peak and recompute share at ``(microbatch, max_seq)``."""
    at_max_microbatch: tuple[Choice | None, ...]
    seq_bound_by: int | None
    """The rank that does not fit one more token (None: the longest length searched)."""
    microbatch_bound_by: int | None
    """The rank that does not fit one more sample per microbatch (None: the limit)."""


@dataclass(frozen=True)
class PipelineFitReport:
    schedule: str
    microbatches: int
    budgets: tuple[DeviceBudget, ...]
    """Per rank: its device budget, static memory (its stages' shards) and step budget."""
    microbatch: int
    """The example's microbatch size (the sequence search's)."""
    seq: int
    seq_limit: int | None
    microbatch_limit: int
    plans: Mapping[str, PipelineFitRow]
    planners: tuple[_RankPlanner, ...] = field(default=(), repr=False, compare=False)

    def choose(self, plan: str, b: int, s: int) -> tuple[Choice | None, ...]:
        """Each rank's saved set under row ``plan`` at microbatch ``b`` and length ``s``."""
        return tuple(p.choose(plan, b, s) for p in self.planners)

    def to_json(self) -> dict[str, Any]:
        def per_rank(choices: tuple[Choice | None, ...], key: str) -> list[Any]:
            out: list[Any] = []
            for budget, ch in zip(self.budgets, choices, strict=True):
                if ch is None:
                    out.append(None)
                elif key == "peak":
                    out.append(budget.static.total + ch.step_peak_bytes)
                else:
                    out.append(round(ch.recompute_pct, 3))
            return out

        return {
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "microbatch": self.microbatch,
            "seq": self.seq,
            "budget_bytes": self.budgets[0].budget_bytes,
            "static_bytes": [b.static.total for b in self.budgets],
            "step_budget_bytes": [b.step_budget_bytes for b in self.budgets],
            "plans": {
                name: {
                    "max_seq": row.max_seq,
                    "max_microbatch": row.max_microbatch,
                    "max_batch": None
                    if row.max_microbatch is None
                    else row.max_microbatch * self.microbatches,
                    "seq_bound_by": row.seq_bound_by,
                    "microbatch_bound_by": row.microbatch_bound_by,
                    "peak_bytes_at_max_seq": per_rank(row.at_max_seq, "peak"),
                    "recompute_pct_at_max_seq": per_rank(row.at_max_seq, "pct"),
                }
                for name, row in self.plans.items()
            },
        }


class _RankPlanner:
    """One rank's traced plans, evaluated at shapes from formulas alone; the range of
    microbatch sizes a search reaches (``b = 1``, ``b >= 2``) is traced when it first does."""

    def __init__(
        self, trace_range: Callable[[int], NativeDynamic], profile: DeviceProfile, batch: int
    ) -> None:
        self._trace_range = trace_range
        self.profile = profile
        self.ranges: list[NativeRange] = list(trace_range(batch).ranges)

    def _range(self, b: int, s: int) -> NativeRange | None:
        r = next((r for r in self.ranges if r.contains(b, s)), None)
        if r is not None:
            return r
        traced = [r.shapes.b_range for r in self.ranges]
        if any(lo <= b and (hi is None or b <= hi) for lo, hi in traced):
            return None  # a traced range of b, s outside it
        self.ranges += self._trace_range(b).ranges
        return next((r for r in self.ranges if r.contains(b, s)), None)

    def choose(self, plan: str, b: int, s: int) -> Choice | None:
        r = self._range(b, s)
        if r is None:
            return None
        options = [
            Choice(name, step.peak.peak(b, s)[0], step.recompute_pct(self.profile, b, s))
            for name, step in r.steps.items()
        ]
        return _row_choice(plan, FIXED_SAC, options)


def fit_pipeline(
    stages: Sequence[nn.Module],
    stage_inputs: Sequence[Any],
    *,
    schedule: str,
    microbatches: int,
    loss_fn: Callable[[Any, Any], Any],
    target: Any,
    stages_per_rank: int = 1,
    menus: bool = False,
    max_microbatch: int = 1 << 16,
    request: Request | None = None,
    **flat: Unpack[RequestArgs],
) -> PipelineFitReport:
    """For each plan, the longest sequence at the example's microbatch size and the largest
    microbatch at its length with which every rank of the pipeline fits its device budget
    (the module docstring). The stages, their inputs and ``target`` are as
    :func:`remat.plan_pipeline` takes them, one microbatch each; nothing is wrapped.

    The request needs a device budget (per rank: each holds its stages); its ``max_seq`` is
    the longest length searched (default: the stages' ``config.max_position_embeddings``,
    else 8x the example's). ``menus``: also each uniform option of the chain DP's menus
    (``remat fit --pp-size --menus``; each one more schedule trace per shape and rank), for
    finer ``remat <= N%`` rows; the fixed plans alone by default.
    """
    req = request_of(request, flat)
    if req.host_budget_bytes:
        raise ValueError("host_budget: remat fit plans without offload so far")
    pipes = rank_pipelines(stages, stage_inputs, schedule, microbatches, loss_fn, stages_per_rank)
    dims = Dims.of((stage_inputs[0],), {}, seq=True)  # raises without a dim 1
    assert dims.seq is not None
    max_seq = req.max_seq
    if max_seq is None:
        cfg = getattr(stages[0], "config", None)
        max_seq = getattr(cfg, "max_position_embeddings", None) or 8 * dims.seq
    req = dataclasses.replace(req, max_seq=int(max_seq))
    budgets: list[DeviceBudget] = []
    planners: list[_RankPlanner] = []
    for r, pipe in enumerate(pipes):
        module, x = rank_module(stages, stage_inputs, pipe)
        budget = req.device(module)
        if budget is None:
            raise ValueError("pass budget_gb or budget_bytes")
        budgets.append(budget)
        planners.append(_rank_planner(module, x, pipe, target, req, r, menus))
    names = _row_names(FIXED_SAC)
    rows = {
        name: _row(name, planners, budgets, dims, int(max_seq), max_microbatch, req)
        for name in names
    }
    return PipelineFitReport(
        schedule=pipes[0].schedule,
        microbatches=microbatches,
        budgets=tuple(budgets),
        microbatch=dims.batch,
        seq=dims.seq,
        seq_limit=int(max_seq),
        microbatch_limit=max_microbatch,
        plans=rows,
        planners=tuple(planners),
    )


def _rank_planner(
    module: nn.Module, x: Any, pipe: Pipeline, target: Any, req: Request, rank: int, menus: bool
) -> _RankPlanner:
    inputs = x if isinstance(x, tuple) else (x,)
    progress = req.progress
    where = "stage" if pipe.stages_per_rank == 1 else "rank"
    stage_req = dataclasses.replace(
        req, progress=None if progress is None else (lambda m: progress(f"{where} {rank}: {m}"))
    )

    def trace_range(b: int) -> NativeDynamic:
        t = target if pipe.last else None
        return stage_dynamic(module, inputs, pipe, t, stage_req, menus=menus, batch=b)[0]

    profile = get_profile(resolve_profile(module, req.device_profile))
    return _RankPlanner(trace_range, profile, Dims.of(inputs, {}, seq=True).batch)


def _row(
    name: str,
    planners: Sequence[_RankPlanner],
    budgets: Sequence[DeviceBudget],
    dims: Dims,
    max_seq: int,
    max_microbatch: int,
    req: Request,
) -> PipelineFitRow:
    if req.progress:
        req.progress(f"searching: {name}")

    def failing(b: int, s: int) -> int | None:
        """The first rank that does not fit at ``(b, s)``."""
        for r, (p, budget) in enumerate(zip(planners, budgets, strict=True)):
            ch = p.choose(name, b, s)
            if ch is None or ch.step_peak_bytes > budget.step_budget_bytes:
                return r
        return None

    b0, s0 = dims.batch, dims.seq
    assert s0 is not None
    top_s = _largest(lambda s: failing(b0, s) is None, 3, max_seq)
    # From the example's range of microbatch sizes (b = 1 is another, traced if needed).
    lo = 2 if b0 >= 2 else 1
    top_b = _largest(lambda b: failing(b, s0) is None, lo, max_microbatch)
    if top_b is None and lo == 2 and failing(1, s0) is None:
        top_b = 1

    def at(b: int | None, s: int | None) -> tuple[Choice | None, ...]:
        if b is None or s is None:
            return (None,) * len(planners)
        return tuple(p.choose(name, b, s) for p in planners)

    return PipelineFitRow(
        top_s,
        top_b,
        at(b0, top_s),
        at(top_b, s0),
        None if top_s is None or top_s >= max_seq else failing(b0, top_s + 1),
        None if top_b is None or top_b >= max_microbatch else failing(top_b + 1, s0),
    )
