"""``remat.optimize``: the one call most users need."""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from typing_extensions import Unpack

from remat.budget import FSDP_MIXED
from remat.executors.graph.analyze import Analysis, analyze, choose_plan
from remat.executors.graph.lengths import LengthPlans, PlanningEvent, bucket_tops
from remat.executors.graph.loss import loss_at, module_ops, module_schedule
from remat.executors.graph.module import Compiled, RematModule, signature
from remat.executors.graph.run import build_executor
from remat.fit.graph_shapes import capture_dynamic, sequence_dims
from remat.measure.autocast import AUTOCAST
from remat.measure.meter import Loss
from remat.problem import Problem
from remat.request import (
    Request,
    RequestArgs,
    as_args,
    device_errors,
    model_static_memory,
    request_of,
    resolve_profile,
)
from remat.solver.formula import FitError
from remat.solver.plan import STEP_WITH_LOSS, STEP_WITHOUT_LOSS, Plan

__all__ = ["optimize"]


def optimize(
    model: nn.Module,
    example_inputs: Any,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    request: Request | None = None,
    **flat: Unpack[RequestArgs],
) -> RematModule:
    """Plan which activations ``model`` keeps for its backward and return a module that trains
    exactly like it (same outputs and gradients) within the memory budget.

    Args:
        model: the model; it is not modified. The returned module shares its parameters and
            buffers (the same tensor objects, the same ``state_dict`` keys).
        example_inputs: a tensor or tuple of tensors, with the shapes training will use.
        example_kwargs: keyword arguments of the forward (tensors or constants such as
            ``use_cache=False``; ``use_cache`` defaults to False when the forward accepts it).
        loss_fn, target: the loss the training loop computes from the module's output,
            ``loss_fn(output, target)`` (a scalar). The plan and its peak then cover the step
            the loop runs: ``out = module(*inputs); loss = loss_fn(out, target); del out;
            loss.backward()`` (the module still returns the output; the loop computes the
            loss). ``loss_fn`` must read only the output and the target (no trainable tensor of
            its own). ``target`` follows the inputs' batch and sequence sizes at other shapes
            (``max_seq``, a new batch). Without ``loss_fn`` the plan covers the module's
            forward and a backward from a dense output gradient, the output alive to the end.
        request: the whole request as one :class:`remat.Request`; or, as sugar, its fields as
            the flat keyword arguments below (not both).
        budget_gb, budget_bytes: the whole device's memory (1 GB = 1e9 bytes). remat subtracts
            what lives across steps (parameters, optimizer state, gradient shards under ZeRO
            2-3; see :mod:`remat.budget` for the convention) and a reserve, and plans the step
            in the rest. ``module.plan.device_memory`` has the breakdown; ``remat.explain``
            prints it.
        optimizer: ``adamw``, ``adam``, ``sgd`` (with momentum) or ``none``; or a
            ``torch.optim.Optimizer`` class or a factory making one from a list of
            parameters (Adafactor, a low-memory or 8-bit one): its state after one step on
            FakeTensor copies of the parameters is what the budget counts.
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
            on), ``cpu``, ``a100``, ``h100``, ``h200``, ``ascend910b3``, ``ascend910b4``, or a
            :class:`remat.DeviceProfile`.
        time_limit_s: work each optimizing solver may do, counted in reference seconds (not
            read from the clock: the same request gives the same plan under any load).
        floor_time_s: seconds more for a tighter proven floor under a chain plan (the blocks'
            exact fronts, :mod:`remat.solver.block_bound`): ``plan.lower_bound_s``.
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
    if target is not None and loss_fn is None:
        raise ValueError("target= is the loss's target: pass loss_fn= with it")
    req = request_of(request, flat)
    if req.training.precision == FSDP_MIXED:
        raise ValueError(
            f"precision={FSDP_MIXED!r} (FSDP2's own mixed precision) is planned by remat.apply, "
            "not remat.optimize"
        )
    if req.training.precision not in AUTOCAST:
        raise ValueError(
            f"unknown precision {req.training.precision!r}; valid: {', '.join(AUTOCAST)}"
        )
    args, kwargs = as_args(example_inputs), dict(example_kwargs or {})
    loss = Loss.of(loss_fn, target)
    planner = _GraphPlanner(model, req, loss, (args, kwargs))
    if req.max_seq is not None or req.seq_buckets:
        planner.lengths = _length_plans(model, args, kwargs, planner, req)
    first_compiled = planner(model, args, kwargs)
    return RematModule(model, first_compiled, signature(args, kwargs), planner, planner.lengths)


class _GraphPlanner:
    """The whole-graph executor's end of the pipeline: capture and solve (or re-use a length
    plan) for one set of inputs, and build the executor. ``RematModule`` calls it again for
    inputs of another signature."""

    def __init__(
        self,
        model: nn.Module,
        request: Request,
        loss: Loss | None = None,
        example: tuple[tuple[Any, ...], Mapping[str, Any]] = ((), {}),
    ) -> None:
        self.request = request
        self.loss = loss
        self.example = example
        self.device = request.device(model)
        self.step_budget = request.step_budget(self.device)
        self.profile = resolve_profile(model, request.device_profile)
        self.config = request.solver_config()
        self.lengths: LengthPlans | None = None

    def analysis(self, src: nn.Module, a: tuple[Any, ...], kw: Mapping[str, Any]) -> Analysis:
        options = self.request.training
        return analyze(
            src,
            a,
            kw,
            device_profile=self.profile,
            precision=options.precision,
            grads_held=not options.grads_released,
            loss=self.loss_at(a, kw),
        )

    def loss_at(self, a: tuple[Any, ...], kw: Mapping[str, Any]) -> Loss | None:
        return loss_at(self.loss, self.example, a, kw)

    def solved(self, problem: Problem) -> Plan:
        req = self.request
        with device_errors(self.device):
            return choose_plan(
                problem,
                plan=req.plan,
                solver=req.solver,
                activation_budget_bytes=self.step_budget,
                config=self.config,
                host_budget_bytes=req.host_budget_bytes,
                copy_ops=module_ops(problem),
            )

    def compiled(self, analysis: Analysis, chosen: Plan, solve_s: float) -> Compiled:
        step = STEP_WITHOUT_LOSS if self.loss is None else STEP_WITH_LOSS
        chosen = dataclasses.replace(chosen, step=step)
        if self.device is not None:
            chosen = dataclasses.replace(chosen, device_memory=self.device.breakdown(chosen))
        t_rewrite = time.perf_counter()
        module = analysis.module_problem
        schedule = None if module is None else module_schedule(chosen.schedule, module)
        executor = build_executor(analysis.joint, analysis.executed, chosen, schedule)
        timings = {
            **analysis.timings,
            "solve": solve_s,
            "rewrite": time.perf_counter() - t_rewrite,
        }
        return Compiled(analysis.captured, executor, analysis.problem, timings)

    def __call__(self, src: nn.Module, a: tuple[Any, ...], kw: Mapping[str, Any]) -> Compiled:
        t0 = time.perf_counter()
        analysis = self.analysis(src, a, kw)
        t_solve = time.perf_counter()
        lengths = self.lengths
        s = lengths.length_of(a, kw) if lengths is not None else None
        if lengths is not None and s is not None and src.training == lengths.training:
            fitted = lengths.plan_at(analysis.problem, s)
            if fitted is not None:
                done = self.compiled(analysis, fitted, time.perf_counter() - t_solve)
                bucket = lengths.bucket_of(s)
                lengths.record(PlanningEvent(s, bucket.hi, time.perf_counter() - t0))
                return done
            warnings.warn(
                f"remat: the graph at length {s} differs from the one fitted for max_seq (the "
                "model branches on these inputs); solving a plan for it alone",
                stacklevel=4,
            )
        chosen = self.solved(analysis.problem)
        return self.compiled(analysis, chosen, time.perf_counter() - t_solve)


def _length_plans(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    planner: _GraphPlanner,
    req: Request,
) -> LengthPlans:
    """The fit over lengths at the example's batch (:func:`remat.fit.graph_shapes.capture_dynamic`)
    and a plan per bucket, each solved at its longest length."""
    tops = bucket_tops(req.max_seq, req.seq_buckets)
    progress = req.progress
    dims = sequence_dims(args, kwargs, tops[-1])
    t0 = time.perf_counter()
    try:
        dynamic = capture_dynamic(
            lambda a, kw: planner.analysis(model, a, kw),
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
        model_static_memory(model, req.training),
        planner.solved,
        planner.step_budget,
        (args, kwargs),
        model.training,
        time.perf_counter() - t0,
    )
    for bucket in plans.buckets:  # now, so a budget too small fails here, not mid-training
        if progress:
            progress(f"solving for lengths {bucket.lo}..{bucket.hi} at length {bucket.hi}")
        plans.solved(bucket)
    return plans
