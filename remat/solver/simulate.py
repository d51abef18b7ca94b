"""Exact memory timeline of one training step under the executor's schedule.

The model of the executor (it mirrors :mod:`remat.rewrite.executor` and FX's code generation):

* a value is held from the op that produces it until after its last use in the graph that runs
  it; a value with no use in that graph is dropped right after its op; graph outputs are held
  past the end of the graph;
* a storage is live while any holder references it; external storages (parameters, buffers,
  inputs) existed before the step and cost nothing;
* an op's outputs are allocated while its inputs are still held, so the live total right after
  an op's allocation, before any frees, is a peak candidate;
* after the forward, user outputs are held by the caller until the step ends, saved values by
  the autograd context until the backward frees them after their last use (boxed calling
  convention), buffer updates are copied into the buffers and dropped;
* before the backward, the caller allocates one dense gradient per differentiable user output
  (the tangents); the autograd engine holds them until the backward returns;
* the backward's gradients are returned and stored as ``.grad`` (stolen, not copied).

``tensor_peak_bytes`` is the maximum live total over the step: exactly what
:class:`remat.meter.LiveMemoryMeter` measures on a real run. ``peak_bytes`` adds, at each op,
the scratch its kernel allocates and frees inside itself (:attr:`remat.Value.scratch_bytes`):
what the allocator holds at its peak (:func:`remat.meter.allocator_peak_bytes`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from remat.problem import Problem, Role
from remat.solver.schedule import Schedule


@dataclass(frozen=True)
class TimelineStep:
    phase: str
    """``forward``, ``backward`` (backward ops and recomputations) or ``runtime``."""
    name: str
    allocated_bytes: int
    """Live bytes right after this step's allocations, plus the op's scratch (a peak
    candidate at the allocator)."""
    live_bytes: int
    """Live bytes after this step's frees."""
    recompute: bool = False


@dataclass(frozen=True)
class Simulation:
    timeline: tuple[TimelineStep, ...]
    peak_bytes: int
    """At the allocator: live storages plus the running op's scratch."""
    tensor_peak_bytes: int
    """Live storages alone (what a live-storage meter measures)."""
    peak_step: str
    saved_bytes: int
    """Bytes the forward leaves to the backward (saved values, deduplicated by storage)."""
    recompute_flops: int
    recompute_time_s: float
    forward_time_s: float
    backward_time_s: float
    """Backward op time, recomputation included."""
    intervals: Mapping[str, list[tuple[int, int]]] | None = None
    """With ``simulate(..., intervals=True)``: per storage, the timeline steps (inclusive
    ranges) at which it is counted live, until it is freed."""
    held_at_end: Mapping[str, int] | None = None
    """With ``intervals=True``: storages still live when the step ends, and the timeline step
    from which each is counted (to the last step)."""

    @property
    def step_time_s(self) -> float:
        return self.forward_time_s + self.backward_time_s


class _Memory:
    """Storages, the holders that keep them alive, and the running totals."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.holders: Counter[str] = Counter()
        self.live = 0
        self.peak = 0
        self.tensor_peak = 0
        self.peak_step = ""
        self.timeline: list[TimelineStep] = []
        self.opened: dict[str, int] = {}
        self.intervals: dict[str, list[tuple[int, int]]] | None = None

    def hold(self, name: str) -> None:
        holders = self.holders
        for s in self.problem.by_name[name].storages:
            n = holders[s]
            if n == 0:
                self.live += self.problem.storage_bytes[s]
                self.opened[s] = len(self.timeline)
            holders[s] = n + 1

    def drop(self, name: str) -> None:
        holders = self.holders
        for s in self.problem.by_name[name].storages:
            n = holders[s] - 1
            assert n >= 0, f"storage {s} of {name} dropped twice"
            holders[s] = n
            if n == 0:
                self.live -= self.problem.storage_bytes[s]
                if self.intervals is not None:
                    # Counted in the current step's allocated bytes (freed after it).
                    self.intervals.setdefault(s, []).append((self.opened[s], len(self.timeline)))

    def record(
        self, phase: str, name: str, allocated: int, recompute: bool = False, scratch: int = 0
    ) -> None:
        self.tensor_peak = max(self.tensor_peak, allocated)
        allocated += scratch
        if allocated > self.peak:
            self.peak, self.peak_step = allocated, f"{phase}:{name}"
        self.timeline.append(TimelineStep(phase, name, allocated, self.live, recompute))


def _run_graph(
    mem: _Memory,
    phase: str,
    ops: tuple[str, ...],
    outputs: Iterable[str],
    recomputed: frozenset[str] = frozenset(),
    held_until: Mapping[str, str] | None = None,
) -> None:
    """Execute one FX graph; its outputs stay held by their variables when it returns.

    Inputs arrive held by the caller; a boxed call hands that reference to the graph, which
    drops it after the input's last use (an input never read stays held until the end), or
    after ``held_until[input]`` if the executor holds it longer.
    """
    problem = mem.problem
    by_name = problem.by_name
    outputs = set(outputs)
    last_use: dict[str, int] = {}
    for k, name in enumerate(ops):
        for i in by_name[name].inputs:
            last_use[i] = k
    if held_until:
        at = {name: k for k, name in enumerate(ops)}
        for name, op in held_until.items():
            last_use[name] = max(last_use.get(name, 0), at[op])
    frees: dict[int, list[str]] = {}
    for name, k in last_use.items():
        if name not in outputs:
            frees.setdefault(k, []).append(name)
    for k, name in enumerate(ops):
        if name not in last_use and name not in outputs:
            frees.setdefault(k, []).append(name)
    hold, drop, record, no_frees = mem.hold, mem.drop, mem.record, ()
    for k, name in enumerate(ops):
        again = name in recomputed
        if again:
            # build_schedule saves such an op instead: its storage cannot be named twice.
            held = [s for s in by_name[name].allocates if mem.holders[s]]
            if held:
                raise SecondCopyError(f"recomputing {name} would copy storages still held: {held}")
        hold(name)
        allocated = mem.live
        for dead in frees.get(k, no_frees):
            drop(dead)
        record(phase, name, allocated, again, by_name[name].scratch_bytes)


class SecondCopyError(ValueError):
    """A schedule recomputes an op whose output storage is still held: a second copy of one
    storage, which the simulator's accounting (one storage, one name) cannot represent.
    remat's executor never does it (it saves such an op instead); PyTorch's checkpoint can,
    where a region's output is an op its replay runs again."""


def simulate(problem: Problem, schedule: Schedule, *, intervals: bool = False) -> Simulation:
    """Walk the executor's order and account every storage; see the module docstring.
    ``intervals``: also record when each storage is live (for executors' lifetimes)."""
    values = problem.by_name
    mem = _Memory(problem)
    if intervals:
        mem.intervals = {}

    # Forward graph: returns user outputs, buffer updates, saved values.
    fw_outputs = (*problem.user_outputs, *problem.mutation_outputs, *schedule.saved)
    _run_graph(mem, "forward", schedule.forward, fw_outputs)
    # The graph's output tuple is split: the caller keeps the user outputs, the context the
    # saved values; buffer updates are copied into the buffers and dropped.
    for name in (*problem.user_outputs, *schedule.saved):
        mem.hold(name)
    for name in dict.fromkeys(fw_outputs):
        mem.drop(name)
    mem.record("runtime", "buffer updates", mem.live)
    saved_bytes = problem.storages_bytes(s for n in schedule.saved for s in values[n].storages)

    # The caller allocates the tangents; the engine holds them for the whole backward.
    tangents = [v.name for v in problem.values if v.role is Role.TANGENT]
    for t in tangents:
        mem.hold(t)  # the engine's reference
        mem.hold(t)  # the backward graph's argument
    mem.record("runtime", "output gradients", mem.live)
    _run_graph(
        mem,
        "backward",
        schedule.backward,
        problem.grad_outputs if problem.grads_held else (),
        frozenset(schedule.recomputed),
        schedule.held_until,
    )

    recomputed = [values[n] for n in schedule.recomputed]
    return Simulation(
        timeline=tuple(mem.timeline),
        peak_bytes=mem.peak,
        tensor_peak_bytes=mem.tensor_peak,
        peak_step=mem.peak_step,
        saved_bytes=saved_bytes,
        recompute_flops=sum(v.flops for v in recomputed),
        recompute_time_s=sum(v.time_s for v in recomputed),
        forward_time_s=sum(values[n].time_s for n in schedule.forward),
        backward_time_s=sum(values[n].time_s for n in schedule.backward),
        intervals=mem.intervals,
        held_at_end=(
            {s: mem.opened[s] for s, n in mem.holders.items() if n > 0}
            if mem.intervals is not None
            else None
        ),
    )
