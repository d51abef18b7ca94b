"""When values are materialised and freed: one description per executor.

A plan is a saved set; what it costs depends on who runs it. The description of an executor
says which values a plan may keep (``candidates``), the exact order the step then runs
(``schedule``: forward ops, what crosses to the backward, the backward with its
recomputations inlined, how long the executor itself holds a saved value), and, where the
lifetimes do not depend on the rest of the plan, each value's lifetime with and without saving
it (``lifetimes``). The simulator runs any schedule; the MILPs read ``lifetimes`` (fixed
lifetimes make the memory model linear: :mod:`remat.solver.spans`) or model the schedule
themselves (:mod:`remat.solver.milp`, the graph executor's recompute-at-stage variables); the
native planner's menus are saved sets of ``candidates``. No solver branches on an executor's
name.

* ``graph``: remat's own forward and backward graphs (:mod:`remat.executors.graph`). The backward
  recomputes each missing value just before its first use, only what is needed, once; random
  ops are never recomputed. :func:`remat.solver.schedule.build_schedule` is its schedule.
* ``sac``: PyTorch's non-reentrant ``checkpoint`` with a selective policy per region, as
  ``remat.apply`` runs it on the user's blocks. A region holds its tensor inputs from its
  forward to the end of its backward, and its kept (``MUST_SAVE``) outputs until the backward
  uses them last. At the region's first backward op its forward is replayed, in order, every
  op the policy did not keep re-run (random ones too: the RNG state is replayed), up to the
  last value its backward reads (early stop); a replayed value lives to its last use. Code
  outside the regions runs eagerly: autograd keeps what its backward reads. Only values that
  own new storage and are not mutated later (``Value.savable``) can be kept; ``random`` marks
  the ops that must never re-run (in-place writes to state outside the region). Its own
  time, SAC's policy dispatch on every op of a checkpointed region (``Problem.dispatch``), is
  the schedule's ``dispatch_s``; the lifetimes carry it as linear terms (a region left
  without checkpoint saves its whole dispatch; keeping an op changes its own calls' cost).
  What its schedule reads of a problem whatever the plan (the regions, their replay spans)
  is indexed once per problem in :mod:`remat.solver.sac_index`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from remat.problem import Problem, Role
from remat.solver.sac_index import NO_CHECKPOINT, _creators, _per_problem, _reads, _regions
from remat.solver.schedule import InvalidPlanError, Schedule, build_schedule
from remat.solver.simulate import TimelineStep, simulate, storage_steps


@dataclass(frozen=True)
class Lifetime:
    """What keeping one candidate costs and saves, when that does not depend on the plan."""

    name: str
    time_s: float
    """Recompute time saved by keeping it."""
    pieces: tuple[tuple[int, int, int], ...]
    """``(bytes, first, last)``: at the moments ``first..last`` (indices into the timeline of
    the plan that keeps nothing) keeping it holds ``bytes`` more than keeping nothing."""
    group: str
    """Its region: candidates of one group tend to share spans (the MILP aggregates them)."""
    whole_group: bool = False
    """Keeping it excludes keeping the group's other candidates (a region left without
    checkpoint)."""


@dataclass(frozen=True)
class Lifetimes:
    base: tuple[int, ...]
    """Live bytes at each moment of the plan that keeps nothing (its simulated timeline)."""
    candidates: tuple[Lifetime, ...]
    forced: frozenset[str]
    """Values every plan keeps."""


@dataclass(frozen=True)
class ExecutorModel:
    name: str
    candidates: Callable[[Problem], frozenset[str]]
    schedule: Callable[[Problem, frozenset[str]], Schedule]
    lifetimes: Callable[[Problem], Lifetimes] | None
    """``None`` where a value's lifetime depends on what else is saved (``graph``)."""
    kept: Callable[[Problem, frozenset[str], Schedule], frozenset[str]]
    """A plan's saved set as the executor runs it (``Plan.saved``): ``graph``, what its
    schedule hands to the backward; ``sac``, what the policies keep (``MUST_SAVE``) and the
    regions left without checkpoint."""
    on_demand: bool = False
    """Each missing value is recomputed just before the first backward op that needs it,
    never earlier (``graph``; ``sac`` replays a region's forward at its first backward op):
    the lower bound (:mod:`remat.solver.bound`) may then count a saved value that feeds
    recomputations as live until the first backward op that can need them."""


def _graph_candidates(problem: Problem) -> frozenset[str]:
    return frozenset(v.name for v in problem.values if v.role is Role.FORWARD)


def _graph_schedule(problem: Problem, saved: frozenset[str]) -> Schedule:
    return build_schedule(problem, saved)


GRAPH = ExecutorModel(
    "graph",
    _graph_candidates,
    _graph_schedule,
    None,
    lambda p, s, schedule: frozenset(schedule.saved),
    on_demand=True,
)


@_per_problem
def _sac_candidates(problem: Problem) -> frozenset[str]:
    return frozenset(
        v.name
        for v in problem.values
        if v.role is Role.FORWARD
        and v.region
        and (v.op == NO_CHECKPOINT or (v.savable and v.allocates))
    )


def _sac_keep(problem: Problem, saved: Iterable[str]) -> frozenset[str]:
    """``saved`` as SAC can keep it: a view stands for the storage it shares (its creator is
    kept), values SAC cannot keep are recomputed, the ops that must never re-run are kept."""
    candidates = _sac_candidates(problem)
    creator = _creators(problem)
    keep: set[str] = set()
    for name in saved:
        if name not in problem.by_name:
            raise InvalidPlanError(f"{name} is not a value of this problem")
        if name in candidates:
            keep.add(name)
            continue
        keep.update(
            creator[s]
            for s in problem.by_name[name].storages
            if creator.get(s) in candidates
            and problem.by_name[creator[s]].region == problem.by_name[name].region
        )
    keep.update(_reads(problem).never_recomputed)
    eager = {problem.by_name[n].region for n in keep if problem.by_name[n].op == NO_CHECKPOINT}
    return frozenset(
        n
        for n in keep
        if problem.by_name[n].op == NO_CHECKPOINT or problem.by_name[n].region not in eager
    )


def _sac_schedule(problem: Problem, saved: frozenset[str]) -> Schedule:
    return _sac_plan(problem, saved)[0]


def _sac_kept(problem: Problem, saved: frozenset[str], schedule: Schedule) -> frozenset[str]:
    return _sac_plan(problem, saved)[1]


def _sac_plan(problem: Problem, saved: frozenset[str]) -> tuple[Schedule, frozenset[str]]:
    """The schedule, and what the policies keep to run it."""
    keep = _sac_keep(problem, saved)
    skip: frozenset[str] = frozenset()
    while True:
        schedule, conflicts = _sac_order(problem, keep, skip)
        if not conflicts:
            return schedule, keep
        # A replayed op whose storage something still holds would make a second copy: keep
        # it (costs nothing, the storage is live anyway), or where SAC cannot, let the
        # replay use the held copy (the one case the simulation undercounts).
        candidates = _sac_candidates(problem)
        keep |= conflicts & candidates
        skip |= conflicts - candidates


def _sac_order(
    problem: Problem, keep: frozenset[str], skip: frozenset[str]
) -> tuple[Schedule, frozenset[str]]:
    """The schedule keeping ``keep`` (and replaying none of ``skip``), and the replayed
    values some holder still holds when their region replays."""
    by_name, index = problem.by_name, problem.index
    regions = _regions(problem)
    eager = {r for r, m in regions.markers.items() if m in keep}
    replay: dict[str, list[str]] = {}
    reads = _reads(problem)
    checkpointed = [r for r in regions.values if r not in eager]
    for r in checkpointed:
        replay[r] = [n for n in reads.span[r] if n not in keep and n not in skip]
    backward: list[str] = []
    recomputed: list[str] = []
    starts: dict[str, int] = {}
    for name, region in reads.backward:
        if region and region not in starts:
            starts[region] = len(backward)
            backward.extend(replay.get(region, ()))
            recomputed.extend(replay.get(region, ()))
        backward.append(name)
    again = set(recomputed)
    last: dict[str, int] = {}
    # Held from the forward: kept values, region inputs, and what eager code's autograd
    # keeps: forward values that the backward of other code (outside the regions, an eager
    # region, another region) reads.
    held = set(keep)
    for r, ins in regions.inputs.items():
        if r not in eager:
            held |= ins
    for k, n in enumerate(backward):
        own, replayed = reads.region[n], n in again
        for i, r, forward in reads.inputs[n]:
            if not replayed or r != own:
                last[i] = k  # a read of the forward's copy
            if forward and (not r or r in eager or r != own):
                held.add(i)
    held_until: dict[str, str] = {}
    for r, names in regions.values.items():
        ops = regions.backward.get(r)
        if not ops or r in eager:
            continue
        for i in regions.inputs.get(r, ()):  # the frame holds its inputs to its end
            held_until[i] = ops[-1]
        for n in names:
            if n in keep and n not in last:  # a cache entry nothing reads: released when the
                # replay passes it, or when the frame dies if the replay stops before it
                later = [m for m in replay[r] if index[m] > index[n]]
                held_until[n] = later[0] if later else ops[-1]
    at = {n: k for k, n in enumerate(backward)}
    until = {n: max(last.get(n, -1), at[op]) for n, op in held_until.items()}
    holders: dict[str, list[str]] = defaultdict(list)
    for h in held:
        for st in by_name[h].storages:
            holders[st].append(h)
    conflicts = frozenset(
        n
        for r, names in replay.items()
        if r in starts
        for n in names
        if any(
            max(last.get(h, -1), until.get(h, -1)) >= starts[r]
            for st in by_name[n].allocates
            for h in holders.get(st, ())
        )
    )
    saved_out = tuple(sorted((held & set(last)) | set(held_until), key=index.__getitem__))
    dispatch = sum(_region_dispatch(problem, r, keep) for r in checkpointed)
    schedule = Schedule(
        forward=reads.forward,
        saved=saved_out,
        external_reads=(),
        backward=tuple(backward),
        recomputed=tuple(recomputed),
        held_until={n: held_until[n] for n in saved_out if n in held_until},
        dispatch_s=dispatch,
    )
    return schedule, conflicts


def _region_dispatch(problem: Problem, region: str, keep: AbstractSet[str]) -> float:
    """What the checkpointed ``region``'s policy calls add to the step
    (:class:`remat.problem.DispatchCosts`), ``keep`` kept (its replay runs its span)."""
    costs = problem.dispatch
    by_name = problem.by_name
    reads = _reads(problem)
    names = reads.policy[region]
    replayed = reads.span_policy[region]
    kept = sum(n in keep for n in names)
    hits = sum(n in keep for n in replayed)
    host = costs.host_s(kept, len(names) - kept, hits, len(replayed) - hits, 1)
    if not costs.overlapped:
        return host
    device = reads.device_s[region]
    device += sum(by_name[n].time_s for n in replayed if n not in keep)
    return costs.exposed_s(host, device)


def _keep_delta(problem: Problem, name: str) -> float:
    """What keeping the policy-called op ``name`` adds to its region's dispatch, against
    recomputing it (a linear term for the MILP: on a profile whose dispatch overlaps the
    device's kernels, 0, and the traced plan counts what is exposed)."""
    costs = problem.dispatch
    if costs.overlapped or not problem.by_name[name].policy:
        return 0.0
    delta = costs.forward_saved_s - costs.forward_recomputed_s
    if name in _reads(problem).in_span:
        delta += costs.replay_hit_s - costs.replay_recomputed_s
    return delta


def _gaps(
    live: list[tuple[int, int]], start: int, end: int, nbytes: int
) -> list[tuple[int, int, int]]:
    """``(nbytes, first, last)`` for the moments of ``start..end`` outside ``live``."""
    out = []
    cursor = start
    for a, b in sorted(live):
        if a > cursor:
            out.append((nbytes, cursor, min(a - 1, end)))
        cursor = max(cursor, b + 1)
    if cursor <= end:
        out.append((nbytes, cursor, end))
    return [p for p in out if p[1] <= p[2]]


def _difference(
    timeline: Sequence[TimelineStep],
    nothing: Sequence[TimelineStep],
    at: Mapping[tuple[str, str, bool], int],
) -> tuple[tuple[int, int, int], ...]:
    """``timeline`` minus ``nothing``, moment by moment of ``nothing``, as ``(bytes, first,
    last)`` runs. A step of ``timeline`` that ``nothing`` does not run counts at the moment
    of its last common step before it; a moment only ``nothing`` runs (a replay) takes the
    other plan's next common step. ``at``: each step of ``nothing`` by its key."""
    other: dict[int, int] = {}
    moment = 0
    for step in timeline:
        moment = at.get((step.phase, step.name, step.recompute), moment)
        other[moment] = max(other.get(moment, 0), step.allocated_bytes)
    pieces: list[tuple[int, int, int]] = []
    following = nothing[-1].allocated_bytes if nothing else 0
    deltas = []
    for i in reversed(range(len(nothing))):
        following = other.get(i, following)
        deltas.append(following - nothing[i].allocated_bytes)
    for i, delta in enumerate(reversed(deltas)):
        if pieces and pieces[-1][0] == delta and pieces[-1][2] == i - 1:
            pieces[-1] = (delta, pieces[-1][1], i)
        elif delta:
            pieces.append((delta, i, i))
    return tuple(pieces)


@_per_problem
def _holders(problem: Problem) -> Mapping[str, tuple[str, ...]]:
    """Storage -> the values that reference it."""
    out: dict[str, list[str]] = defaultdict(list)
    for v in problem.values:
        for s in dict.fromkeys(v.storages):
            out[s].append(v.name)
    return {s: tuple(names) for s, names in out.items()}


def _eager_difference(
    problem: Problem,
    marker: str,
    nothing: Schedule,
    timeline: Sequence[TimelineStep],
    moment: Mapping[str, int],
    replayed: Iterable[str],
) -> tuple[tuple[int, int, int], ...] | None:
    """What :func:`_difference` gives for the region of ``marker`` left without checkpoint,
    from the storages of its values and inputs alone, the only ones whose holds move (the
    region's frame, its replay, what its backward reads), counted where they are held and
    dropped rather than by simulating the whole step once per region (129 regions of a 7B
    model: 9 s). ``replayed``: the region's replay under ``nothing``. None where the
    schedule differs beyond them (say, a replay elsewhere that the region's holds make a
    second copy), for the caller to simulate."""
    by_name = problem.by_name
    region = by_name[marker].region
    regions = _regions(problem)
    alone = _sac_schedule(problem, frozenset({marker}))
    own = set(regions.values.get(region, ())) | regions.inputs.get(region, frozenset())
    replay = set(replayed)
    if (
        alone.forward != nothing.forward
        or alone.backward != tuple(n for n in nothing.backward if n not in replay)
        or alone.recomputed != tuple(n for n in nothing.recomputed if n not in replay)
        or not set(alone.saved) ^ set(nothing.saved) <= own
        or any(
            alone.held_until.get(n) != nothing.held_until.get(n)
            for n in (alone.held_until.keys() | nothing.held_until.keys()) - own
        )
    ):
        return None
    storages = frozenset(st for n in own for st in by_name[n].storages)
    holders = {h for st in storages for h in _holders(problem).get(st, ())}
    base = storage_steps(problem, nothing, storages, holders)
    kept = storage_steps(problem, alone, storages, holders, backward_at=moment)
    replay_steps = sorted(moment[n] for n in replay)
    return _pieces(base, kept, replay_steps, timeline)


def _pieces(
    base: Sequence[tuple[int, int, int]],
    kept: Sequence[tuple[int, int, int]],
    replay: Sequence[int],
    timeline: Sequence[TimelineStep],
) -> tuple[tuple[int, int, int], ...]:
    """:func:`_difference`'s runs from the bytes of the storages whose holds move, under
    the plan keeping nothing (``base``) and the other (``kept``, which runs every step but
    ``replay``s), as :func:`remat.solver.simulate.storage_steps` gives them. At a common
    step the difference is theirs; at a replay step, the other plan's next common step less
    this one (the whole timeline's bytes)."""
    skipped = set(replay)
    points = sorted(
        {0, len(timeline)}
        | {s for s, _, _ in base}
        | {s + 1 for s, _, _ in base}
        | {s for s, _, _ in kept}
        | {s + 1 for s, _, _ in kept}
        | skipped
        | {s + 1 for s in skipped}
    )
    points = [p for p in points if p <= len(timeline)]

    def level(steps: Sequence[tuple[int, int, int]]) -> list[int]:
        """The bytes at each point (a run from it to the next has them)."""
        out, k, last = [], 0, 0
        at = {s: a for s, a, _ in steps}
        for p in points[:-1]:
            while k < len(steps) and steps[k][0] < p:
                last = steps[k][2]
                k += 1
            out.append(at.get(p, last))
        return out

    delta = [b - a for a, b in zip(level(base), level(kept), strict=True)]
    common = [  # (delta, first, last)
        (delta[i], p, points[i + 1] - 1) for i, p in enumerate(points[:-1]) if p not in skipped
    ]
    replays = []
    for p in skipped:  # the next common step's bytes less this one's
        nxt = next((r for r in common if r[1] > p), None)
        following = (
            timeline[nxt[1]].allocated_bytes + nxt[0] if nxt else timeline[-1].allocated_bytes
        )
        replays.append((following - timeline[p].allocated_bytes, p, p))
    pieces: list[tuple[int, int, int]] = []
    for d, first, last in sorted(common + replays, key=lambda r: r[1]):
        if pieces and pieces[-1][0] == d and pieces[-1][2] == first - 1:
            pieces[-1] = (d, pieces[-1][1], last)
        elif d:
            pieces.append((d, first, last))
    return tuple(pieces)


def _sac_lifetimes(problem: Problem) -> Lifetimes:
    """Each candidate's extra bytes when kept, over the timeline of the plan keeping nothing:
    from where that plan frees its storage after the forward to where its replay makes it
    again (or the executor would release the kept copy). A region left without checkpoint
    holds what its simulation holds (a difference moment by moment, which may be negative:
    no replay, no held inputs), and saves the region's whole replay."""
    nothing = _sac_schedule(problem, frozenset())
    sim = simulate(problem, nothing, intervals=True)
    assert sim.intervals is not None
    by_name = problem.by_name
    forced = _sac_keep(problem, ())
    offset = len(nothing.forward) + 2  # the two runtime steps between the passes
    moment = {n: k + offset for k, n in enumerate(nothing.backward)}
    again = set(nothing.recomputed)
    regions = _regions(problem)
    last_bw = {r: moment[ops[-1]] for r, ops in regions.backward.items()}
    replays: dict[str, list[str]] = defaultdict(list)
    for n in nothing.recomputed:
        replays[by_name[n].region].append(n)
    at = {(s.phase, s.name, s.recompute): i for i, s in enumerate(sim.timeline)}
    out: list[Lifetime] = []
    for name in sorted(_sac_candidates(problem) - forced, key=problem.index.__getitem__):
        v = by_name[name]
        if v.region not in last_bw:
            continue  # no backward: nothing to keep it for
        if v.op == NO_CHECKPOINT:
            replay_time = sum(by_name[n].time_s for n in regions.values[v.region] if n in again)
            replay_time += _region_dispatch(problem, v.region, forced)
            difference = _eager_difference(
                problem, name, nothing, sim.timeline, moment, replays.get(v.region, ())
            )
            if difference is None:  # the schedules differ beyond the region: simulate it
                alone = simulate(problem, _sac_schedule(problem, frozenset({name})))
                difference = _difference(alone.timeline, sim.timeline, at)
            out.append(Lifetime(name, replay_time, difference, v.region, whole_group=True))
            continue
        pieces: list[tuple[int, int, int]] = []
        # Kept, it lives to its last read, or, read by nothing, until the replay passes
        # its place (its next replayed op) or the region's backward ends.
        later = [n for n in replays.get(v.region, ()) if problem.index[n] > problem.index[name]]
        released = moment[later[0]] if later else last_bw[v.region]
        for s in v.allocates:
            live = sim.intervals.get(s, [])
            start = live[0][0] if live else 0
            end = max([b for _, b in live] + [released])
            pieces += _gaps(live, start, end, problem.storage_bytes[s])
        time_s = v.time_s if name in again else 0.0
        time_s -= _keep_delta(problem, name)
        out.append(Lifetime(name, time_s, tuple(pieces), v.region))
    base = tuple(step.allocated_bytes for step in sim.timeline)
    return Lifetimes(base, tuple(out), forced)


_sac_lifetimes_cached = _per_problem(_sac_lifetimes)
"""Lifetimes once per problem (a 7B model's take seconds; the native planner asks for them at
every budget it re-solves for)."""


SAC = ExecutorModel("sac", _sac_candidates, _sac_schedule, _sac_lifetimes_cached, _sac_kept)

EXECUTORS: Mapping[str, ExecutorModel] = {"graph": GRAPH, "sac": SAC}


def executor_of(problem: Problem) -> ExecutorModel:
    return EXECUTORS[problem.executor]


def schedule_of(problem: Problem, saved: Iterable[str]) -> Schedule:
    """The order the problem's executor runs ``saved`` in."""
    return executor_of(problem).schedule(problem, frozenset(saved))


__all__ = [
    "EXECUTORS",
    "GRAPH",
    "SAC",
    "ExecutorModel",
    "Lifetime",
    "Lifetimes",
    "executor_of",
    "schedule_of",
]
