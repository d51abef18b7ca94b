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
from typing import Any

import torch
from torch import nn

from remat.budget import OptimizerName, Precision
from remat.executors import Executor, executor_named
from remat.fit.graph_formula import RangeFormula, analyze_dynamic, formula_of
from remat.fit.peak import MemoryFormula
from remat.fit.questions import FormulaQuestion
from remat.fit.sac_formula import Copies
from remat.measure.meter import Loss
from remat.measure.profiles import DeviceProfile
from remat.request import Request, as_args, model_static_memory
from remat.solver.plan import Plan

__all__ = ["MemoryFormula", "RangeFormula", "analyze_dynamic", "formula_of", "memory_formula"]


def memory_formula(
    model: nn.Module,
    example_inputs: Any,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    plan: str | Plan = "keep_all",
    executor: str | Executor = "graph",
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
    request = Request.of(
        precision=precision, optimizer=optimizer, zero_stage=zero_stage, world_size=world_size,
        device_profile=device_profile, block_types=block_types, max_seq=max_seq,
        progress=progress,
    )  # fmt: skip
    return executor_named(executor).memory_formula(
        FormulaQuestion(
            model=model, args=as_args(example_inputs), kwargs=dict(example_kwargs or {}),
            request=request, plan=plan, static=model_static_memory(model, request.training),
            seq=seq, loss=Loss.of(loss_fn, target), copies=copies,
        )
    )  # fmt: skip
