"""End to end on the zoo: every model x every fixed plan, bitwise and predicted == measured."""

from __future__ import annotations

import pytest
import torch

from remat.solver.fixed import FIXED_PLANS
from tests.checks import assert_trains_like_eager
from tests.zoo import ZOO, Case


@pytest.mark.parametrize("plan", sorted(FIXED_PLANS))
@pytest.mark.parametrize("case", ZOO, ids=lambda c: c.name)
def test_plan_trains_bitwise_and_peak_is_predicted(case: Case, plan: str) -> None:
    torch.manual_seed(0)
    result = assert_trains_like_eager(case.build(), case.inputs(), case.kwargs, plan=plan)
    assert result.module.plan.solver == plan
