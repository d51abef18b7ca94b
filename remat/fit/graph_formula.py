"""The whole-graph executor's peak formula: the step captured at a few shapes
(:mod:`remat.fit.graph_shapes`), every size fitted exactly, and a plan's live bytes at every
moment as polynomials in ``(b, s)``, the peak their maximum (:mod:`remat.solver.formula`).
:func:`remat.memory_formula` (:mod:`remat.fit.formula`) answers with it for ``graph``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from remat.budget import StaticMemory
from remat.executors.graph.analyze import analyze
from remat.executors.graph.loss import loss_at
from remat.fit.graph_shapes import Dims, DynamicProblem, ShapeRange, capture_dynamic, range_text
from remat.fit.peak import MemoryFormula, RangeFormula
from remat.measure.meter import Loss
from remat.measure.profiles import DeviceProfile
from remat.request import as_args, resolve_profile
from remat.solver.formula import peak_candidates, step_polynomials
from remat.solver.plan import Plan, make_plan
from remat.solver.registry import solve

__all__ = ["MemoryFormula", "RangeFormula", "analyze_dynamic", "formula_of"]


def analyze_dynamic(
    model: nn.Module,
    example_inputs: Any,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    precision: str = "fp32",
    grads_held: bool = True,
    device_profile: str | DeviceProfile = "auto",
    max_seq: int | None = None,
    seq: bool | None = None,
    progress: Callable[[str], None] | None = None,
    loss: Loss | None = None,
) -> DynamicProblem:
    """The model's step at every shape: captured at the fit's shapes around the example's
    (:func:`remat.fit.graph_shapes.capture_dynamic`). ``seq``: whether dim 1 of the first input
    is a sequence (default: when it holds integers, as token ids do). ``loss``: the loop's
    loss, its target following the inputs' shapes (:func:`remat.executors.graph.loss.loss_at`)."""
    args = as_args(example_inputs)
    kwargs = dict(example_kwargs or {})
    profile = resolve_profile(model, device_profile)
    dims = Dims.of(args, kwargs, seq)

    def one(a: tuple[Any, ...], kw: Mapping[str, Any]) -> Any:
        return analyze(
            model, a, kw, device_profile=profile, precision=precision, grads_held=grads_held,
            loss=loss_at(loss, (args, kwargs), a, kw),
        )  # fmt: skip

    return capture_dynamic(one, args, kwargs, dims, max_seq=max_seq, progress=progress)


def _schedule_of(r: ShapeRange, plan: str | Plan) -> Any:
    if isinstance(plan, str):
        return solve(r.template, solver=plan, budget_bytes=None).schedule
    missing = [n for n in plan.saved if n not in r.template.by_name]
    if missing:
        raise ValueError(f"the plan keeps {missing[0]!r}, which this range's graph lacks")
    return make_plan(
        r.template, plan.saved, solver=plan.solver, reason=plan.reason, proof=plan.proof
    ).schedule


def formula_of(dynamic: DynamicProblem, plan: str | Plan, static: StaticMemory) -> MemoryFormula:
    """The device peak of ``plan`` over ``dynamic``'s ranges. A named plan (``keep_all``,
    ``keep_matmuls``, ``block``, ``megatron``, ...) is chosen per range; a :class:`Plan` (one
    saved set) covers the ranges whose graph has its values."""
    ranges = []
    notes = []
    for r in dynamic.ranges:
        try:
            schedule = _schedule_of(r, plan)
        except ValueError as e:
            if isinstance(plan, str):
                raise
            notes.append(f"{range_text(r)} not covered: {e}")
            continue
        moments = step_polynomials(r.template, schedule, r.storage, r.scratch)
        saved = moments.saved
        candidates = peak_candidates(moments, r.b_min, r.s_min or 0)
        if r.scratch:
            live = step_polynomials(r.template, schedule, r.storage)
            tensor_candidates = peak_candidates(live, r.b_min, r.s_min or 0)
        else:
            tensor_candidates = candidates
        ranges.append(
            RangeFormula(
                b_min=r.b_min,
                b_max=r.b_max,
                s_min=r.s_min,
                s_max=r.s_max,
                candidates=tuple(candidates),
                saved=saved,
                tensor_candidates=tuple(tensor_candidates),
            )
        )
    if not ranges:
        raise ValueError(f"the plan covers none of the ranges: {'; '.join(notes)}")
    name = plan if isinstance(plan, str) else plan.solver
    return MemoryFormula(name, static, tuple(ranges), dynamic.dims.seq is not None, tuple(notes))
