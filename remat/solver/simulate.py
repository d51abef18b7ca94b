"""Exact memory timeline of one training step under the executor's schedule.

The model of the executor (it mirrors :mod:`remat.executors.graph.run` and FX's code generation):

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
:class:`remat.measure.meter.LiveMemoryMeter` measures on a real run. ``peak_bytes`` adds, at
each op, the scratch its kernel allocates and frees inside itself (:attr:`remat.problem.Value.scratch_bytes`):
what the allocator holds at its peak (:func:`remat.measure.meter.allocator_peak_bytes`).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from remat.problem import Problem, Role
from remat.solver import clock, offload
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
    late_bytes: int = 0
    """Of both counts, a collective's output the program has let go of and its process
    group may still hold (``remat.apply``'s trace counts the last one freed until the next
    is); where the group lets go on time, the step holds that much less here."""


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
    dispatch_time_s: float = 0.0
    """The executor's own time beside the ops' (``sac``: selective checkpointing's policy
    calls, :class:`remat.problem.DispatchCosts`); counted in :attr:`step_time_s`."""
    offloaded_bytes: int = 0
    """Bytes of the values copied to host memory (:attr:`Schedule.offloaded`)."""
    host_peak_bytes: int = 0
    """Host memory the offloaded copies take at once, at most."""
    copy_exposed_s: float = 0.0
    """Time compute waits on the copies (:func:`remat.solver.offload.copy_timing`); counted
    in :attr:`step_time_s`."""

    @property
    def step_time_s(self) -> float:
        """Forward, backward (recomputation included), the executor's dispatch and the copy
        time not hidden behind compute."""
        return (
            self.forward_time_s + self.backward_time_s + self.dispatch_time_s + self.copy_exposed_s
        )

    @property
    def added_time_s(self) -> float:
        """What the plan adds to the step: recomputation, the executor's dispatch and exposed
        copies."""
        return self.recompute_time_s + self.dispatch_time_s + self.copy_exposed_s


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
    released: Mapping[str, list[str]] | None = None,
    arriving: Mapping[str, list[str]] | None = None,
) -> None:
    """Execute one FX graph; its outputs stay held by their variables when it returns.

    Inputs arrive held by the caller; a boxed call hands that reference to the graph, which
    drops it after the input's last use (an input never read stays held until the end), or
    after ``held_until[input]`` if the executor holds it longer. Offload: ``released[op]``,
    outputs whose device copy is dropped after ``op`` (its copy-out waited on);
    ``arriving[op]``, inputs copied back to the device from just before ``op``.
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
    released, arriving = released or {}, arriving or {}
    for k, name in enumerate(ops):
        for value in arriving.get(name, no_frees):
            hold(value)
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
        for dead in released.get(name, no_frees):
            drop(dead)
        record(phase, name, allocated, again, by_name[name].scratch_bytes)


def storage_steps(
    problem: Problem,
    schedule: Schedule,
    storages: frozenset[str],
    holders: Iterable[str],
    backward_at: Mapping[str, int] | None = None,
) -> list[tuple[int, int, int]]:
    """``(step, allocated, live)``: the bytes of ``storages`` alone, as :func:`simulate`
    counts them (scratch aside), at each step of the schedule's timeline where one of
    ``holders`` (every value that references one of them) is held or dropped; between two
    such steps they stay at the earlier's ``live``. Why: a change to a schedule that moves
    the holds of a few storages changes the timeline by theirs alone, found without walking
    every op. ``backward_at``: each backward op's step in another timeline, of which this
    schedule's backward is a subsequence (the steps are then that timeline's)."""
    if schedule.offloaded:
        raise ValueError("storage_steps models no offload: simulate a schedule that offloads")
    by_name, users = problem.by_name, problem.users
    names = set(holders)
    before: dict[int, list[tuple[str, int]]] = defaultdict(list)  # (value, +1 hold / -1 drop)
    after: dict[int, list[str]] = defaultdict(list)  # drops once the step has allocated

    def graph(
        at: Mapping[str, int], outputs: Iterable[str], held_until: Mapping[str, str] | None = None
    ) -> None:
        """:func:`_run_graph`'s holds and drops of ``names`` (``at``: each op's step)."""
        outs = set(outputs)
        held_until = held_until or {}
        for n in names:
            if n in at:
                before[at[n]].append((n, 1))
            reads = [at[u] for u in users[n] if u in at]
            if n in held_until:
                reads.append(at[held_until[n]])
            if n in outs:
                continue
            if reads:
                after[max(reads)].append(n)
            elif n in at:
                after[at[n]].append(n)

    fw_outputs = (*problem.user_outputs, *problem.mutation_outputs, *schedule.saved)
    graph({n: k for k, n in enumerate(schedule.forward)}, fw_outputs)
    runtime = len(schedule.forward)
    for n in (*problem.user_outputs, *schedule.saved):
        if n in names:
            before[runtime].append((n, 1))
    for n in dict.fromkeys(fw_outputs):
        if n in names:
            before[runtime].append((n, -1))
    for v in problem.values:
        if v.role is Role.TANGENT and v.name in names:
            before[runtime + 1] += [(v.name, 1), (v.name, 1)]
    offset = runtime + 2
    at = (
        {n: backward_at[n] for n in schedule.backward}
        if backward_at is not None
        else {n: k + offset for k, n in enumerate(schedule.backward)}
    )
    graph(at, problem.grad_outputs if problem.grads_held else (), schedule.held_until)
    counts: Counter[str] = Counter()
    live = 0
    out: list[tuple[int, int, int]] = []

    def change(name: str, by: int) -> None:
        nonlocal live
        for st in by_name[name].storages:
            if st in storages:
                n = counts[st]
                counts[st] = n + by
                if n == 0 or n + by == 0:
                    live += by * problem.storage_bytes[st]

    for step in sorted(before.keys() | after.keys()):
        for name, by in before.get(step, ()):
            change(name, by)
        allocated = live
        for name in after.get(step, ()):
            change(name, -1)
        out.append((step, allocated, live))
    return out


def _check_offloads(problem: Problem, schedule: Schedule) -> None:
    values = problem.by_name
    offload.check(
        schedule.offloaded,
        schedule.forward,
        schedule.saved,
        schedule.backward,
        {n: values[n].inputs for n in (*schedule.forward, *schedule.backward)},
        {v.name: (v.storages, v.allocates) for v in problem.values},
        (*problem.user_outputs, *problem.mutation_outputs),
    )


def _copies(problem: Problem, schedule: Schedule) -> dict[str, Any]:
    """The offloaded bytes, the host peak and the exposed copy time of ``schedule``. In one
    step every copy-out precedes every prefetch, so the host holds all offloaded values at
    once, right after the forward."""
    if not schedule.offloaded:
        return {}
    link = offload.link_of(problem)
    values = problem.by_name
    nbytes = {o.value: problem.storages_bytes(values[o.value].storages) for o in schedule.offloaded}
    timing = offload.copy_timing(
        schedule.forward,
        schedule.backward,
        {n: values[n].time_s for n in (*schedule.forward, *schedule.backward)},
        schedule.offloaded,
        nbytes,
        offload.first_reads(schedule.backward, {n: values[n].inputs for n in schedule.backward}),
        link,
    )
    total = sum(nbytes.values())
    return {"offloaded_bytes": total, "host_peak_bytes": total, "copy_exposed_s": timing.exposed_s}


class SecondCopyError(ValueError):
    """A schedule recomputes an op whose output storage is still held: a second copy of one
    storage, which the simulator's accounting (one storage, one name) cannot represent.
    remat's executor never does it (it saves such an op instead); PyTorch's checkpoint can,
    where a region's output is an op its replay runs again."""


def simulate(problem: Problem, schedule: Schedule, *, intervals: bool = False) -> Simulation:
    """Walk the executor's order and account every storage; see the module docstring.
    ``intervals``: also record when each storage is live (for executors' lifetimes)."""
    clock.charge(clock.SIMULATED_STEP_S * (len(schedule.forward) + len(schedule.backward)))
    values = problem.by_name
    mem = _Memory(problem)
    if intervals:
        mem.intervals = {}

    offloaded = {o.value for o in schedule.offloaded}
    if offloaded:
        _check_offloads(problem, schedule)
    released: dict[str, list[str]] = {}
    arriving: dict[str, list[str]] = {}
    for o in schedule.offloaded:
        released.setdefault(o.wait, []).append(o.value)
        arriving.setdefault(o.prefetch, []).append(o.value)

    # Forward graph: returns user outputs, buffer updates, saved values (an offloaded one's
    # device copy is dropped once its copy-out is waited on).
    fw_outputs = (*problem.user_outputs, *problem.mutation_outputs, *schedule.saved)
    _run_graph(mem, "forward", schedule.forward, fw_outputs, released=released)
    # The graph's output tuple is split: the caller keeps the user outputs, the context the
    # saved values; buffer updates are copied into the buffers and dropped.
    for name in (*problem.user_outputs, *schedule.saved):
        if name not in offloaded:
            mem.hold(name)
    for name in dict.fromkeys(fw_outputs):
        if name not in offloaded:
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
        arriving=arriving,
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
        dispatch_time_s=schedule.dispatch_s,
        **_copies(problem, schedule),
        intervals=mem.intervals,
        held_at_end=(
            {s: mem.opened[s] for s, n in mem.holders.items() if n > 0}
            if mem.intervals is not None
            else None
        ),
    )
