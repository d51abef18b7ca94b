"""Autocast's cast cache: off inside remat's checkpointed regions, and under FSDP2 a budget
error says what needs less.

``torch.autocast`` keeps the 16-bit cast of each weight it casts until the forward ends
(under FSDP2, copies of the gathered weights: 13.5 GB on Llama 2 7B). remat's regions run
with the cache off, bitwise the same; outside them the cache stays, and under ``bf16-mixed``
with ZeRO-3 the error is where a user learns that FSDP2's own mixed precision needs less.
"""

from __future__ import annotations

import copy
import functools

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
    for fix in ("cast cache", "checkpointed regions", "precision='bf16-fsdp'"):
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


def test_regions_drop_their_cast_weights_where_plain_checkpoint_keeps_them() -> None:
    """Every block recomputed under CPU bf16 autocast: at the forward's end, inside the
    autocast region, plain ``checkpoint`` (the cache on) holds each block's 16-bit weights,
    remat's regions none of them; remat's step is bitwise the unmodified model's and its
    peaks the predicted ones."""
    from torch.utils.checkpoint import checkpoint

    from remat.measure.meter import LiveMemoryMeter
    from tests.checks import assert_trains_like_eager

    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=256, heads=4, layers=6, seq=16, dropout=0.1)
    tokens = torch.randint(0, 64, (2, 16))
    result = assert_trains_like_eager(model, (tokens,), {}, executor="sac", precision="bf16-mixed",
                                      plan="block")  # fmt: skip
    plain = copy.deepcopy(model)
    for block in plain.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)

    def held_at_forward_end(m: torch.nn.Module) -> int:
        with LiveMemoryMeter() as meter, torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(tokens)
            held = meter.live_bytes
        del out
        return held

    linears = [m for m in model.blocks[0].modules() if isinstance(m, torch.nn.Linear)]
    weights = 2 * sum(p.numel() for m in linears for p in m.parameters())  # bf16 casts
    cached, ours = held_at_forward_end(plain), held_at_forward_end(result.module)
    assert cached - ours == 6 * weights
