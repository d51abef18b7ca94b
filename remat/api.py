"""``remat.optimize``: the one call most users need."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from remat.graph.profiles import DeviceProfile
from remat.pipeline import analyze, choose_plan
from remat.rewrite.executor import build_executor
from remat.rewrite.module import Compiled, RematModule, signature
from remat.solver.config import SolverConfig
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
    plan: str | Plan | None = None,
    solver: str | None = None,
    activation_budget_bytes: int | None = None,
    device_profile: str | DeviceProfile = "cpu",
    time_limit_s: float = 60.0,
    block_types: tuple[str, ...] = (),
) -> RematModule:
    """Plan which activations ``model`` keeps for its backward and return a module that trains
    exactly like it (same outputs and gradients) with the plan's memory peak.

    Args:
        model: the model; it is not modified. The returned module shares its parameters and
            buffers (the same tensor objects, the same ``state_dict`` keys).
        example_inputs: a tensor or tuple of tensors, with the shapes training will use.
        example_kwargs: keyword arguments of the forward (tensors or constants such as
            ``use_cache=False``; ``use_cache`` defaults to False when the forward accepts it).
        plan: ``"keep_all"``, ``"keep_inputs"``, ``"keep_matmuls"``, or a :class:`Plan`.
        solver: a name from ``remat.solver.registry.SOLVERS`` or ``"auto"`` (the default): the
            plan with the least recompute time, among all solvers, that fits the budget.
        activation_budget_bytes: bound on ``plan.predicted_peak_bytes``, the peak memory
            allocated during one training step (activations, output gradients, parameter
            gradients; not parameters or optimizer state). Without it: keep everything.
            Too small a budget raises :class:`remat.BudgetError` stating the least peak found.
        device_profile: cost model for recompute time (``cpu``, ``a100``, ``h100``, ``h200``).
        time_limit_s: wall-clock limit of optimizing solvers.
        block_types: module class names or path patterns the ``block`` baseline checkpoints.

    The model may be built under ``remat.fake_mode()`` to plan shapes larger than this
    machine: the returned module then carries a plan but cannot run.
    """
    args = _as_args(example_inputs)
    kwargs = dict(example_kwargs or {})
    config = SolverConfig(time_limit_s=time_limit_s, block_types=tuple(block_types))

    def planner(src: nn.Module, a: tuple[Any, ...], kw: Mapping[str, Any]) -> Compiled:
        analysis = analyze(src, a, kw, device_profile=device_profile)
        chosen = choose_plan(
            analysis.problem,
            plan=plan,
            solver=solver,
            activation_budget_bytes=activation_budget_bytes,
            config=config,
        )
        return Compiled(analysis.captured, build_executor(analysis.joint, analysis.problem, chosen))

    first = planner(model, args, kwargs)
    return RematModule(model, first, signature(args, kwargs), planner)
