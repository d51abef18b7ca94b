"""A plan that saves a view and would recompute the view's base while the view is still to be
used: the recomputation would allocate a second copy of the storage. The schedule saves the
base instead, and the measured peak equals the prediction."""

from __future__ import annotations

import torch
from torch import nn

import remat
from remat.solver import Proof, make_plan
from remat.solver.schedule import build_schedule
from remat.solver.simulate import simulate
from tests.checks import assert_trains_like_eager


class ViewThenBase(nn.Module):
    """``a = x @ w`` (1 MiB, no gradient flows back to it); a row of ``a``'s transpose times
    a parameter, whose backward runs second; ``a @ v``, whose backward runs first."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w", torch.randn(64, 64) / 8)
        self.p = nn.Parameter(torch.randn(4096))
        self.v = nn.Parameter(torch.randn(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x @ self.w
        u = (a.t()[0] * self.p).sum()
        return u + (a @ self.v).sum()


def test_a_saved_view_keeps_its_base_from_being_recomputed() -> None:
    torch.manual_seed(0)
    model = ViewThenBase()
    x = torch.randn(4096, 64)
    problem = remat.analyze(model, (x,)).problem
    mms = [v for v in problem.values if v.role.value == "forward" and v.op == "aten.mm.default"]
    base = mms[0]
    view = next(v for v in problem.backward_reads if v.startswith("select"))
    assert problem.by_name[view].storages == base.allocates  # the row holds all of ``a``
    # Saving only the row would make the backward recompute the product for ``a @ v``'s
    # backward while the row is still held for the backward of the product with ``p``: two
    # copies of ``a`` at the peak (predicted 1 MiB short of the measured peak).
    schedule = build_schedule(problem, {view})
    assert base.name in schedule.saved and base.name not in schedule.recomputed
    plan = make_plan(
        problem, {view}, solver="test", reason="saves a view only", proof=Proof.HEURISTIC
    )
    assert simulate(problem, plan.schedule).peak_bytes == plan.predicted_peak_bytes
    assert_trains_like_eager(model, (x,), {}, plan=plan)
