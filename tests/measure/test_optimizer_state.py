"""An optimizer given as a class or factory: the state the budget counts is the state a real
step makes, measured on FakeTensors, for any model size."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import remat
from remat.budget import Options
from remat.measure.optimizer_state import optimizer_state_bytes
from remat.models import TinyGPT
from remat.request import model_static_memory


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=64, dim=32, layers=2, seq=16)


def _real_state_bytes(model: torch.nn.Module, factory: object) -> int:
    """The optimizer's state after one real step on a copy of ``model``."""
    work = copy.deepcopy(model)
    params = [p for p in work.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = factory(params)  # type: ignore[operator]
    opt.step()
    seen = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for state in opt.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    }
    return sum(seen.values())


ADAFACTOR = torch.optim.Adafactor


@pytest.mark.parametrize(
    "factory",
    [
        torch.optim.AdamW,
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        ADAFACTOR,  # its step reads a tensor's value: measured up to there
        torch.optim.Adagrad,
    ],
    ids=["AdamW", "SGD-momentum", "Adafactor", "Adagrad"],
)
def test_measured_on_fake_tensors_is_what_a_real_step_keeps(factory: object) -> None:
    model = _model()
    params = [p for p in model.parameters() if p.requires_grad]
    measured = optimizer_state_bytes(params, factory)  # type: ignore[arg-type]
    assert measured == _real_state_bytes(model, factory) > 0
    assert all(p.grad is None for p in params)  # the model is not touched


def test_the_budget_counts_the_measured_state_sharded_as_named_ones_are() -> None:
    model = _model()
    trainable = sum(p.numel() for p in model.parameters())
    tensors = sum(1 for _ in model.parameters())
    adamw = model_static_memory(model, Options(optimizer=torch.optim.AdamW))
    # Two fp32 moments per parameter, as "adamw" counts, and a 4-byte step count per tensor.
    assert adamw.optimizer_state == 8 * trainable + 4 * tensors
    assert model_static_memory(model, Options()).optimizer_state == 8 * trainable
    sharded = model_static_memory(
        model, Options(optimizer=torch.optim.AdamW, zero_stage=1, world_size=4)
    )
    assert sharded.optimizer_state == math.ceil(adamw.optimizer_state / 4)
    assert sharded.unsharded == adamw.unsharded
    # Adafactor factors its second moment: far less than Adam's two full moments.
    factored = model_static_memory(model, Options(optimizer=ADAFACTOR)).optimizer_state
    assert factored == _real_state_bytes(model, ADAFACTOR) < adamw.optimizer_state // 2
    with remat.fake_mode():
        big = TinyGPT(vocab=50_000, dim=2048, layers=4, seq=1024)  # no memory
    assert model_static_memory(big, Options(optimizer=ADAFACTOR)).optimizer_state > 0


def test_a_device_budget_with_the_user_s_optimizer() -> None:
    model = _model()
    tokens = torch.randint(0, 64, (2, 16))
    factory = lambda params: ADAFACTOR(params, lr=1e-2)  # noqa: E731
    fast = remat.optimize(model, tokens, budget_bytes=2_000_000, optimizer=factory)
    memory = fast.plan.device_memory
    assert memory is not None
    assert memory["optimizer_state"] == _real_state_bytes(model, factory)
    adamw = remat.optimize(model, tokens, budget_bytes=2_000_000).plan.device_memory
    assert adamw is not None and memory["optimizer_state"] < adamw["optimizer_state"]


def test_bad_optimizers_say_why() -> None:
    model = _model()
    with pytest.raises(TypeError, match="a name, or a torch.optim.Optimizer class"):
        Options(optimizer=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown optimizer 'lion'.*or a torch.optim"):
        Options(optimizer="lion")
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        model_static_memory(model, Options(optimizer=lambda params: list(params)))

    class NeedsLr(torch.optim.SGD):
        def __init__(self, params: object, lr: float) -> None:
            super().__init__(params, lr=lr)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match=r"lambda params: .*NeedsLr\(params, lr=...\)"):
        model_static_memory(model, Options(optimizer=NeedsLr))
    with pytest.raises(ValueError, match="one step on FakeTensor copies.*closure"):
        model_static_memory(model, Options(optimizer=torch.optim.LBFGS))
