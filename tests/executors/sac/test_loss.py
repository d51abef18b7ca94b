"""``remat.apply`` on the step a training loop runs: the loss outside the model
(``loss_fn=``), blocks in a ModuleDict (torchtitan's layout), and the choice of blocks where
several containers hold them."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.executors.sac.regions import BlockError, block_candidates, find_blocks
from remat.measure.meter import Loss, measure_step
from remat.solver.plan import STEP_WITHOUT_LOSS
from tests.checks import assert_trains_like_eager
from tests.zoo import NATIVE_ZOO, Stack, TitanBlock, TitanLM, titan_loss


def _titan() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = TitanLM(vocab=512, dim=64, heads=4, layers=3)
    tokens = torch.randint(0, 512, (4, 64))
    labels = torch.randint(0, 512, (4, 64))
    return model, tokens, labels


def test_torchtitan_layout_with_its_loss_three_budgets() -> None:
    """Blocks found in the ModuleDict without block_types; at the least peak, halfway and
    the eager peak of the step with the loss: bitwise over 3 AdamW steps, the predicted
    peaks the measured ones, the measured allocator peak within the budget."""
    model, tokens, labels = _titan()
    eager = measure_step(
        copy.deepcopy(model), (tokens,), allocator=True, loss=Loss(titan_loss, labels)
    ).allocator_peak_bytes
    assert eager is not None
    with pytest.raises(remat.BudgetError) as info:
        remat.apply(
            copy.deepcopy(model), tokens, loss_fn=titan_loss, target=labels,
            activation_budget_bytes=1,
        )  # fmt: skip
    least = info.value.least_peak_bytes
    assert least < eager // 2
    # One least peak per error: no chained error naming another.
    assert info.value.__cause__ is None and info.value.__suppress_context__
    for budget in (least, (least + eager) // 2, eager):
        result = assert_trains_like_eager(
            model, (tokens,), {}, executor="sac", loss_fn=titan_loss, target=labels,
            activation_budget_bytes=budget, time_limit_s=10,
        )  # fmt: skip
        applied = remat.executors.sac.state.applied(result.module)
        assert applied.blocks[:3] == ("layers.0", "layers.1", "layers.2")
        assert result.plan.step != STEP_WITHOUT_LOSS and "loss_fn" in result.plan.step
        for step in result.steps:
            assert step.predicted_tensor_peak_bytes == step.measured_tensor_peak_bytes
            assert step.measured_peak_bytes <= budget


def test_without_a_loss_the_plan_says_what_its_peak_covers() -> None:
    model, tokens, _ = _titan()
    remat.apply(model, tokens, plan="block")
    plan = remat.plan_of(model)
    assert plan.step == STEP_WITHOUT_LOSS
    assert "no loss_fn" in plan.summary()
    assert "no loss_fn" in remat.explain(model)


def test_a_loss_that_is_not_a_scalar_is_refused_and_the_model_left_as_it_was() -> None:
    model, tokens, labels = _titan()
    with pytest.raises(ValueError, match="scalar tensor, not a tensor of shape"):
        remat.apply(model, tokens, loss_fn=lambda out, t: out.sum(-1), target=labels)
    with pytest.raises(ValueError, match="does not require grad"):
        remat.apply(model, tokens, loss_fn=lambda out, t: out.detach().sum(), target=labels)
    assert not any(True for _ in remat.executors.sac.regions.iter_regions(model))


def test_target_without_a_loss_and_a_loss_on_a_pipeline_stage_are_refused() -> None:
    model, tokens, labels = _titan()
    with pytest.raises(ValueError, match="pass loss_fn= too"):
        remat.apply(model, tokens, target=labels)
    pipe = remat.Pipeline("1F1B", stage=1, n_stages=2, microbatches=2, loss_fn=titan_loss)
    with pytest.raises(ValueError, match=r"Pipeline\(..., loss_fn=...\)"):
        remat.apply(model, tokens, pipeline=pipe, loss_fn=titan_loss, target=labels)


class _Stage(nn.Module):
    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TitanBlock(dim, 2) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class _Nested(nn.Module):
    """Swin's layout: a list of stages, each a list of layers."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList(_Stage(32, 3) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s in self.stages:
            x = s(x)
        return x


class _EncoderDecoder(nn.Module):
    """Whisper's layout: the encoder's layers and the decoder's, two lists side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = _Stage(32, 2)
        self.decoder = _Stage(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


class _SubBlock(TitanBlock):
    pass


def test_block_candidates_at_each_level_of_every_container() -> None:
    nested = block_candidates(_Nested())
    assert nested == (
        ("stages.0", "stages.1"),
        tuple(f"stages.{s}.blocks.{b}" for s in range(2) for b in range(3)),
    )
    both = block_candidates(_EncoderDecoder())
    assert both == (
        ("encoder.blocks.0", "encoder.blocks.1", *(f"decoder.blocks.{i}" for i in range(3))),
    )
    with pytest.raises(BlockError, match="2 levels of repeated blocks"):
        find_blocks(_Nested())
    # A base class's name names its subclasses.
    model = TitanLM(layers=2)
    model.layers["1"] = _SubBlock(64, 4)
    assert find_blocks(model, ("TitanBlock",)) == ("layers.0", "layers.1")


def test_nested_blocks_are_chosen_by_their_traced_least_peak() -> None:
    torch.manual_seed(0)
    model = _Nested()
    x = torch.randn(2, 64, 32)
    remat.apply(model, x, plan="block")
    state = remat.executors.sac.state.applied(model)
    assert len(state.blocks) == 6  # the layers: recomputed one by one, they hold less
    reason = remat.plan_of(model).reason
    assert "whose every block recomputed traces the least peak" in reason
    assert "2 from stages" in reason


def _next_token_loss(logits: Any, ids: torch.Tensor) -> torch.Tensor:
    """A causal LM's loop loss from the logits it returns (a tensor or a ModelOutput)."""
    logits = logits if isinstance(logits, torch.Tensor) else logits.logits
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


@pytest.mark.parametrize("name", ["tiny_gpt", "hf_llama_gqa"])
def test_zoo_decoders_with_a_loop_loss_and_dropout(name: str) -> None:
    """Dropout on, the loss the loop computes: halfway between every block recomputed and
    no checkpointing, bitwise over 3 AdamW steps, peaks as predicted, within the budget."""
    case = next(c for c in NATIVE_ZOO if c.name == name)
    torch.manual_seed(0)
    model = case.build()
    (ids,) = case.inputs()
    eager = measure_step(
        copy.deepcopy(model), (ids,), allocator=True, loss=Loss(_next_token_loss, ids)
    ).allocator_peak_bytes
    assert eager is not None
    block = remat.apply(
        copy.deepcopy(model), ids, loss_fn=_next_token_loss, target=ids, plan="block"
    )
    budget = (remat.plan_of(block).predicted_peak_bytes + eager) // 2
    result = assert_trains_like_eager(
        model, (ids,), {}, executor="sac", loss_fn=_next_token_loss, target=ids,
        activation_budget_bytes=budget, time_limit_s=10,
    )  # fmt: skip
    assert result.plan.recomputed  # some ops recomputed (pointwise ones count no FLOPs)
    for step in result.steps:
        assert step.measured_peak_bytes <= budget


class _Routed(nn.Module):
    """A layer with a list of experts of which the example's routing calls one."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.experts[0](x).relu()


def test_a_level_of_blocks_the_step_does_not_all_call_is_not_chosen() -> None:
    model = Stack(_Routed, 2)
    remat.apply(model, torch.randn(4, 32), plan="block")
    assert remat.executors.sac.state.applied(model).blocks == ("blocks.0", "blocks.1")
    assert "not all called" in remat.plan_of(model).reason
