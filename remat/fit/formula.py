"""Will it fit? A training step's peak memory as an exact formula in batch and sequence length.

    f = remat.memory_formula(model, example_inputs, plan="keep_all")
    print(f)                      # the formula, per range of shapes, with its pieces
    f.peak_bytes(b=4, s=2048)     # device bytes: static + the step's peak, to the byte
    f.expr                        # a sympy expression in b and s

The step is captured at a few shapes and every size fitted exactly
(:mod:`remat.fit.graph_shapes`); a plan's live bytes at every moment are then polynomials, and
the peak is their maximum (:mod:`remat.solver.formula`). Evaluated at any shape of its ranges
it equals the simulator's peak for a concrete capture at that shape, which is the measured
peak of a real run (``tests/fit/test_formula.py`` checks both).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from remat.budget import OptimizerName, Options, Precision, StaticMemory
from remat.executors.graph.analyze import analyze
from remat.executors.graph.loss import loss_at
from remat.executors.sac.planner import NATIVE_PLANS
from remat.fit.graph_shapes import Dims, DynamicProblem, ShapeRange, capture_dynamic, range_text
from remat.fit.peak import MemoryFormula, RangeFormula
from remat.fit.sac_formula import Copies, native_dynamic
from remat.fit.sac_formula import formula_of as native_formula_of
from remat.measure.meter import Loss
from remat.measure.profiles import DeviceProfile
from remat.request import Request, as_args, model_static_memory, resolve_profile
from remat.solver.executor import EXECUTORS as EXECUTOR_MODELS
from remat.solver.formula import peak_candidates, step_polynomials
from remat.solver.plan import Plan, make_plan
from remat.solver.registry import solve

__all__ = [
    "MemoryFormula",
    "RangeFormula",
    "analyze_dynamic",
    "formula_of",
    "memory_formula",
]


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


class Named(Protocol):
    """An executor (:class:`remat.executors.Executor`) as this module reads it: by the name
    the solver core models it by (importing the executors' module here would close an import
    cycle through :mod:`remat.executors.graph.optimize`)."""

    @property
    def name(self) -> str: ...


def executor_name(executor: str | Named) -> str:
    """The name of ``executor`` (:class:`remat.executors.Executor`, or its name: ``graph``,
    remat's whole-graph executor; ``sac``, PyTorch's selective checkpointing on the model's
    blocks), checked against the executors the solver core models."""
    name = executor if isinstance(executor, str) else executor.name
    if name not in EXECUTOR_MODELS:
        raise ValueError(f"unknown executor {name!r}; valid: {', '.join(EXECUTOR_MODELS)}")
    return name


def memory_formula(
    model: nn.Module,
    example_inputs: Any,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    plan: str | Plan = "keep_all",
    executor: str | Named = "graph",
    precision: Precision = "fp32",
    optimizer: OptimizerName = "adamw",
    zero_stage: int = 0,
    world_size: int = 1,
    device_profile: str | DeviceProfile = "auto",
    block_types: tuple[str, ...] = (),
    max_seq: int | None = None,
    seq: bool | None = None,
    progress: Callable[[str], None] | None = None,
    copies: Copies | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
) -> MemoryFormula:
    """The device's peak memory for ``plan`` as an exact formula in the batch ``b`` and, for
    a model with a sequence dimension (dim 1 of the first input, token ids), its length ``s``.

    ``executor="graph"``: a plan of remat's own executor (a named plan, or a :class:`Plan`),
    the step captured at the fit's shapes. ``executor="sac"``: one of ``remat.apply``'s fixed
    plans (``keep_all``, ``keep_matmuls``, ``torchtitan_op``, ``block``) on the model's blocks (``block_types``),
    the step traced as ``remat.apply`` traces it (FSDP2 over ``world_size`` ranks with
    ``zero_stage=3``; ``precision="bf16-fsdp"`` for its mixed precision) at the same shapes;
    ``copies``: a builder of the model with ``n`` blocks, to trace a deep stack on copies with
    4 and 5 blocks, or 5 and 6 (:mod:`remat.fit.deep`).

    ``example_inputs`` must have a length of at least 8 (the fit captures at lengths around
    it); ``max_seq`` bounds the lengths the formula claims (the model's positions). The model
    is not modified. See :class:`MemoryFormula` for what it answers. ``loss_fn``/``target``:
    the loop's loss (as :func:`remat.optimize` and :func:`remat.apply` take it), its target
    tiled and cropped as the inputs are at every shape.
    """
    executor = executor_name(executor)
    loss = Loss.of(loss_fn, target)
    options = Options(
        optimizer=optimizer, precision=precision, zero_stage=zero_stage, world_size=world_size
    )
    static = model_static_memory(model, options)
    if executor == "sac":
        if not isinstance(plan, str) or plan not in NATIVE_PLANS:
            raise ValueError(
                f"executor='sac' takes one of remat.apply's fixed plans ({', '.join(NATIVE_PLANS)})"
            )
        req = Request.of(
            precision=precision, zero_stage=zero_stage, world_size=world_size,
            device_profile=device_profile, block_types=block_types, max_seq=max_seq,
            progress=progress,
        )  # fmt: skip
        native, _ = native_dynamic(
            model, as_args(example_inputs), dict(example_kwargs or {}), req, plans=(plan,),
            seq=seq, copies=copies, loss=loss,
        )  # fmt: skip
        return native_formula_of(native, plan, static)
    dynamic = analyze_dynamic(
        model,
        example_inputs,
        example_kwargs=example_kwargs,
        precision=precision,
        grads_held=not options.grads_released,
        device_profile=device_profile,
        max_seq=max_seq,
        seq=seq,
        progress=progress,
        loss=loss,
    )
    return formula_of(dynamic, plan, static)
