"""What a user asks remat to plan for, as one record both front doors share.

:func:`remat.optimize` (remat's whole-graph executor) and :func:`remat.apply` (PyTorch's
selective checkpointing on the user's blocks) take the same request: a budget (the whole
device, or the step alone), how the model trains (what the static memory depends on), how the
plan is chosen (a fixed plan, a plan file, or a solver with its time limit), the device the
recompute time is estimated for, and the lengths training will use. :class:`Request` holds it,
validated once in ``__post_init__``; the flat keyword arguments of the front doors are sugar
for it (:meth:`Request.of`). What follows from a request and a model -- the device budget, the
step's bound, the profile, a :class:`~remat.budget.DeviceBudgetError` instead of a bare
:class:`~remat.solver.config.BudgetError` -- is computed here too, so no front door repeats it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypedDict

import torch
from torch import nn
from typing_extensions import Unpack

from remat import _torch_compat as tc
from remat.budget import (
    DEFAULT_RESERVE,
    GB,
    DeviceBudget,
    DeviceBudgetError,
    Optimizer,
    Options,
    Precision,
    StaticMemory,
    device_budget,
    static_memory,
)
from remat.measure.optimizer_state import optimizer_state_bytes
from remat.measure.profiles import DeviceProfile, auto_profile_name
from remat.solver.config import BudgetError, SolverConfig, SolverName
from remat.solver.plan import Plan

__all__ = [
    "Request",
    "RequestArgs",
    "as_args",
    "device_errors",
    "model_static_memory",
    "resolve_profile",
]

PlanSpec = str | Path | Plan | None
"""A fixed plan's name, a plan file (``*.json``), a :class:`Plan`, or None (solve)."""


@dataclass(frozen=True, kw_only=True)
class Request:
    """One planning request; every field is optional, the defaults plan for AdamW in fp32.

    Without a budget (neither ``budget_bytes`` nor ``activation_budget_bytes``) everything is
    kept."""

    budget_bytes: int | None = None
    """The whole device's memory: static memory (parameters, optimizer state, gradient shards
    under ZeRO 2-3, see :mod:`remat.budget`) and the reserve are subtracted, the step is
    planned in the rest."""
    activation_budget_bytes: int | None = None
    """Instead of a device budget, a bound on the step's peak alone."""
    training: Options = field(default_factory=Options)
    """Optimizer, precision, ZeRO stage and world size."""
    reserve_fraction: float = DEFAULT_RESERVE
    """Share of a device budget kept for the allocator, workspaces and communication."""
    plan: PlanSpec = None
    """A fixed plan, a plan file or a :class:`Plan`; exclusive with ``solver`` and
    ``activation_budget_bytes``."""
    solver: SolverName | str | None = None
    """A solver's name (``auto`` when None): see :mod:`remat.solver.registry`."""
    device_profile: str | DeviceProfile = "auto"
    """Cost model of recompute time; ``auto``: the device the parameters are on."""
    time_limit_s: float = 60.0
    """Work each optimizing solver may do, counted in reference seconds (about seconds on
    one idle core, :mod:`remat.solver.clock`): the same request plans the same on a busy
    machine, which takes longer. A wall-clock safety net of five times this plus 30 s stops
    a solve that runs far over; the plan's reason then says so."""
    floor_time_s: float = 0.0
    """Seconds more for a tighter floor under a chain plan (:attr:`SolverConfig.floor_time_s`)."""
    block_types: tuple[str, ...] = ()
    """Class names or path patterns of the repeated blocks."""
    max_seq: int | None = None
    """The longest sequence training will use, for inputs whose length varies."""
    seq_buckets: tuple[int, ...] = ()
    """With ``max_seq`` (whole-graph executor): the longest length of each bucket."""
    host_budget_bytes: int = 0
    """Host memory the plan may fill with offloaded saved values, per rank (ranks of a node
    share the node's memory: give each its share). 0: nothing is offloaded, and every plan
    is the recompute plan it was without it (:mod:`remat.solver.offload_search`)."""
    progress: Callable[[str], None] | None = field(default=None, compare=False)
    """Called with a short status line as long solves advance."""
    workers: int | None = None
    """Processes tracing at once (:mod:`remat.fit.workers`) a native fit's steps, or the
    chain DP's uniform plans on a deep stack's shallow copies: None, one per core (up to 8)
    where the traces add up to 10 s or more (3 s for the copies, which trace while the MILP
    solves); 1, this process alone. The plan is the same."""

    def __post_init__(self) -> None:
        if self.budget_bytes is not None and self.activation_budget_bytes is not None:
            raise ValueError(
                "pass a device budget (budget_gb/budget_bytes) or activation_budget_bytes"
            )
        for name in ("budget_bytes", "activation_budget_bytes"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")
            object.__setattr__(self, name, int(value))
        host = self.host_budget_bytes
        if isinstance(host, bool) or not isinstance(host, (int, float)) or not host >= 0:
            raise ValueError(f"host_budget_bytes must be 0 or more bytes, got {host!r}")
        object.__setattr__(self, "host_budget_bytes", int(host))
        if self.plan is not None and (
            self.solver is not None or self.activation_budget_bytes is not None
        ):
            raise ValueError("pass either plan= or solver=/activation_budget_bytes=, not both")
        if not 0.0 <= self.reserve_fraction < 1.0:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {self.reserve_fraction!r}")
        if not self.time_limit_s > 0:
            raise ValueError(f"time_limit_s must be positive, got {self.time_limit_s!r}")
        if not self.floor_time_s >= 0:
            raise ValueError(f"floor_time_s must be 0 or more, got {self.floor_time_s!r}")
        if self.workers is not None and (not isinstance(self.workers, int) or self.workers < 1):
            raise ValueError(f"workers must be a positive integer, got {self.workers!r}")
        if self.max_seq is not None and (not isinstance(self.max_seq, int) or self.max_seq < 1):
            raise ValueError(f"max_seq must be a positive integer, got {self.max_seq!r}")
        object.__setattr__(self, "block_types", tuple(self.block_types))
        object.__setattr__(self, "seq_buckets", tuple(self.seq_buckets))

    @classmethod
    def of(cls, **flat: Unpack[RequestArgs]) -> Request:
        """The request the front doors' flat keyword arguments spell (``budget_gb`` in units
        of 1e9 bytes; ``optimizer``, ``precision``, ``zero_stage``, ``world_size`` for
        :class:`~remat.budget.Options`)."""
        args: dict[str, Any] = dict(flat)
        unknown = sorted(set(args) - set(RequestArgs.__annotations__))
        if unknown:
            raise TypeError(
                f"unknown argument(s) {', '.join(unknown)}; valid: "
                + ", ".join(sorted(RequestArgs.__annotations__))
            )
        gb = args.pop("budget_gb", None)
        if gb is not None:
            if args.get("budget_bytes") is not None:
                raise ValueError("pass budget_gb or budget_bytes, not both")
            if not gb > 0:
                raise ValueError(f"the device budget must be positive, got {gb!r} GB")
            args["budget_bytes"] = int(gb * GB)
        host_gb = args.pop("host_budget_gb", None)
        if host_gb is not None:
            if args.get("host_budget_bytes"):
                raise ValueError("pass host_budget_gb or host_budget_bytes, not both")
            if not host_gb >= 0:
                raise ValueError(f"the host budget must be 0 or more, got {host_gb!r} GB")
            args["host_budget_bytes"] = int(host_gb * GB)
        training = {k: args.pop(k) for k in _TRAINING if k in args}
        args["training"] = Options(**training)
        return cls(**args)

    def solver_config(self) -> SolverConfig:
        return SolverConfig(
            time_limit_s=self.time_limit_s,
            block_types=self.block_types,
            progress=self.progress,
            floor_time_s=self.floor_time_s,
        )

    def device(self, model: nn.Module) -> DeviceBudget | None:
        """The device budget for ``model`` (None without ``budget_bytes``); raises
        :class:`remat.StaticMemoryError` when the static memory does not fit."""
        if self.budget_bytes is None:
            return None
        static = model_static_memory(model, self.training)
        return device_budget(self.budget_bytes, static, self.training, self.reserve_fraction)

    def step_budget(self, device: DeviceBudget | None) -> int | None:
        """The bound on the step's peak: what the device leaves, or the activation budget."""
        return device.step_budget_bytes if device is not None else self.activation_budget_bytes

    def is_plan_file(self) -> bool:
        plan = self.plan
        return isinstance(plan, Path) or (isinstance(plan, str) and plan.endswith(".json"))


class RequestArgs(TypedDict, total=False):
    """The flat keyword arguments of :func:`remat.optimize`, :func:`remat.apply` and
    :func:`remat.fit.fit` (see :class:`Request` for each)."""

    budget_gb: float | None
    budget_bytes: int | None
    activation_budget_bytes: int | None
    optimizer: Optimizer
    precision: Precision
    zero_stage: int
    world_size: int
    reserve_fraction: float
    plan: PlanSpec
    solver: SolverName | None
    device_profile: str | DeviceProfile
    time_limit_s: float
    floor_time_s: float
    block_types: tuple[str, ...]
    max_seq: int | None
    seq_buckets: tuple[int, ...]
    progress: Callable[[str], None] | None
    workers: int | None
    host_budget_gb: float | None
    host_budget_bytes: int


_TRAINING = tuple(f.name for f in fields(Options))


def request_of(request: Request | None, flat: Mapping[str, Any]) -> Request:
    """``request``, or the one ``flat`` spells; not both."""
    if request is not None:
        if flat:
            raise TypeError(
                f"pass request= or flat keyword arguments, not both (got {', '.join(sorted(flat))})"
            )
        return request
    return Request.of(**flat)


def as_args(example_inputs: Any) -> tuple[Any, ...]:
    """The example inputs as a tuple of positional arguments."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise ValueError(
        f"example_inputs must be a tensor or a tuple of tensors, got {type(example_inputs).__name__}"
    )


@contextlib.contextmanager
def device_errors(device: DeviceBudget | None) -> Iterator[None]:
    """Re-raise a :class:`BudgetError` as a :class:`DeviceBudgetError` stating the least
    device total, when the budget was the whole device's."""
    try:
        yield
    except DeviceBudgetError:
        raise
    except BudgetError as e:
        if device is None:
            raise
        raise DeviceBudgetError(device, e) from None


_CPU = torch.device("cpu")


def resolve_profile(model: nn.Module, device_profile: str | DeviceProfile) -> str | DeviceProfile:
    """``auto``: the profile of the device the model's parameters are on."""
    if isinstance(device_profile, str) and device_profile == "auto":
        first = next(iter(model.parameters()), None)
        return auto_profile_name(first.device if first is not None else _CPU)
    return device_profile


def model_static_memory(model: nn.Module, options: Options) -> StaticMemory:
    """:func:`remat.budget.static_memory` of ``model``'s parameters as it holds them."""
    # A tensor-parallel model's sharded weights count as this rank's shard of them.
    trainable = [tc.local_tensor(p) for p in model.parameters() if p.requires_grad]
    frozen = [tc.local_tensor(p) for p in model.parameters() if not p.requires_grad]
    measured = None
    if not isinstance(options.optimizer, str):  # the user's class or factory
        measured = optimizer_state_bytes(trainable, options.optimizer)
    return static_memory(
        trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
        frozen_bytes=sum(p.numel() * p.element_size() for p in frozen),
        trainable=sum(p.numel() for p in trainable),
        frozen=sum(p.numel() for p in frozen),
        options=options,
        optimizer_state_bytes=measured,
    )
