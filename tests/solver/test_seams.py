"""Seams (:mod:`remat.solver.seams`): recomputation across the chain's block boundaries and
outside the blocks, where it costs less per byte than what a block trades."""

from __future__ import annotations

import dataclasses

import torch

import remat
from remat.models import TinyGPT
from remat.problem import Problem, Role
from remat.solver.chain import chain_menu
from remat.solver.config import SolverConfig
from remat.solver.menus import Option, block_problems
from remat.solver.plan import Proof, make_plan
from remat.solver.seams import (
    apply_seams,
    boundaries,
    find_swap,
    outside_candidates,
    patterns,
)
from remat.solver.structure import find_structure
from tests.checks import assert_trains_like_eager
from tests.solver.builders import MiB, external, op, problem

CONFIG = SolverConfig(time_limit_s=6)


def _gpt(layers: int) -> tuple[torch.nn.Module, torch.Tensor, Problem]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, heads=2, layers=layers, seq=32)
    x = torch.randint(0, 64, (2, 32))
    return model, x, remat.analyze(model, (x,)).problem


def _block(mm_alloc: int) -> Problem:
    """A block's tail as the chain cuts it out: ``out = h + small``, where ``h`` is cheap
    and recomputed for the block's own backward anyway, ``small`` a 10 s op of ``mm_alloc``
    MiB, and ``out`` (2 MiB) what the next block reads."""
    return problem(
        [
            external("x", Role.INPUT),
            external("w"),
            external("g", Role.TANGENT),
            op("h", Role.FORWARD, ("x",), alloc=2, flops=1),
            op("small", Role.FORWARD, ("h", "w"), alloc=mm_alloc, flops=10),
            op("out", Role.FORWARD, ("h", "small"), alloc=2, flops=1),
            op("dw", Role.BACKWARD, ("g", "h")),
        ],
        user_outputs=("out",),
        grads=("dw",),
    )


def test_a_swap_saves_the_dear_addend_in_place_of_a_larger_output() -> None:
    # Dropped alone, ``out`` is recomputed with ``small`` (11 s) for 2 MiB; saving ``small``
    # (1 MiB) instead leaves one add (1 s) and still frees 1 MiB.
    swap = find_swap(_block(mm_alloc=1), "out", ())
    assert swap is not None
    assert swap.saved == {"small"} and swap.time_s == 1.0 and swap.freed == MiB
    # An addend as large as the output frees nothing: the output is dropped without one.
    swap = find_swap(_block(mm_alloc=2), "out", ())
    assert swap is not None
    assert swap.saved == frozenset() and swap.time_s == 11.0 and swap.freed == 2 * MiB
    # What the option saves already is free to read: ``small`` saved, one add.
    swap = find_swap(_block(mm_alloc=2), "out", ("small",))
    assert swap is not None and swap.saved == frozenset() and swap.time_s == 1.0


def test_outside_candidates_are_recomputations_that_stay_outside_the_blocks() -> None:
    p = problem(
        [
            external("w"),
            external("x", Role.INPUT),
            external("g", Role.TANGENT),
            op("cast", Role.FORWARD, ("w",), alloc=4, flops=1),
            op("inner", Role.FORWARD, ("x",), alloc=1, flops=5),
            op("head", Role.FORWARD, ("inner", "cast"), alloc=1, flops=1),
            op("dhead", Role.BACKWARD, ("g", "cast", "head")),
        ],
        user_outputs=("head",),
        grads=("dhead",),
    )
    found = outside_candidates(p, {"inner"}, {"cast", "head"}, ())
    # ``head`` would be recomputed from ``inner``, inside a block: not a candidate.
    assert found == [(1 / (4 * MiB), "cast")]


def test_boundaries_are_the_residual_stream_between_blocks() -> None:
    _, _, p = _gpt(4)
    structure = find_structure(p)
    out = boundaries(p, structure)
    assert sorted(out) == [0, 1, 2]  # the last block's output feeds the head
    owner = {n: k for k, b in enumerate(structure.blocks) for n in (*b.forward, *b.backward)}
    for k, name in out.items():
        assert p.by_name[name].op == "aten.add.Tensor"
        readers = {owner.get(u) for u in p.users[name]}
        assert k + 1 in readers and readers <= {k, k + 1}
    # PyTorch's checkpoint holds a region's inputs: no seams for that executor.
    assert boundaries(dataclasses.replace(p, executor="sac"), structure) == {}
    assert patterns([]) == []
    assert frozenset({0, 2}) in patterns([0, 1, 2])  # every second kept, from the first
    assert frozenset({0, 1}) in patterns([0, 1, 2])  # every third kept, from the last


def test_a_plan_with_seams_trains_bitwise_at_its_predicted_peak() -> None:
    """Blocks 1 and 2 recompute their inputs from block 0's output, across two boundaries;
    the executor runs that, bitwise (dropout on), at the simulated peaks."""
    model, x, p = _gpt(4)
    menu = chain_menu(p, CONFIG)
    outputs = boundaries(p, menu.structure)
    choice = [len(menu.uniform) - 1] * len(menu.options_of)  # the most recompute
    seams = frozenset({0, 1})
    plain = make_plan(p, menu.stitch(choice), solver="chain", reason="", proof=Proof.HEURISTIC)
    seamed = make_plan(
        p, menu.stitch(choice, seams), solver="chain", reason="", proof=Proof.HEURISTIC
    )
    for k in seams:
        assert outputs[k] in plain.saved
        assert outputs[k] not in seamed.saved and outputs[k] in seamed.recomputed
    assert outputs[2] in seamed.saved
    assert seamed.saved_bytes < plain.saved_bytes
    assert seamed.recompute_time_s > plain.recompute_time_s
    assert_trains_like_eager(model, (x,), {}, steps=2, plan=seamed)


def test_apply_seams_leaves_a_block_without_a_swap_as_it_is() -> None:
    saved = frozenset({"a", "out0", "out1"})
    swap = find_swap(_block(mm_alloc=1), "out", ())
    assert swap is not None
    renamed = dataclasses.replace(swap, saved=frozenset({"small0"}))
    got = apply_seams(saved, {0: "out0", 1: "out1"}, {0: renamed, 1: None})
    assert got == {"a", "small0", "out1"}


def test_the_chain_solver_takes_seams_where_they_pay_and_its_plan_trains_bitwise(
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    """A menu of two options, keep-all and keep-inputs (no MILP, so nothing depends on how
    loaded the machine is), refinement windows off (their exact MILP may also cross
    boundaries): at this budget the chain's own seams make the plan cheaper, and it trains
    bitwise at its predicted peaks."""
    import remat.solver.chain as chain
    from remat.solver.fixed import must_save
    from remat.solver.registry import solve

    def two_options(p, structure, cls, config):  # type: ignore[no-untyped-def]
        sub, keep_all, _ = block_problems(p, structure.blocks[cls[0]])
        least = make_plan(sub, must_save(sub), solver="", reason="", proof=Proof.HEURISTIC)
        fwd = sub.forward_names
        return [
            Option(frozenset(n for n in q.schedule.saved if n in fwd), q.recompute_time_s, "")
            for q in (keep_all, least)
        ]

    monkeypatch.setattr(chain, "cached_menu", two_options)
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, heads=2, layers=4, seq=32, dropout=0.0)
    x = torch.randint(0, 64, (2, 32))
    p = remat.analyze(model, (x,)).problem
    config = SolverConfig(time_limit_s=10, max_milp_values=1)
    keep_all = solve(p, solver="keep_all", budget_bytes=None).predicted_peak_bytes
    least = min(u.predicted_peak_bytes for u in chain.chain_menu(p, config).uniform)
    budget = (least + keep_all) // 2
    plan = chain.chain_solver(p, budget_bytes=budget, config=config)
    outputs = boundaries(p, find_structure(p))
    crossed = [n for n in outputs.values() if n in plan.recomputed]
    assert crossed and f"{len(crossed)} block output(s) recomputed across" in plan.reason
    assert plan.predicted_peak_bytes <= budget
    monkeypatch.setattr(chain, "boundaries", lambda *_: {})
    plain = chain.chain_solver(p, budget_bytes=budget, config=config)
    assert "across" not in plain.reason
    assert plan.recompute_time_s < plain.recompute_time_s
    assert_trains_like_eager(model, (x,), {}, steps=2, plan=plan)
