"""The whole device's memory: what training holds besides the step's activations.

remat plans the *step* (forward and backward: activations, output and parameter gradients) to
its exact peak; a device budget also has to hold what lives across steps. Convention (PyTorch
AMP, as ``torch.autocast`` and Lightning's ``bf16-mixed`` train):

==============  =========================================  ==============================
precision       parameters (and the master copy)           gradients
==============  =========================================  ==============================
``fp32``        4 B/param, fp32                            4 B/param, fp32
``bf16-mixed``  4 B/param: fp32 parameters are the master  4 B/param, fp32 (autocast
``fp16-mixed``  weights; autocast casts them per op        computes in 16 bits, the
                                                           gradients of fp32 parameters
                                                           are fp32)
``bf16-fsdp``   4 B/param / N: FSDP2's fp32 sharded master  4 B/param / N, fp32 shards
                parameters (ZeRO-3 only); the bf16 copies  (reduce-scattered in fp32);
                gathered per block are inside the step     the bf16 gradients before
                                                           reduce-scatter are inside
                                                           the step
==============  =========================================  ==============================

``bf16-fsdp`` is FSDP2's own mixed precision, ``fully_shard(block, mesh=mesh,
mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))`` per
block then the root (torchtitan's default): no autocast, the blocks compute in bf16 on the
parameters FSDP2 gathers; so it needs ``zero_stage=3`` and ``world_size > 1``.

Optimizer state is fp32: Adam/AdamW two moments (8 B/param), SGD with momentum one (4 B/param),
``none`` nothing. So Adam costs 16 B per trainable parameter in every precision (the ZeRO
paper's 2 + 2 + 12 split of bf16 weights, bf16 gradients and fp32 master + moments comes to the
same 16). Frozen parameters cost their bytes and nothing else. Any other optimizer (a
``torch.optim.Optimizer`` class or factory: Adafactor, low-memory or 8-bit ones) keeps the
state one step makes for the model's parameters, measured on FakeTensors
(:mod:`remat.measure.optimizer_state`).

ZeRO sharding over ``world_size`` devices divides: stage 1 the optimizer state, stage 2 also the
gradients, stage 3 also the parameters. Gradients are counted inside the step's peak (the
simulator holds each one from its creation to the end of the step); with ZeRO >= 2 each is
reduce-scattered as it is produced, so the step is planned with gradients released at creation
and their shard is held across the step as static memory.

A reserve (``reserve_fraction`` of the budget, default 5%) is kept for what a tensor-level plan
cannot see: allocator fragmentation and rounding, kernel workspaces (cuBLAS, attention), CUDA
context, communication buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

from remat.solver.config import BudgetError

OptimizerName = Literal["adamw", "adam", "sgd", "none"]
"""The optimizers whose state the static memory counts."""
Precision = Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16-fsdp"]
"""How the step computes: fp32; under ``torch.autocast`` (``*-mixed``); or FSDP2's own mixed
precision (``bf16-fsdp``)."""
OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}
"""fp32 state tensors per trainable parameter."""
Optimizer = OptimizerName | str | Callable[[list[Any]], Any]
"""A named optimizer, or a ``torch.optim.Optimizer`` class or factory of the user's whose
state is measured (:mod:`remat.measure.optimizer_state`; this module imports no torch)."""
FSDP_MIXED = "bf16-fsdp"
"""FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): ZeRO-3 only."""
PRECISIONS: tuple[str, ...] = get_args(Precision)
ZERO_STAGES = (0, 1, 2, 3)
DEFAULT_RESERVE = 0.05
GB = 1e9


@dataclass(frozen=True)
class StaticMemory:
    """Bytes per device that live across training steps, after ZeRO sharding."""

    parameters: int
    gradient_shards: int
    """Held across the step only under ZeRO >= 2 (the reduce-scattered shard); otherwise the
    gradients are inside the step's peak."""
    optimizer_state: int
    trainable: int
    """Trainable parameter count (all devices)."""
    frozen: int
    unsharded: int
    """Parameters + gradients + optimizer state on one device without sharding."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradient_shards + self.optimizer_state


@dataclass(frozen=True)
class Options:
    """How the model trains: what the static memory depends on."""

    optimizer: Optimizer = "adamw"
    precision: Precision | str = "fp32"
    zero_stage: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.optimizer, str):
            if self.optimizer not in OPTIMIZER_STATES:
                raise ValueError(
                    f"unknown optimizer {self.optimizer!r}; valid: {', '.join(OPTIMIZER_STATES)}"
                    ", or a torch.optim.Optimizer class or factory"
                )
        elif not callable(self.optimizer):
            raise TypeError(
                "optimizer must be a name, or a torch.optim.Optimizer class or a factory of one "
                f"from the parameters; got {self.optimizer!r}"
            )
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"unknown precision {self.precision!r}; valid: {', '.join(PRECISIONS)}"
            )
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {self.zero_stage!r}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {self.world_size!r}")
        if self.precision == FSDP_MIXED and (self.zero_stage != 3 or self.world_size < 2):
            raise ValueError(
                f"precision={FSDP_MIXED!r} is FSDP2's MixedPrecisionPolicy: it needs "
                f"zero_stage=3 and world_size > 1 (got zero_stage={self.zero_stage}, "
                f"world_size={self.world_size}); for one device use 'bf16-mixed' (autocast)"
            )

    @property
    def grads_released(self) -> bool:
        """Gradients leave the device (reduce-scatter) as they are produced."""
        return self.zero_stage >= 2 and self.world_size > 1


def static_memory(
    trainable_bytes: int,
    frozen_bytes: int,
    trainable: int,
    frozen: int,
    options: Options,
    optimizer_state_bytes: int | None = None,
) -> StaticMemory:
    """Static bytes per device for parameters of the given sizes (as the model holds them).
    ``optimizer_state_bytes``: the state of an optimizer given as a class or factory,
    measured for these parameters before sharding (required for one, ignored for a name)."""
    n = options.world_size
    if isinstance(options.optimizer, str):
        state = 4 * OPTIMIZER_STATES[options.optimizer] * trainable
    elif optimizer_state_bytes is None:
        raise ValueError(
            "an optimizer given as a class or factory has its state measured on the model's "
            "parameters: remat.request.model_static_memory"
        )
    else:
        state = optimizer_state_bytes
    full_state = state
    params = trainable_bytes + frozen_bytes
    grad_shards = 0
    if options.zero_stage >= 1:
        state = math.ceil(state / n)
    if options.grads_released:
        grad_shards = math.ceil(trainable_bytes / n)  # gradients have their parameters' dtype
    if options.zero_stage >= 3:
        params = math.ceil(params / n)
    return StaticMemory(
        parameters=params,
        gradient_shards=grad_shards,
        optimizer_state=state,
        trainable=trainable,
        frozen=frozen,
        unsharded=trainable_bytes + frozen_bytes + trainable_bytes + full_state,
    )


@dataclass(frozen=True)
class DeviceBudget:
    """A device budget split into static memory, reserve, and what the step may use."""

    budget_bytes: int
    static: StaticMemory
    reserve_bytes: int
    options: Options

    @property
    def step_budget_bytes(self) -> int:
        """Bound on the step's simulated peak (activations and in-step gradients)."""
        return self.budget_bytes - self.static.total - self.reserve_bytes

    def total_for(self, step_peak: int) -> int:
        """Device bytes at a step peak of ``step_peak``: static + reserve + step."""
        return self.static.total + self.reserve_bytes + step_peak

    def breakdown(self, plan: _HasPeak) -> dict[str, int]:
        """Bytes per device by kind for a plan, as :attr:`Plan.device_memory` records them."""
        return {
            "parameters": self.static.parameters,
            "gradient_shards": self.static.gradient_shards,
            "optimizer_state": self.static.optimizer_state,
            "reserve": self.reserve_bytes,
            "step_peak": plan.predicted_peak_bytes,
            "total": self.total_for(plan.predicted_peak_bytes),
            "budget": self.budget_bytes,
        }


class _HasPeak(Protocol):
    @property
    def predicted_peak_bytes(self) -> int: ...


class DeviceBudgetError(BudgetError):
    """The static memory fits but no plan's step peak fits in what is left."""

    def __init__(self, device: DeviceBudget, error: BudgetError) -> None:
        least = error.least_peak_bytes
        self.device = device
        self.least_total_bytes = device.total_for(least)
        what = (
            "the least feasible step peak" if error.achievable else "a lower bound on the step peak"
        )
        super().__init__(
            device.step_budget_bytes,
            least,
            f"device budget {format_bytes(device.budget_bytes)} leaves {format_bytes(device.step_budget_bytes)} for "
            f"the step after static memory {format_bytes(device.static.total)} and reserve "
            f"{format_bytes(device.reserve_bytes)}; {what} is {format_bytes(least)}, so the device needs at least "
            f"{format_bytes(self.least_total_bytes)} ({self.least_total_bytes:,} B) — or less static "
            "memory (ZeRO stage, world size, optimizer)",
            achievable=error.achievable,
        )


def device_budget(
    budget_bytes: int,
    static: StaticMemory,
    options: Options,
    reserve_fraction: float = DEFAULT_RESERVE,
) -> DeviceBudget:
    if not 0.0 <= reserve_fraction < 1.0:
        raise ValueError(f"reserve_fraction must be in [0, 1), got {reserve_fraction!r}")
    if budget_bytes <= 0:
        raise ValueError(f"the device budget must be positive, got {budget_bytes!r} bytes")
    plan = DeviceBudget(budget_bytes, static, int(budget_bytes * reserve_fraction), options)
    if plan.step_budget_bytes <= 0:
        raise StaticMemoryError(plan)
    return plan


class StaticMemoryError(ValueError):
    """The budget does not even hold the parameters and optimizer state."""

    def __init__(self, plan: DeviceBudget) -> None:
        self.plan = plan
        s, o = plan.static, plan.options
        lines = [
            f"device budget {format_bytes(plan.budget_bytes)} does not hold the static memory "
            f"({format_bytes(s.total)}) and the reserve ({format_bytes(plan.reserve_bytes)}): "
            f"parameters {format_bytes(s.parameters)}, optimizer state "
            f"({optimizer_name(o.optimizer)}) {format_bytes(s.optimizer_state)}"
            + (f", gradient shards {format_bytes(s.gradient_shards)}" if s.gradient_shards else "")
            + f"; {s.trainable / 1e9:.2f}B trainable parameters, precision {o.precision}, "
            f"ZeRO stage {o.zero_stage} over {o.world_size} device(s)."
        ]
        hints = _what_would_fit(plan)
        if hints:
            lines.append("What would make it fit: " + "; ".join(hints) + ".")
        super().__init__(" ".join(lines))


def _what_would_fit(plan: DeviceBudget) -> list[str]:
    o = plan.options
    hints = []
    if o.zero_stage < 3:
        hints.append(
            f"ZeRO stage 3 shards parameters, gradients and optimizer state over world_size "
            f"(now {o.world_size})"
        )
    room = plan.budget_bytes - plan.reserve_bytes
    devices = math.floor(plan.static.unsharded / room) + 1
    if devices > o.world_size:
        hints.append(
            f"more than {devices - 1} devices under ZeRO-3 (parameters, gradients and "
            f"optimizer state, {format_bytes(plan.static.unsharded)} in all, fill {devices - 1} such "
            "budgets before any activation)"
        )
    if isinstance(o.optimizer, str) and o.optimizer in ("adam", "adamw"):
        hints.append("an optimizer with less state (sgd: 4 B/param, none: 0)")
    hints.append(f"a budget above {format_bytes(plan.static.total + plan.reserve_bytes)}")
    return hints


def optimizer_name(optimizer: Optimizer) -> str:
    """How reports name an optimizer: its name, or its class or factory's qualified name."""
    if isinstance(optimizer, str):
        return optimizer
    return getattr(optimizer, "__qualname__", None) or type(optimizer).__qualname__


AUTOCAST_PRECISIONS = ("bf16-mixed", "fp16-mixed")
"""The precisions a step trains in under ``torch.autocast``."""


def autocast_cache_hint(options: Options) -> str | None:
    """Why a ``sac`` plan under autocast and FSDP2 needs more than FSDP2's own mixed
    precision, and what needs less, or None where that does not apply. FSDP2 gathers each
    block's fp32 weights and autocast casts them at every use; remat turns autocast's cast
    cache off inside its checkpointed regions (:mod:`remat.executors.sac.regions`), but outside
    them (blocks left without checkpoint, the embeddings, the head) the cache keeps every
    16-bit copy of a gathered weight until the forward ends (about 2 B per parameter: 13.5
    GB for Llama 2 7B with the cache on everywhere). FSDP2's own mixed precision gathers
    16-bit weights per block and frees them after it."""
    if not (
        options.precision in AUTOCAST_PRECISIONS
        and options.zero_stage == 3
        and options.world_size > 1
    ):
        return None
    return (
        f"Under {options.precision} with FSDP2 (ZeRO-3), FSDP2 gathers each block's fp32 "
        "weights and torch.autocast casts them at every use; remat turns autocast's cast "
        "cache off inside its checkpointed regions, but outside them the cache keeps every "
        "16-bit copy until the forward ends. What needs less: FSDP2's MixedPrecisionPolicy "
        f"instead of autocast, precision={FSDP_MIXED!r} (remat plan --precision "
        f"{FSDP_MIXED}), which gathers 16-bit weights per block and frees them after it; or "
        "torch.autocast(..., cache_enabled=False) in the training loop, the same values "
        "(remat traces autocast's default, so its peak then overstates that loop's)"
    )


def format_bytes(n: float) -> str:
    """Decimal units, as device memory is quoted (an 80 GB H100 holds 80e9 bytes)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{int(n)} B"
