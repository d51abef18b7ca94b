"""``remat.apply(..., max_seq=N)``: the policies are planned at the longest length and run
every shorter one, bitwise eager's, under the peak predicted at the longest."""

from __future__ import annotations

import copy
import random

import pytest
import torch

import remat
from remat.measure.meter import measure_step, training_step
from tests.zoo import llama

BATCH, MAX_SEQ = 2, 64


def _tokens(s: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (BATCH, s), generator=torch.Generator().manual_seed(seed))


def test_one_native_plan_for_every_length_up_to_max_seq() -> None:
    torch.manual_seed(0)
    model = llama(2, MAX_SEQ).train()
    eager = copy.deepcopy(model)
    longest = (_tokens(MAX_SEQ, 0),)
    full = remat.plan_of(remat.apply(copy.deepcopy(model), longest, plan="keep_all"))
    budget = int(0.8 * full.predicted_peak_bytes)
    direct = remat.plan_of(
        remat.apply(copy.deepcopy(model), longest, activation_budget_bytes=budget)
    )
    remat.apply(model, (_tokens(16, 1),), activation_budget_bytes=budget, max_seq=MAX_SEQ)
    plan = remat.plan_of(model)
    assert plan.predicted_peak_bytes == direct.predicted_peak_bytes <= budget  # planned at 64
    assert plan.recomputed

    for step, s in enumerate(random.Random(3).sample(range(8, MAX_SEQ + 1), 5) + [MAX_SEQ]):
        x = _tokens(s, 10 + step)
        torch.manual_seed(step)
        expected = training_step(eager, (x,), seed=step)
        torch.manual_seed(step)
        measured = measure_step(model, (x,), seed=step)
        assert all(torch.equal(a, b) for a, b in zip(expected, measured.outputs, strict=True))
        for p, q in zip(eager.parameters(), model.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), s
            p.grad = q.grad = None
        assert measured.peak_bytes <= plan.predicted_tensor_peak_bytes, s
        if s == MAX_SEQ:
            assert measured.peak_bytes == plan.predicted_tensor_peak_bytes


def test_native_max_seq_needs_a_sequence_within_it() -> None:
    with pytest.raises(ValueError, match="past max_seq"):
        remat.apply(llama(2, MAX_SEQ), (_tokens(32, 0),), max_seq=16)
    with pytest.raises(ValueError, match="sequence dimension"):
        remat.apply(torch.nn.Linear(4, 4), (torch.randn(2, 4),), max_seq=16)
