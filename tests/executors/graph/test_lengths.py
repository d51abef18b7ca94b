"""One plan for a range of lengths (``remat.optimize(..., max_seq=N)``): a run of 20 random
lengths is bitwise eager's at every length, over AdamW steps with dropout on, never solves
again, and its measured peak at each length is the plan's formula there."""

from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch

import remat
from remat.executors.graph.analyze import analyze
from remat.measure.meter import measure_step, training_step
from remat.solver.registry import solve
from tests.zoo import llama

BATCH, MAX_SEQ = 2, 64


def _tokens(b: int, s: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(seed))


def _keep_all_peak(model: torch.nn.Module, b: int, s: int) -> int:
    problem = analyze(model, (_tokens(b, s, 0),)).problem
    return solve(problem, solver="keep_all", budget_bytes=None).predicted_peak_bytes


def test_twenty_random_lengths_run_one_plan_bitwise_within_its_formula() -> None:
    torch.manual_seed(0)
    model = llama(2, MAX_SEQ).train()  # attention dropout 0.1
    eager = copy.deepcopy(model)
    budget = int(0.7 * _keep_all_peak(model, BATCH, MAX_SEQ))
    fast = remat.optimize(
        model, (_tokens(BATCH, 32, 1),), activation_budget_bytes=budget, max_seq=MAX_SEQ,
        solver="lp_round",
    )  # fmt: skip
    plans = fast.lengths
    assert plans is not None and plans.solves == 1
    bucket = plans.buckets[0]
    assert (bucket.lo, bucket.hi) == (3, MAX_SEQ)
    assert bucket.plan is not None and bucket.plan.recomputed, "the budget forces recompute"
    assert bucket.worst is not None and bucket.worst[0] <= budget
    formula = bucket.formula
    assert formula is not None

    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_f = torch.optim.AdamW(fast.parameters(), lr=1e-2)
    lengths = [random.Random(7).randint(3, MAX_SEQ) for _ in range(20)]
    for step, s in enumerate(lengths):
        x = _tokens(BATCH, s, 100 + step)
        torch.manual_seed(step)
        expected = training_step(eager, (x,), seed=step)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "planning again"
            torch.manual_seed(step)
            training_step(fast, (x,), seed=step)  # a new length compiles here
        for p in fast.parameters():
            p.grad = None
        torch.manual_seed(step)
        measured = measure_step(fast, (x,), seed=step, allocator=True)
        assert all(torch.equal(a, b) for a, b in zip(expected, measured.outputs, strict=True))
        for (name, p), q in zip(eager.named_parameters(), fast.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), (s, name)
        assert measured.allocator_peak_bytes == formula.step_peak_bytes(BATCH, s), s
        assert measured.peak_bytes == formula.tensor_peak_bytes(BATCH, s), s
        assert measured.allocator_peak_bytes <= budget
        opt_e.step()
        opt_f.step()
        opt_e.zero_grad(set_to_none=True)
        opt_f.zero_grad(set_to_none=True)
    for p, q in zip(eager.parameters(), fast.parameters(), strict=True):
        assert torch.equal(p, q)
    assert plans.solves == 1
    assert sorted(e.length for e in plans.events) == sorted({32, *lengths})


def test_buckets_plan_each_at_its_longest_and_refuse_what_no_plan_fits() -> None:
    torch.manual_seed(0)
    model = llama(2, MAX_SEQ).train()
    example = (_tokens(1, 16, 1),)
    budget = int(0.8 * _keep_all_peak(model, 1, MAX_SEQ))
    fast = remat.optimize(
        model, example, activation_budget_bytes=budget, max_seq=MAX_SEQ, seq_buckets=(24, 48),
        solver="chen_greedy",
    )  # fmt: skip
    plans = fast.lengths
    assert plans is not None
    assert [(b.lo, b.hi) for b in plans.buckets] == [(3, 24), (25, 48), (49, 64)]
    assert plans.solves == 3
    for b in plans.buckets:
        assert b.worst is not None and b.formula is not None and b.plan is not None
        assert b.worst == (b.formula.step_peak_bytes(1, b.hi), b.hi)
        assert b.worst[0] <= budget
    assert "3 plans solved" in plans.summary()

    fast(_tokens(1, 40, 2))  # bucket 25..48, no warning, no solve
    assert [e.bucket for e in plans.events] == [24, 48]
    with pytest.warns(UserWarning, match="planning again"):
        fast(_tokens(2, 8, 3))  # another batch: not covered, planned for alone

    with pytest.raises(remat.BudgetError, match=f"planning for length {MAX_SEQ}"):
        remat.optimize(
            model, example, activation_budget_bytes=1000, max_seq=MAX_SEQ, solver="chen_greedy"
        )


def test_max_seq_needs_a_sequence_and_an_example_within_it() -> None:
    model = llama(2, MAX_SEQ)
    with pytest.raises(ValueError, match="past max_seq"):
        remat.optimize(model, (_tokens(1, 32, 0),), max_seq=16)
    with pytest.raises(ValueError, match="at least 8 tokens"):
        remat.optimize(model, (_tokens(1, 6, 0),), max_seq=16)
    with pytest.raises(ValueError, match="sequence dimension"):
        remat.optimize(torch.nn.Linear(4, 4), (torch.randn(2, 4),), max_seq=16)
