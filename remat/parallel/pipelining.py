"""One stage of a ``torch.distributed.pipelining`` pipeline, as ``remat.apply`` plans it.

A stage does not hold one microbatch's activations but those of every microbatch in flight:
under 1F1B with P stages, stage i runs up to P - i forwards before its first backward; under
GPipe every stage runs all its forwards first. So a stage's peak is not one step's but that of
a whole ``schedule.step()``, and it differs from stage to stage under one plan.

remat traces it as it runs: the stage's FakeTensor copy is wrapped in a ``PipelineStage``
and stepped by PyTorch's own schedule class on a fake process group, as the stage's rank
(:meth:`remat.executors.sac.trace.FakeModel.trace`), under the recorder that measures every step.
The schedule's action order, its receive buffers, the outputs and works it keeps are then
those of the real run, by construction: no model of the schedule to get wrong. What the fake
group does not do, holding the tensors of a p2p work until the work is dropped, is put back
(:func:`remat._torch_compat.p2p_works_hold_tensors`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["SCHEDULES", "Action", "Pipeline", "PipelineError", "ScheduleTrace"]

SINGLE_STAGE = ("GPipe", "1F1B")
"""Schedules with one stage per rank."""

MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS")
"""Schedules with several stages per rank, in loop order (rank r holds stages r, r + P, ...
of P ranks): ``remat.apply`` then plans the rank's stages together, as one module list."""

SCHEDULES = (*SINGLE_STAGE, *MULTI_STAGE)
"""Schedules ``remat.apply`` plans for, each microbatch's backward whole: PyTorch's selective
checkpointing is bitwise under them (`docs/design.md`)."""

SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""Schedules that split each backward into an input and a weight part: a region under
selective checkpointing may only be backwarded once ("Trying to backward an extra time"),
so no SAC plan runs under them."""


class PipelineError(ValueError):
    """A pipeline ``remat.apply`` cannot plan a stage of (the message says which can)."""


@dataclass(frozen=True)
class Pipeline:
    """Where a stage module runs: its index among ``n_stages``, the ``schedule``'s name and
    the number of ``microbatches`` a ``step()`` splits the batch into. ``loss_fn``: the
    schedule's loss function, which the last stage's step runs on its outputs and the
    ``target`` given to ``remat.apply`` (``loss_fn(output, target)``).

    Multi-stage schedules (``Interleaved1F1B``, ``LoopedBFS``): ``stages_per_rank`` stages
    on each of ``n_stages // stages_per_rank`` ranks, ``stage`` the rank's first (its rank
    index: the rank holds ``stage, stage + ranks, ...``, :attr:`indices`)."""

    schedule: str
    stage: int
    n_stages: int
    microbatches: int
    loss_fn: Callable[[Any, Any], Any] | None = None
    stages_per_rank: int = 1

    def __post_init__(self) -> None:
        names = {s.lower(): s for s in (*SCHEDULES, *SPLIT_BACKWARD)}
        name = names.get(self.schedule.lower())
        can = ", ".join(SCHEDULES)
        if name in SPLIT_BACKWARD:
            raise PipelineError(
                f"schedule {name} splits each backward in two (input, then weight "
                "gradients), and a region under selective checkpointing can only be "
                f"backwarded once: it cannot run a remat plan. Schedules that can: {can}"
            )
        if name is None:
            raise PipelineError(f"unknown pipeline schedule {self.schedule!r}; remat plans {can}")
        object.__setattr__(self, "schedule", name)
        self._check_stages(name)
        if self.microbatches < 1:
            raise PipelineError(f"microbatches must be at least 1, not {self.microbatches}")
        if self.last and self.loss_fn is None:
            raise PipelineError(
                f"stage {self.n_stages - 1} is the last: give the schedule's loss_fn "
                "(Pipeline(..., loss_fn=...)) and the target of one microbatch "
                "(remat.apply(..., target=...))"
            )

    def _check_stages(self, name: str) -> None:
        multi = name in MULTI_STAGE
        if multi and self.stages_per_rank < 2:
            raise PipelineError(
                f"schedule {name} runs several stages per rank: give stages_per_rank "
                "(2 or more) and apply remat to the rank's stage modules as one "
                "nn.ModuleList, in the order of their stage indices"
            )
        if not multi and self.stages_per_rank != 1:
            raise PipelineError(
                f"schedule {name} runs one stage per rank, not {self.stages_per_rank}; "
                f"schedules with several: {', '.join(MULTI_STAGE)}"
            )
        if self.n_stages < 2:
            raise PipelineError(f"a pipeline has at least 2 stages, not {self.n_stages}")
        if self.n_stages % self.stages_per_rank or self.ranks < 2:
            raise PipelineError(
                f"{self.n_stages} stages do not split into {self.stages_per_rank} stages on "
                "each of 2 or more ranks"
            )
        if not 0 <= self.stage < self.ranks:
            what = "one" if self.stages_per_rank == 1 else "a rank's first (0 to ranks - 1)"
            raise PipelineError(f"stage {self.stage} is not {what} of the {self.n_stages} stages")

    def check_modules(self, model: Any) -> None:
        """Raise unless ``model`` is what a rank of this pipeline is planned on: its stage,
        or under a multi-stage schedule its stages as one ``nn.ModuleList``."""
        from torch import nn

        if self.stages_per_rank > 1 and not (
            isinstance(model, nn.ModuleList) and len(model) == self.stages_per_rank
        ):
            raise PipelineError(
                f"under {self.schedule} a rank holds {self.stages_per_rank} stages: pass "
                "them as one nn.ModuleList, in the order of their stage indices "
                f"({', '.join(map(str, self.indices))})"
            )

    @property
    def ranks(self) -> int:
        return self.n_stages // self.stages_per_rank

    @property
    def indices(self) -> tuple[int, ...]:
        """The stages this rank holds, in loop order."""
        return tuple(self.stage + self.ranks * v for v in range(self.stages_per_rank))

    @property
    def first(self) -> bool:
        return 0 in self.indices

    @property
    def last(self) -> bool:
        return self.n_stages - 1 in self.indices

    def describe(self) -> str:
        held = (
            f"stage {self.stage}"
            if self.stages_per_rank == 1
            else f"stages {', '.join(map(str, self.indices))}"
        )
        return f"{held} of {self.n_stages}, {self.schedule}, {self.microbatches} microbatches"


@dataclass(frozen=True)
class Action:
    """One forward (``F``) or backward (``B``) of a microbatch, as the stage ran it."""

    kind: str
    microbatch: int
    stage: int
    """The stage index it ran on (a rank of a multi-stage schedule holds several)."""
    in_flight: int
    """Microbatches whose forward has run and backward not, when this action starts."""
    peak_bytes: int
    """Live tensor bytes at their highest during the action (the live-storage meter's)."""
    time_s: float = 0.0
    """Estimated time of the action's ops (a backward's recompute included), on the
    profile the stage was traced for."""


@dataclass(frozen=True)
class ScheduleTrace:
    """A stage's ``schedule.step()`` as traced: its actions in the order they ran."""

    pipeline: Pipeline
    actions: tuple[Action, ...]
    peak_bytes: int
    """At the allocator, over the whole step (receive buffers included: allocated by the
    first step, they stay for every later one)."""
    tensor_peak_bytes: int
    events: tuple[Any, ...] = ()
    """Every op of the step (:class:`remat.executors.sac.trace.OpEvent`, which imports this
    module), when the trace was asked to keep them (``schedule_events``)."""
    unseen_peak_bytes: int = 0
    """As :attr:`remat.executors.sac.trace.StepTrace.unseen_peak_bytes`, over the step."""

    @property
    def max_in_flight(self) -> int:
        """The most microbatches whose activations the stage held at once (a rank of a
        multi-stage schedule: microbatch-stage pairs)."""
        return max((a.in_flight + (a.kind == "F") for a in self.actions), default=0)

    @property
    def order(self) -> str:
        """``F0 F1 B0 ...``; with several stages on the rank, ``2F0``: the stage first."""
        several = self.pipeline.stages_per_rank > 1
        return " ".join(f"{a.stage if several else ''}{a.kind}{a.microbatch}" for a in self.actions)
