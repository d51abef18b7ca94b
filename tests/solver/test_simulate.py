"""The simulator on hand-built graphs, with peaks worked out by hand (1 unit = 1 MiB)."""

from __future__ import annotations

import pytest

from remat.problem import Role
from remat.solver import InvalidPlanError, Proof, build_schedule, make_plan, simulate
from tests.solver.builders import MiB, chain, external, op, problem


def test_keep_all_on_the_chain() -> None:
    # forward: a(1) b(2) out(3); tangent: 4; gb: 5, frees b -> 4; ga: 5, frees gb, a -> 3; gw: 4
    p = make_plan(chain(), {"a", "b"}, solver="test", reason="", proof=Proof.HEURISTIC)
    assert p.schedule.forward == ("a", "b", "out")
    assert p.schedule.backward == ("gb", "ga", "gw")
    assert p.schedule.recomputed == ()
    assert p.predicted_peak_bytes == 5 * MiB
    assert p.simulation.peak_step == "backward:gb"
    assert p.saved_bytes == 2 * MiB
    assert [s.allocated_bytes // MiB for s in p.simulation.timeline] == [1, 2, 3, 3, 4, 5, 5, 4]
    assert p.simulation.timeline[-1].live_bytes == 3 * MiB  # out, t, gw


def test_keep_nothing_recomputes_once_in_graph_order() -> None:
    # forward: a(1) b(2, a freed) out(2, b freed) -> out=1; tangent 2;
    # recompute a(3) b(4); gb(5), frees b -> 4; ga(5) frees gb, a -> 3; gw(4)
    p = make_plan(chain(), set(), solver="test", reason="", proof=Proof.HEURISTIC)
    assert p.schedule.saved == ()
    assert p.schedule.backward == ("a", "b", "gb", "ga", "gw")
    assert p.schedule.recomputed == ("a", "b")
    assert p.recompute_flops == 30
    assert p.predicted_peak_bytes == 5 * MiB
    assert [s.allocated_bytes // MiB for s in p.simulation.timeline] == [
        1,
        2,
        2,
        1,
        2,
        3,
        4,
        5,
        5,
        4,
    ]
    assert p.saved_bytes == 0


def test_saving_a_view_keeps_its_base_storage() -> None:
    # v is a view of a: saving v holds a's 1 MiB; reading v in the backward needs no recompute.
    prob = problem(
        [
            external("w"),
            op("a", Role.FORWARD, ("w",)),
            op("v", Role.FORWARD, ("a",), view_of="a"),
            op("out", Role.FORWARD, ("v",)),
            op("t", Role.TANGENT),
            op("g", Role.BACKWARD, ("t", "v")),
        ],
        user_outputs=("out",),
        grads=("g",),
    )
    p = make_plan(prob, {"v"}, solver="test", reason="", proof=Proof.HEURISTIC)
    assert p.saved_bytes == MiB
    # forward a(1) v(1) out(2); tangent 3; g 4 (v freed -> a's storage freed) -> 3
    assert p.predicted_peak_bytes == 4 * MiB
    assert p.simulation.timeline[-1].live_bytes == 3 * MiB


def test_user_output_also_saved_is_not_freed_by_the_backward() -> None:
    prob = problem(
        [
            external("w"),
            op("out", Role.FORWARD, ("w",)),
            op("t", Role.TANGENT),
            op("g", Role.BACKWARD, ("t", "out")),
        ],
        user_outputs=("out",),
        grads=("g",),
    )
    p = make_plan(prob, {"out"}, solver="test", reason="", proof=Proof.HEURISTIC)
    # out(1); tangent 2; g 3; out stays held by the caller after its last backward use.
    assert p.predicted_peak_bytes == 3 * MiB
    assert p.simulation.timeline[-1].live_bytes == 3 * MiB


def test_tuple_outputs_live_while_any_part_is_held() -> None:
    # ln allocates two storages (y, stats); saving only `stats` keeps just that storage after
    # the tuple variable dies.
    ln, sizes = op("ln", Role.FORWARD, ("w",), alloc=2)
    y = ln.__class__("y", Role.FORWARD, "getitem", ("ln",), storages=("ln#0",))
    stats = ln.__class__("stats", Role.FORWARD, "getitem", ("ln",), storages=("ln#1",))
    prob = problem(
        [
            external("w"),
            (ln, sizes),
            (y, {}),
            (stats, {}),
            op("out", Role.FORWARD, ("y",)),
            op("t", Role.TANGENT),
            op("g", Role.BACKWARD, ("t", "stats")),
        ],
        user_outputs=("out",),
        grads=("g",),
    )
    p = make_plan(prob, {"stats"}, solver="test", reason="", proof=Proof.HEURISTIC)
    # ln(2) y(2) stats(2, tuple freed: both parts still held) out(3, y freed -> 2)
    # tangent 3; g 4, stats freed -> 3
    assert [s.allocated_bytes // MiB for s in p.simulation.timeline] == [2, 2, 2, 3, 2, 3, 4]
    assert p.saved_bytes == MiB


def test_random_values_are_never_recomputed() -> None:
    prob = problem(
        [
            external("w"),
            op("mask", Role.FORWARD, ("w",), random=True),
            op("out", Role.FORWARD, ("mask",)),
            op("t", Role.TANGENT),
            op("g", Role.BACKWARD, ("t", "mask")),
        ],
        user_outputs=("out",),
        grads=("g",),
    )
    with pytest.raises(InvalidPlanError, match="random"):
        build_schedule(prob, set())
    assert build_schedule(prob, {"mask"}).recomputed == ()


def test_only_forward_values_can_be_saved() -> None:
    with pytest.raises(InvalidPlanError, match="not forward"):
        build_schedule(chain(), {"gb"})
    with pytest.raises(InvalidPlanError):
        build_schedule(chain(), {"nope"})


def test_buffer_updates_are_freed_after_the_forward() -> None:
    prob = problem(
        [
            external("w"),
            external("running", Role.BUFFER),
            op("out", Role.FORWARD, ("w",)),
            op("new_running", Role.FORWARD, ("running",)),
            op("t", Role.TANGENT),
            op("g", Role.BACKWARD, ("t",)),
        ],
        user_outputs=("out",),
        grads=("g",),
        mutations=("new_running",),
    )
    sim = simulate(prob, build_schedule(prob, set()))
    after_forward = next(s for s in sim.timeline if s.name == "buffer updates")
    assert after_forward.live_bytes == MiB
    assert sim.peak_bytes == 3 * MiB
