"""One request record behind both front doors: validation, the flat sugar, both ends."""

from __future__ import annotations

import pytest
import torch

import remat
from remat.budget import Options
from remat.models import TinyGPT
from remat.request import Request


def test_flat_arguments_spell_the_same_request() -> None:
    req = Request.of(budget_gb=2, optimizer="sgd", zero_stage=1, world_size=4, time_limit_s=5)
    assert req == Request(
        budget_bytes=2_000_000_000,
        training=Options(optimizer="sgd", zero_stage=1, world_size=4),
        time_limit_s=5,
    )
    assert req.solver_config().time_limit_s == 5
    assert Request.of(block_types=["Block"]).block_types == ("Block",)  # type: ignore[typeddict-item]


@pytest.mark.parametrize(
    ("flat", "message"),
    [
        ({"budget_gb": 1, "budget_bytes": 10**9}, "budget_gb or budget_bytes, not both"),
        ({"budget_bytes": 10**9, "activation_budget_bytes": 10}, "or activation_budget_bytes"),
        ({"budget_bytes": 0}, "budget_bytes must be a positive number of bytes"),
        ({"budget_gb": -1.0}, "the device budget must be positive"),
        ({"plan": "keep_all", "solver": "exact"}, "either plan= or solver="),
        ({"reserve_fraction": 1.0}, r"reserve_fraction must be in \[0, 1\)"),
        ({"time_limit_s": 0.0}, "time_limit_s must be positive"),
        ({"floor_time_s": -1.0}, "floor_time_s must be 0 or more"),
        ({"max_seq": 0}, "max_seq must be a positive integer"),
        ({"optimizer": "lion"}, "unknown optimizer 'lion'; valid: adamw, adam, sgd, none"),
        ({"zero_stage": 4}, "zero_stage must be one of"),
    ],
)
def test_bad_requests_say_what_is_wrong(flat: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Request.of(**flat)  # type: ignore[arg-type]


def test_unknown_argument_lists_the_valid_ones() -> None:
    with pytest.raises(TypeError, match=r"unknown argument\(s\) budget_mb; valid: .*budget_gb"):
        Request.of(budget_mb=3)  # type: ignore[call-arg]


def test_both_front_doors_take_a_request_or_its_flat_fields() -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 32))
    req = Request(activation_budget_bytes=10**9, solver="chen_greedy", device_profile="a100")
    flat = remat.optimize(
        TinyGPT(vocab=64, dim=32, heads=2, layers=2, seq=32),
        tokens,
        activation_budget_bytes=10**9,
        solver="chen_greedy",
        device_profile="a100",
    )
    torch.manual_seed(0)
    one = remat.optimize(TinyGPT(vocab=64, dim=32, heads=2, layers=2, seq=32), tokens, request=req)
    assert one.plan.saved == flat.plan.saved and one.plan.solver == flat.plan.solver
    with pytest.raises(TypeError, match="pass request= or flat keyword arguments, not both"):
        remat.optimize(TinyGPT(vocab=64, dim=32, heads=2, layers=2, seq=32), tokens, request=req,
                       solver="exact")  # fmt: skip
    model = remat.apply(
        TinyGPT(vocab=64, dim=32, heads=2, layers=2, seq=32),
        tokens,
        request=Request(plan="keep_matmuls", device_profile="a100"),
    )
    assert remat.plan_of(model).solver == "native:keep_matmuls"
    with pytest.raises(ValueError, match="seq_buckets is for remat.optimize"):
        remat.apply(TinyGPT(vocab=64, dim=32, heads=2, layers=2, seq=32), tokens, max_seq=64,
                    seq_buckets=(32, 64))  # fmt: skip


def test_the_literal_names_are_those_accepted() -> None:
    """``SolverName`` and ``Precision`` (what a type checker offers a user) list exactly the
    names the registry and the budget take."""
    from typing import get_args

    from remat.budget import OPTIMIZER_STATES, PRECISIONS, OptimizerName, Precision
    from remat.solver.config import SolverName
    from remat.solver.registry import SOLVERS

    assert set(get_args(SolverName)) == {*SOLVERS, "auto"}
    assert set(get_args(Precision)) == set(PRECISIONS)
    assert set(get_args(OptimizerName)) == set(OPTIMIZER_STATES)
