"""Autocast's cast cache under FSDP2: a budget error says so and names what needs less.

``torch.autocast`` keeps the 16-bit cast of each weight FSDP2 gathers until the forward ends,
so under ``bf16-mixed`` with ZeRO-3 the ``sac`` plans' least peak holds every block's 16-bit
weights; the error is where a user learns that FSDP2's own mixed precision, or the cache
off, needs less.
"""

from __future__ import annotations

import copy

import pytest
import torch

import remat
from remat.budget import Options
from remat.models import TinyGPT
from remat.request import model_static_memory


def _gpt() -> tuple[TinyGPT, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, heads=2, layers=2, seq=16, dropout=0.0)
    return model, torch.randint(0, 64, (2, 16))


def test_budget_error_under_autocast_and_fsdp2_names_the_cache() -> None:
    model, tokens = _gpt()
    with pytest.raises(remat.BudgetError) as raised:
        remat.apply(
            model,
            tokens,
            zero_stage=3,
            world_size=2,
            precision="bf16-mixed",
            solver="keep_all",
            activation_budget_bytes=1,
        )
    (hint,) = raised.value.hints
    assert hint in str(raised.value)
    for fix in ("cast cache", "precision='bf16-fsdp'", "cache_enabled=False"):
        assert fix in hint
    assert "forward" not in model.blocks[0].__dict__  # a failed apply leaves the model as it was


@pytest.mark.parametrize(
    ("precision", "zero_stage", "world_size"),
    [("bf16-fsdp", 3, 2), ("bf16-mixed", 0, 1), ("fp32", 3, 2)],
)
def test_no_cache_hint_where_autocast_gathers_nothing(
    precision: str, zero_stage: int, world_size: int
) -> None:
    model, tokens = _gpt()
    with pytest.raises(remat.BudgetError) as raised:
        remat.apply(
            model,
            tokens,
            zero_stage=zero_stage,
            world_size=world_size,
            precision=precision,
            solver="keep_all",
            activation_budget_bytes=1,
        )
    assert raised.value.hints == ()
    assert "cache_enabled" not in str(raised.value)


def test_cache_off_trains_the_same_values() -> None:
    """What the hint promises: with the cache off, a planned model's step is bitwise the
    same (a cast is the same whether cached or made again)."""
    model, tokens = _gpt()
    remat.apply(model, tokens, precision="bf16-mixed", plan="block")

    def step(cache: bool) -> list[torch.Tensor]:
        for p in model.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
            out = model(tokens)
        out.float().pow(2).mean().backward()
        return [out.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    on, off = step(True), step(False)
    assert len(on) == len(off) > 1
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


def test_device_budget_error_keeps_its_type_with_the_hint() -> None:
    model, tokens = _gpt()
    probe = copy.deepcopy(model)
    options = Options(precision="bf16-mixed", zero_stage=3, world_size=2)
    remat.apply(probe, tokens, request=remat.Request(training=options, plan="block"))
    least = remat.plan_of(probe).predicted_peak_bytes
    # The static memory and the reserve fit; half the step's peak is left for it.
    budget = int((model_static_memory(model, options).total + least // 2) / 0.95)
    request = remat.Request(training=options, plan="block", budget_bytes=budget)
    with pytest.raises(remat.DeviceBudgetError) as raised:
        remat.apply(model, tokens, request=request)
    assert raised.value.hints and "cache_enabled=False" in str(raised.value)
    assert "the device needs at least" in str(raised.value)
