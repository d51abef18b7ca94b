"""``remat.apply`` on the native zoo: SAC policies on the models' own blocks.

Every model at three budgets between its least peak and no checkpointing: bitwise equal to
the unmodified model over 3 AdamW steps (dropout on, BatchNorm buffers included), the
predicted tensor peak equal to the live meter's to the byte and the predicted allocator peak
to the allocator's (within max(1%, 64 KiB): :func:`tests.checks.assert_trains_like_eager`),
the measured allocator peak within the budget, and the recompute cost non-increasing as the
budget grows.
"""

from __future__ import annotations

import copy

import pytest
import torch

import remat
from remat.measure.meter import measure_step
from tests.checks import assert_trains_like_eager
from tests.zoo import NATIVE_ZOO, Case


def _least_peak(case: Case) -> int:
    with pytest.raises(remat.BudgetError) as info:
        remat.apply(
            case.build(), case.inputs(), example_kwargs=case.kwargs, activation_budget_bytes=1
        )
    return info.value.least_peak_bytes


@pytest.mark.parametrize("case", NATIVE_ZOO, ids=lambda c: c.name)
def test_three_budgets_bitwise_predicted_and_monotone(case: Case) -> None:
    torch.manual_seed(0)
    model = case.build()
    args = case.inputs()
    least = _least_peak(case)
    eager = measure_step(copy.deepcopy(model), args, case.kwargs, allocator=True)
    eager_peak = eager.allocator_peak_bytes
    assert eager_peak is not None
    assert least < eager_peak
    costs = []
    for budget in (least, (least + eager_peak) // 2, eager_peak):
        result = assert_trains_like_eager(
            model, args, case.kwargs, executor="sac", activation_budget_bytes=budget
        )
        plan = result.plan
        for step in result.steps:
            assert step.predicted_tensor_peak_bytes == step.measured_tensor_peak_bytes, (
                case.name,
                step,
            )
            assert step.measured_peak_bytes <= budget  # at the allocator
        assert plan.predicted_peak_bytes <= budget
        costs.append(plan.added_time_s)
    assert costs == sorted(costs, reverse=True), costs
    assert costs[-1] == 0.0  # at the eager peak nothing needs recomputing
