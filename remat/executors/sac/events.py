"""What a traced step is: the ops of one training step as the native executor ran them on
FakeTensors, each with its place in the step, its bytes and its estimated time
(:class:`OpEvent`), and the step's peaks (:class:`StepTrace`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from remat.executors.sac.offload import CopyMark
from remat.executors.sac.regions import OpKey
from remat.parallel.pipelining import ScheduleTrace


@dataclass(frozen=True)
class OpEvent:
    """One ATen op of the traced step."""

    op: str
    phase: str
    """``forward`` or ``backward`` (the output gradients drawn between them count as
    backward)."""
    block: int
    """Index of the block it ran in (forward, or recomputation, or the block's backward
    ops); -1 outside blocks."""
    recompute: bool
    key: OpKey | None
    """The SAC policy's key of a forward op inside a block (``None`` elsewhere and for the
    ops SAC ignores, e.g. ``detach``)."""
    allocated_bytes: int
    """Bytes at the allocator while the op runs (a peak candidate): live tensor storages
    right after its outputs were allocated, plus its kernel's scratch and what no dispatch
    sees (:attr:`remat.executors.sac.recorder.Recorder.unseen_bytes`), where those are measured
    (:func:`remat.measure.scratch.where_measured`)."""
    new_bytes: int
    """Bytes of storages the op created."""
    flops: int
    time_s: float
    savable: bool
    """A forward op whose output SAC can keep: new storages only (not a view, which would pin
    its base), not a mutating op, and not mutated in place later in the region."""
    writes_outside: bool = False
    """A forward op of a block that writes in place to a tensor the block did not create
    (BatchNorm's running statistics): every policy keeps it, so the recomputation returns
    its cached outputs instead of updating the state a second time."""
    reads: tuple[tuple[int, str], ...] = ()
    """``(event, storage)`` for each storage (made during the step) this op read: the last
    event whose output held it (its creator, or a later view of it or in-place write)."""
    holds: tuple[str, ...] = ()
    """Storages its outputs reference (made during the step), as step-unique names."""
    creates: tuple[str, ...] = ()
    """Storages it created (a subset of ``holds``)."""
    tensor_bytes: int = 0
    """Live tensor storages right after its outputs were allocated (what a live-storage
    meter sees)."""
    late_bytes: int = 0
    """Of ``tensor_bytes`` (and ``allocated_bytes``), a collective's output Python has let go
    of and the process group may still hold: counted until the next one is freed
    (:meth:`remat.executors.sac.recorder.Recorder._free`), so that a peak is never predicted
    low; where the group lets go on time, the step holds that much less here."""
    scratch_bytes: int = 0
    """What its kernel allocated and freed inside itself (:mod:`remat.measure.scratch`)."""
    moved_bytes: int = 0
    """Bytes it reads and writes (0 for a view, which launches no kernel): with ``flops``
    and ``dtype``, what the roofline times (:meth:`remat.measure.profiles.DeviceProfile.op_time`)."""
    dtype: str = "float32"


@dataclass(frozen=True)
class StepTrace:
    events: tuple[OpEvent, ...]
    peak_bytes: int
    """At the allocator (the events' ``allocated_bytes``, and the moments something no
    dispatch sees was allocated between them)."""
    blocks: tuple[str, ...]
    forward_live: tuple[tuple[int, int], ...]
    """Per block, live bytes when its forward starts and when it has returned."""
    storage_bytes: Mapping[str, int] = field(default_factory=dict)
    """Bytes of every storage named in the events' ``creates``."""
    outputs: tuple[str, ...] = ()
    """Storages of the model's outputs (held by the caller until the step ends)."""
    live_at_end: frozenset[str] = frozenset()
    """Storages still live when the backward has returned (the parameters' gradients)."""
    deaths: Mapping[str, int] = field(default_factory=dict)
    """Storage -> the first event after it was freed: where the program (its variables,
    autograd's saved tensors) let go of it, which the dataflow alone does not say."""
    tensor_peak_bytes: int = 0
    """Live tensor storages alone (the live-storage meter's peak)."""
    scratch: str = ""
    """Where kernel scratch and RNG states were measured, or why they count 0."""
    unseen_peak_bytes: int = 0
    """The allocator's bytes at the moments something no dispatch sees was allocated
    between ops (RNG states, FSDP2's resized parameters): a peak candidate besides the
    events."""
    schedule: ScheduleTrace | None = None
    """For a pipeline stage, its whole ``schedule.step()`` under the same policies, whose
    peaks ``peak_bytes`` and ``tensor_peak_bytes`` then are; the events stay one
    microbatch's (what the policies and the costs are read from)."""
    dispatch_s: tuple[float, ...] = ()
    """Per block, what selective checkpointing's own dispatch adds to the step (the
    profile's :class:`remat.problem.DispatchCosts` times the policy calls the step made; 0
    for a block run without checkpoint). Empty: not counted."""

    copies: tuple[CopyMark, ...] = ()
    """Where each offloaded region's copies start, release, prefetch and are used
    (:mod:`remat.executors.sac.offload`); empty without offload."""
    offloaded: tuple[int, ...] = ()
    """The regions whose activation inputs waited in host memory."""
    host_peak_bytes: int = 0
    """The host store's peak: every offloaded input between its copy-out and its prefetch."""
    copy_exposed_s: float = 0.0
    """What the copies add to the step where the ops between their fixed points do not hide
    them (:func:`remat.executors.sac.offload.exposed_copy_s`)."""

    @property
    def offloaded_bytes(self) -> int:
        return sum(m.nbytes for m in self.copies if m.kind == "out")

    @property
    def peak_event(self) -> int:
        return max(range(len(self.events)), key=lambda k: self.events[k].allocated_bytes)

    def forward_stream(self, block: int) -> tuple[OpEvent, ...]:
        """The keyed forward ops of ``block``: what its policy sees, in order."""
        return tuple(
            e
            for e in self.events
            if e.block == block and e.phase == "forward" and e.key is not None
        )

    def renumbered(self, order: Sequence[int]) -> StepTrace:
        """This trace with its region ``order[k]`` as region ``k`` (what
        :meth:`remat.executors.sac.trace.FakeModel.in_call_order` does to the copy's regions): with every region eager
        the step is the same whatever their numbers, so no second trace is needed."""
        new = {old: k for k, old in enumerate(order)}

        def renumber(events: Sequence[OpEvent]) -> tuple[OpEvent, ...]:
            return tuple(e if e.block < 0 else replace(e, block=new[e.block]) for e in events)

        schedule = self.schedule
        if schedule is not None and schedule.events:
            schedule = replace(schedule, events=renumber(schedule.events))
        return replace(
            self,
            events=renumber(self.events),
            blocks=tuple(self.blocks[b] for b in order),
            forward_live=tuple(self.forward_live[b] for b in order),
            schedule=schedule,
            dispatch_s=tuple(self.dispatch_s[b] for b in order) if self.dispatch_s else (),
        )

    @property
    def recompute_flops(self) -> int:
        return sum(e.flops for e in self.events if e.recompute)

    @property
    def recompute_time_s(self) -> float:
        return sum(e.time_s for e in self.events if e.recompute)

    @property
    def dispatch_time_s(self) -> float:
        return sum(self.dispatch_s)

    @property
    def added_time_s(self) -> float:
        """What the plan adds to the step: recomputation, checkpointing's dispatch and the
        copies' exposed time (what the planner minimises)."""
        return self.recompute_time_s + self.dispatch_time_s + self.copy_exposed_s


class TraceError(RuntimeError):
    """The training step failed while remat traced it (on FakeTensors, an op whose output
    shape depends on values, say); the message names the op, the block and the module."""
