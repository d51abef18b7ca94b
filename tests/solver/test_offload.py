"""Offload in the solver core: the copies' timing model, and the simulator's device and host
memory at the points a plan fixes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import remat
from remat.models import TinyGPT
from remat.problem import Link, Problem
from remat.solver import offload
from remat.solver.offload import Offload, OffloadError, copy_timing
from remat.solver.plan import Plan, Proof, make_plan
from remat.solver.registry import solve

GB = 1e9


def _timing(
    forward: tuple[str, ...],
    backward: tuple[str, ...],
    offloads: list[Offload],
    link: Link,
    nbytes: int = 1_000,
    reads: dict[str, str] | None = None,
) -> offload.CopyTiming:
    """Every op takes 1 s; each offloaded value has ``nbytes``."""
    times = {n: 1.0 for n in (*forward, *backward)}
    sizes = {o.value: nbytes for o in offloads}
    return copy_timing(forward, backward, times, offloads, sizes, reads or {}, link)


def test_a_copy_behind_enough_compute_is_hidden_and_one_without_is_exposed() -> None:
    forward, backward = ("a", "b", "c", "d"), ("g1", "g2", "g3")
    link = Link(d2h=500.0, h2d=250.0)  # 2 s out, 4 s back for 1,000 bytes
    # Copy-out hidden behind b and c; the prefetch has g1 and g2 (2 s) of its 4 s.
    hidden = Offload("a", wait="c", prefetch="g1")
    assert _timing(forward, backward, [hidden], link, reads={"a": "g3"}).exposed_s == 2.0
    early = Offload("a", wait="b", prefetch="g1")  # one op after a: 1 s of its 2 s hidden
    t = _timing(forward, backward, [early], link, reads={"a": "g3"})
    assert t.exposed_s == pytest.approx(1.0 + 2.0)  # 1 s of the copy-out, 2 of the prefetch
    assert (t.to_host_s, t.to_device_s) == (2.0, 4.0)


def test_copies_queue_behind_each_other_in_one_direction() -> None:
    forward, backward = ("a", "b", "c", "d", "e"), ("g",)
    link = Link(d2h=1_000.0, h2d=1e12)  # 1.5 s each out: a's from 1 to 2.5 s, b's to 4 s;
    # back in 1.5 ns each, exposed (started at their reader)
    reads = {"a": "g", "b": "g"}
    offs = [Offload("a", wait="e", prefetch="g"), Offload("b", wait="d", prefetch="g")]
    assert _timing(forward, backward, offs, link, 1_500, reads).exposed_s == pytest.approx(
        0.0, abs=1e-8
    )
    offs = [Offload("a", wait="e", prefetch="g"), Offload("b", wait="c", prefetch="g")]
    t = _timing(forward, backward, offs, link, 1_500, reads)
    assert t.exposed_s == pytest.approx(1.0, abs=1e-8)  # waited at 3 s, done at 4 s


def test_a_synchronous_link_exposes_every_copy() -> None:
    link = Link(d2h=500.0, h2d=250.0, synchronous=True)
    offs = [Offload("a", wait="c", prefetch="g1")]
    t = _timing(("a", "b", "c"), ("g1", "g2"), offs, link, reads={"a": "g2"})
    assert t.exposed_s == 2.0 + 4.0


def test_both_directions_at_once_share_the_link() -> None:
    channels = offload._Channels(Link(d2h=100.0, h2d=100.0, shared_d2h=50.0, shared_h2d=25.0))
    channels.start("out", 100, to_host=True)
    channels.start("in", 100, to_host=False)
    channels.wait("out")  # 2 s at 50 B/s while "in" moves 50 bytes at 25 B/s
    assert channels.stalled == pytest.approx(2.0)
    channels.wait("in")  # the last 50 bytes alone, at 100 B/s
    assert channels.stalled == pytest.approx(2.5)


def _tiny() -> tuple[Problem, Plan]:
    torch.manual_seed(0)
    tokens = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(1))
    problem = remat.analyze(TinyGPT(layers=2), (tokens,)).problem
    problem = dataclasses.replace(problem, link=Link(d2h=5 * GB, h2d=5 * GB))
    return problem, solve(problem, solver="keep_all", budget_bytes=None)


def _points(problem: Problem, plan: Plan, values: list[str]) -> tuple[Offload, ...]:
    s, by = plan.schedule, problem.by_name
    inputs = {n: by[n].inputs for n in (*s.forward, *s.backward)}
    return offload.place(
        s.forward,
        s.backward,
        {n: by[n].time_s for n in (*s.forward, *s.backward)},
        values,
        {v: problem.storages_bytes(by[v].storages) for v in values},
        offload.last_forward_uses(s.forward, inputs),
        offload.first_reads(s.backward, inputs),
        problem.link,  # type: ignore[arg-type]
    )


def _own_storage(problem: Problem, plan: Plan) -> list[str]:
    """Saved values that hold their storage alone (offloadable), largest first."""
    by = problem.by_name
    held = {s: n for n in (*plan.schedule.saved, *problem.user_outputs) for s in by[n].storages}
    mine = [
        n
        for n in plan.schedule.saved
        if set(by[n].storages) == set(by[n].allocates)
        and all(held[s] == n for s in by[n].storages)
        and sum(1 for m in plan.schedule.saved if set(by[m].storages) & set(by[n].storages)) == 1
    ]
    return sorted(mine, key=lambda n: -problem.storages_bytes(by[n].storages))


def test_an_offloaded_value_leaves_the_device_between_its_points() -> None:
    """Device memory falls by the value's bytes from its wait to its prefetch, and only
    there; the host holds it meanwhile; the step time gains only exposed copy time."""
    problem, keep_all = _tiny()
    (value, *_) = _own_storage(problem, keep_all)
    (point,) = _points(problem, keep_all, [value])
    plan = make_plan(
        problem, keep_all.saved, solver="x", reason="", proof=Proof.HEURISTIC, offloads=[point]
    )
    nbytes = problem.storages_bytes(problem.by_name[value].storages)
    assert plan.offloaded == (value,) and plan.offloaded_bytes == nbytes
    assert plan.predicted_host_peak_bytes == nbytes
    assert plan.decisions[value].startswith("offloaded")
    before, after = keep_all.simulation.timeline, plan.simulation.timeline
    names = [step.name for step in after]
    gone, back = names.index(point.wait), names.index(point.prefetch)  # keep_all: no repeats
    assert len(before) == len(after) and gone < back
    for k, (b, a) in enumerate(zip(before, after, strict=True)):
        assert b.live_bytes - a.live_bytes == (nbytes if gone <= k < back else 0), k
        assert b.allocated_bytes - a.allocated_bytes == (nbytes if gone < k < back else 0), k
    assert plan.predicted_peak_bytes <= keep_all.predicted_peak_bytes
    assert plan.step_time_s == pytest.approx(keep_all.step_time_s + plan.simulation.copy_exposed_s)


def test_offloads_the_executor_cannot_run_exactly_are_refused() -> None:
    problem, keep_all = _tiny()
    s, by = keep_all.schedule, problem.by_name
    view = next(n for n in s.saved if set(by[n].storages) != set(by[n].allocates))
    (value, *_) = _own_storage(problem, keep_all)
    (good,) = _points(problem, keep_all, [value])

    def plan(*offs: Offload, on: Problem = problem) -> Plan:
        return make_plan(
            on, keep_all.saved, solver="x", reason="", proof=Proof.HEURISTIC, offloads=offs
        )

    with pytest.raises(OffloadError, match="view of another value"):
        plan(Offload(view, wait=s.forward[-1], prefetch=s.backward[0]))
    with pytest.raises(OffloadError, match="before its last forward use"):
        plan(dataclasses.replace(good, wait=value))  # read by later forward ops
    with pytest.raises(OffloadError, match="after its first backward reader"):
        plan(dataclasses.replace(good, prefetch=s.backward[-1]))
    with pytest.raises(OffloadError, match="offloaded twice"):
        plan(good, good)
    with pytest.raises(OffloadError, match="no copy link"):
        plan(good, on=dataclasses.replace(problem, link=None))
    with pytest.raises(ValueError, match="positive"):
        Link(d2h=0.0, h2d=1.0)


def test_copies_wait_and_start_only_at_the_ops_the_executor_runs() -> None:
    """A step whose forward ends and backward begins with ops the executor does not run (a
    loss the loop computes): the wait that hides the copy would be such an op, so it moves to
    the latest op it runs; the prefetch to the earliest op after the natural one; a value
    with no such point raises."""
    forward, backward = ["v", "f1", "loss1", "loss2"], ["dloss1", "dloss2", "b1", "r"]
    args = (
        {n: 1.0 for n in forward + backward},  # one second each
        ["v"],
        {"v": 250},  # a copy takes 2.5 s each way
        {"v": "v"},
        {"v": "r"},
        Link(d2h=100.0, h2d=100.0),
    )
    (free,) = offload.place(forward, backward, *args)
    assert (free.wait, free.prefetch) == ("loss2", "dloss1")
    runs = {"v", "f1", "b1", "r"}
    (bound,) = offload.place(forward, backward, *args, copy_ops=runs)
    assert (bound.wait, bound.prefetch) == ("f1", "b1")
    with pytest.raises(OffloadError, match="no op the executor runs"):
        offload.place(forward, backward, *args, copy_ops={"b1", "r"})


def test_one_rule_says_which_values_free_their_storage_when_offloaded() -> None:
    """A value the caller also holds (a user output that is saved too) frees nothing."""
    owners = {
        "a": (("s1",), ("s1",)),
        "view": (("s1",), ()),
        "b": (("s2",), ("s2",)),
        "empty": ((), ()),
    }
    assert offload.unfit("b", ("a", "b"), owners) is None
    assert "view of another value" in str(offload.unfit("view", ("view",), owners))
    assert "holds no storage" in str(offload.unfit("empty", ("empty",), owners))
    assert "shares its storage with ['view']" in str(offload.unfit("a", ("a", "view"), owners))
    assert "shares its storage with ['b']" in str(offload.unfit("b", ("b", "b"), owners))
