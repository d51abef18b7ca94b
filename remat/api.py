"""``remat.optimize``: the one call most users need."""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat.budget import (
    DEFAULT_RESERVE,
    FSDP_MIXED,
    GB,
    DeviceBudget,
    DeviceBudgetError,
    Options,
    StaticMemory,
    device_budget,
    static_memory,
)
from remat.graph.dynamic import capture_dynamic, sequence_dims
from remat.graph.profiles import DeviceProfile, auto_profile_name
from remat.lengths import LengthPlans, PlanningEvent, bucket_tops
from remat.pipeline import Analysis, BudgetError, analyze, choose_plan
from remat.problem import Problem
from remat.rewrite.executor import build_executor
from remat.rewrite.module import Compiled, RematModule, signature
from remat.solver.config import SolverConfig
from remat.solver.formula import FitError
from remat.solver.plan import Plan


def _as_args(example_inputs: Any) -> tuple[Any, ...]:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise ValueError(
        f"example_inputs must be a tensor or a tuple of tensors, got {type(example_inputs).__name__}"
    )


def optimize(
    model: nn.Module,
    example_inputs: Any,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    budget_gb: float | None = None,
    budget_bytes: int | None = None,
    optimizer: str = "adamw",
    precision: str = "fp32",
    zero_stage: int = 0,
    world_size: int = 1,
    reserve_fraction: float = DEFAULT_RESERVE,
    activation_budget_bytes: int | None = None,
    plan: str | Path | Plan | None = None,
    solver: str | None = None,
    device_profile: str | DeviceProfile = "auto",
    time_limit_s: float = 60.0,
    block_types: tuple[str, ...] = (),
    max_seq: int | None = None,
    seq_buckets: Sequence[int] = (),
    progress: Callable[[str], None] | None = None,
) -> RematModule:
    """Plan which activations ``model`` keeps for its backward and return a module that trains
    exactly like it (same outputs and gradients) within the memory budget.

    Args:
        model: the model; it is not modified. The returned module shares its parameters and
            buffers (the same tensor objects, the same ``state_dict`` keys).
        example_inputs: a tensor or tuple of tensors, with the shapes training will use.
        example_kwargs: keyword arguments of the forward (tensors or constants such as
            ``use_cache=False``; ``use_cache`` defaults to False when the forward accepts it).
        budget_gb, budget_bytes: the whole device's memory (1 GB = 1e9 bytes). remat subtracts
            what lives across steps (parameters, optimizer state, gradient shards under ZeRO
            2-3; see :mod:`remat.budget` for the convention) and a reserve, and plans the step
            in the rest. ``module.plan.device_memory`` has the breakdown; ``remat.explain``
            prints it.
        optimizer: ``adamw``, ``adam``, ``sgd`` (with momentum) or ``none``.
        precision: ``fp32``, ``bf16-mixed`` or ``fp16-mixed`` (the step is traced and run
            under ``torch.autocast``: activations have their 16-bit sizes).
        zero_stage, world_size: ZeRO sharding of optimizer state (1), gradients (2) and
            parameters (3) over ``world_size`` devices.
        reserve_fraction: share of the budget kept for the allocator, kernel workspaces and
            communication buffers (default 5%).
        activation_budget_bytes: instead of a device budget, a bound on the step's peak alone
            (``plan.predicted_peak_bytes``: activations, output and parameter gradients).
        plan: ``"keep_all"``, ``"keep_inputs"``, ``"keep_matmuls"``, a :class:`Plan`, or a
            plan file (``*.json``, from ``module.save_plan``) re-applied without solving; a
            file solved for another graph raises :class:`remat.PlanFileError`.
        solver: a name from ``remat.solver.registry.SOLVERS`` or ``"auto"`` (the default): the
            plan with the least recompute time, among all solvers, that fits the budget.
        device_profile: cost model for recompute time: ``auto`` (the device the parameters are
            on), ``cpu``, ``a100``, ``h100``, ``h200``, or a :class:`remat.DeviceProfile`.
        time_limit_s: wall-clock limit of optimizing solvers.
        block_types: module class names or path patterns the ``block`` baseline checkpoints.
        max_seq: the longest sequence training will use, for inputs whose length varies (dim 1
            of the first input, token ids; the example at or below it, of 8 tokens or more).
            The plan is solved at ``max_seq``, and its peak at every shorter length, an exact
            formula, is checked against the budget: a new length is captured and runs the same
            plan, with no solve and no warning. ``module.lengths`` has the plans, their
            formulas and what each length cost. Costs 7 captures at small shapes (4 at batch 1)
            before the first solve.
        seq_buckets: with ``max_seq``, the longest length of each bucket (e.g. ``(512, 1024,
            2048)``): one plan per bucket, each solved at its longest length, so short
            batches keep more and recompute less.
        progress: called with a short status line as long solves advance.

    Without any budget everything is kept. A budget below the static memory raises
    :class:`remat.StaticMemoryError` (with the breakdown and what would fit); one below the
    least feasible step peak raises :class:`remat.BudgetError` stating that peak.

    The model may be built under ``remat.fake_mode()`` to plan shapes larger than this
    machine: the returned module then carries a plan but cannot run.
    """
    args = _as_args(example_inputs)
    kwargs = dict(example_kwargs or {})
    config = SolverConfig(
        time_limit_s=time_limit_s, block_types=tuple(block_types), progress=progress
    )
    if precision == FSDP_MIXED:
        raise ValueError(
            f"precision={FSDP_MIXED!r} (FSDP2's own mixed precision) is planned by remat.apply, not remat.optimize"
        )
    options = Options(
        optimizer=optimizer, precision=precision, zero_stage=zero_stage, world_size=world_size
    )
    device, step_budget = resolve_budget(
        model, budget_gb, budget_bytes, options, reserve_fraction, activation_budget_bytes
    )
    device_profile = resolve_profile(model, device_profile)

    def analysis_of(src: nn.Module, a: tuple[Any, ...], kw: Mapping[str, Any]) -> Analysis:
        return analyze(
            src,
            a,
            kw,
            device_profile=device_profile,
            precision=precision,
            grads_held=not options.grads_released,
        )

    def solved(problem: Problem) -> Plan:
        try:
            chosen = choose_plan(
                problem,
                plan=plan,
                solver=solver,
                activation_budget_bytes=step_budget,
                config=config,
            )
        except BudgetError as e:
            if device is None:
                raise
            raise DeviceBudgetError(device, e) from None
        return chosen

    def compiled(analysis: Analysis, chosen: Plan, solve_s: float) -> Compiled:
        if device is not None:
            chosen = dataclasses.replace(chosen, device_memory=device.breakdown(chosen))
        t_rewrite = time.perf_counter()
        executor = build_executor(analysis.joint, analysis.problem, chosen)
        timings = {
            **analysis.timings,
            "solve": solve_s,
            "rewrite": time.perf_counter() - t_rewrite,
        }
        return Compiled(analysis.captured, executor, analysis.problem, timings)

    lengths: LengthPlans | None = None

    def planner(src: nn.Module, a: tuple[Any, ...], kw: Mapping[str, Any]) -> Compiled:
        t0 = time.perf_counter()
        analysis = analysis_of(src, a, kw)
        t_solve = time.perf_counter()
        s = lengths.length_of(a, kw) if lengths is not None else None
        if lengths is not None and s is not None and src.training == lengths.training:
            fitted = lengths.plan_at(analysis.problem, s)
            if fitted is not None:
                done = compiled(analysis, fitted, time.perf_counter() - t_solve)
                bucket = lengths.bucket_of(s)
                lengths.record(PlanningEvent(s, bucket.hi, time.perf_counter() - t0))
                return done
            warnings.warn(
                f"remat: the graph at length {s} differs from the one fitted for max_seq (the "
                "model branches on these inputs); solving a plan for it alone",
                stacklevel=4,
            )
        chosen = solved(analysis.problem)
        return compiled(analysis, chosen, time.perf_counter() - t_solve)

    if max_seq is not None or seq_buckets:
        lengths = _length_plans(
            model, args, kwargs, analysis_of, solved, step_budget, options, max_seq, seq_buckets,
            progress,
        )  # fmt: skip
    first_compiled = planner(model, args, kwargs)
    return RematModule(model, first_compiled, signature(args, kwargs), planner, lengths)


def _length_plans(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    analysis_of: Callable[[nn.Module, tuple[Any, ...], Mapping[str, Any]], Analysis],
    solved: Callable[[Problem], Plan],
    step_budget: int | None,
    options: Options,
    max_seq: int | None,
    seq_buckets: Sequence[int],
    progress: Callable[[str], None] | None,
) -> LengthPlans:
    """The fit over lengths at the example's batch (:func:`remat.graph.dynamic.capture_dynamic`)
    and a plan per bucket, each solved at its longest length."""
    tops = bucket_tops(max_seq, seq_buckets)
    dims = sequence_dims(args, kwargs, tops[-1])
    t0 = time.perf_counter()
    try:
        dynamic = capture_dynamic(
            lambda a, kw: analysis_of(model, a, kw),
            args,
            kwargs,
            dims,
            max_seq=tops[-1],
            batch=dims.batch,
            progress=progress,
        )
    except FitError as e:
        raise ValueError(
            f"max_seq: the step cannot be fitted over lengths ({e}); plan each length "
            "without max_seq"
        ) from None
    plans = LengthPlans(
        dynamic,
        tops,
        model_static_memory(model, options),
        solved,
        step_budget,
        (args, kwargs),
        model.training,
        time.perf_counter() - t0,
    )
    for bucket in plans.buckets:  # now, so a budget too small fails here, not mid-training
        if progress:
            progress(f"solving for lengths {bucket.lo}..{bucket.hi} at length {bucket.hi}")
        plans.solved(bucket)
    return plans


_CPU = torch.device("cpu")


def resolve_budget(
    model: nn.Module,
    budget_gb: float | None,
    budget_bytes: int | None,
    options: Options,
    reserve_fraction: float,
    activation_budget_bytes: int | None,
) -> tuple[DeviceBudget | None, int | None]:
    """The whole-device budget (if one was given) and the bound on the step's peak it leaves,
    or ``activation_budget_bytes``: what :func:`optimize` and :func:`remat.apply` plan for."""
    device = _device_budget(model, budget_gb, budget_bytes, options, reserve_fraction)
    if device is not None and activation_budget_bytes is not None:
        raise ValueError("pass a device budget (budget_gb/budget_bytes) or activation_budget_bytes")
    return device, device.step_budget_bytes if device is not None else activation_budget_bytes


def resolve_profile(model: nn.Module, device_profile: str | DeviceProfile) -> str | DeviceProfile:
    """``auto``: the profile of the device the model's parameters are on."""
    if isinstance(device_profile, str) and device_profile == "auto":
        first = next(iter(model.parameters()), None)
        return auto_profile_name(first.device if first is not None else _CPU)
    return device_profile


def _device_budget(
    model: nn.Module,
    budget_gb: float | None,
    budget_bytes: int | None,
    options: Options,
    reserve_fraction: float,
) -> DeviceBudget | None:
    if budget_gb is not None and budget_bytes is not None:
        raise ValueError("pass budget_gb or budget_bytes, not both")
    if budget_gb is not None:
        budget_bytes = int(budget_gb * GB)
    if budget_bytes is None:
        return None
    return device_budget(
        budget_bytes, model_static_memory(model, options), options, reserve_fraction
    )


def model_static_memory(model: nn.Module, options: Options) -> StaticMemory:
    """:func:`remat.budget.static_memory` of ``model``'s parameters as it holds them."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    return static_memory(
        trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
        frozen_bytes=sum(p.numel() * p.element_size() for p in frozen),
        trainable=sum(p.numel() for p in trainable),
        frozen=sum(p.numel() for p in frozen),
        options=options,
    )
