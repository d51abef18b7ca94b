"""One stage of a ``torch.distributed.pipelining`` pipeline, as ``remat.apply`` plans it.

A stage does not hold one microbatch's activations but those of every microbatch in flight:
under 1F1B with P stages, stage i runs up to P - i forwards before its first backward; under
GPipe every stage runs all its forwards first. So a stage's peak is not one step's but that of
a whole ``schedule.step()``, and it differs from stage to stage under one plan.

remat traces it as it runs: the stage's FakeTensor copy is wrapped in a ``PipelineStage``
and stepped by PyTorch's own schedule class on a fake process group, as the stage's rank
(:meth:`remat.native.trace.FakeModel.trace`), under the recorder that measures every step.
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

SCHEDULES = ("GPipe", "1F1B")
"""Schedules ``remat.apply`` plans a stage for: one stage per rank, each microbatch's
backward whole. PyTorch's selective checkpointing is bitwise under them (and under the
multi-stage ``Interleaved1F1B`` and ``LoopedBFS``, which remat does not plan yet)."""

SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""Schedules that split each backward into an input and a weight part: a region under
selective checkpointing may only be backwarded once ("Trying to backward an extra time"),
so no SAC plan runs under them."""

MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS")


class PipelineError(ValueError):
    """A pipeline ``remat.apply`` cannot plan a stage of (the message says which can)."""


@dataclass(frozen=True)
class Pipeline:
    """Where a stage module runs: its index among ``n_stages``, the ``schedule``'s name and
    the number of ``microbatches`` a ``step()`` splits the batch into. ``loss_fn``: the
    schedule's loss function, which the last stage's step runs on its outputs and the
    ``target`` given to ``remat.apply`` (``loss_fn(output, target)``)."""

    schedule: str
    stage: int
    n_stages: int
    microbatches: int
    loss_fn: Callable[[Any, Any], Any] | None = None

    def __post_init__(self) -> None:
        names = {s.lower(): s for s in (*SCHEDULES, *SPLIT_BACKWARD, *MULTI_STAGE)}
        name = names.get(self.schedule.lower())
        can = ", ".join(SCHEDULES)
        if name in SPLIT_BACKWARD:
            raise PipelineError(
                f"schedule {name} splits each backward in two (input, then weight "
                "gradients), and a region under selective checkpointing can only be "
                f"backwarded once: it cannot run a remat plan. Schedules that can: {can}"
            )
        if name in MULTI_STAGE:
            raise PipelineError(
                f"schedule {name} runs several stages per rank, which remat does not plan "
                f"yet; schedules it plans: {can}"
            )
        if name is None:
            raise PipelineError(f"unknown pipeline schedule {self.schedule!r}; remat plans {can}")
        object.__setattr__(self, "schedule", name)
        if self.n_stages < 2:
            raise PipelineError(f"a pipeline has at least 2 stages, not {self.n_stages}")
        if not 0 <= self.stage < self.n_stages:
            raise PipelineError(f"stage {self.stage} is not one of the {self.n_stages} stages")
        if self.microbatches < 1:
            raise PipelineError(f"microbatches must be at least 1, not {self.microbatches}")
        if self.last and self.loss_fn is None:
            raise PipelineError(
                f"stage {self.stage} is the last: give the schedule's loss_fn "
                "(Pipeline(..., loss_fn=...)) and the target of one microbatch "
                "(remat.apply(..., target=...))"
            )

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.n_stages - 1

    def describe(self) -> str:
        return (
            f"stage {self.stage} of {self.n_stages}, {self.schedule}, "
            f"{self.microbatches} microbatches"
        )


@dataclass(frozen=True)
class Action:
    """One forward (``F``) or backward (``B``) of a microbatch, as the stage ran it."""

    kind: str
    microbatch: int
    in_flight: int
    """Microbatches whose forward has run and backward not, when this action starts."""
    peak_bytes: int
    """Live tensor bytes at their highest during the action (the live-storage meter's)."""


@dataclass(frozen=True)
class ScheduleTrace:
    """A stage's ``schedule.step()`` as traced: its actions in the order they ran."""

    pipeline: Pipeline
    actions: tuple[Action, ...]
    peak_bytes: int
    """At the allocator, over the whole step (receive buffers included: allocated by the
    first step, they stay for every later one)."""
    tensor_peak_bytes: int

    @property
    def max_in_flight(self) -> int:
        """The most microbatches whose activations the stage held at once."""
        return max((a.in_flight + (a.kind == "F") for a in self.actions), default=0)

    @property
    def order(self) -> str:
        return " ".join(f"{a.kind}{a.microbatch}" for a in self.actions)
