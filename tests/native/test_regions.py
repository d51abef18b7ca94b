"""Regions finer than the blocks: ``auto`` also plans on each block's sub-modules, which reach
below every plan on whole blocks; their plans re-apply from a plan file."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import remat
from remat.native.regions import find_blocks, split_blocks
from remat.native.state import applied
from tests.zoo import NATIVE_ZOO, Case

CASES = {c.name: c for c in NATIVE_ZOO}


def test_split_blocks_are_the_blocks_children_with_parameters() -> None:
    model = CASES["hf_llama_gqa"].build()
    blocks = find_blocks(model)
    split = split_blocks(model, blocks)
    assert split[:4] == tuple(
        f"model.layers.0.{n}"
        for n in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    )
    assert len(split) == 4 * len(blocks)


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_mixtral_moe"])
def test_sub_module_regions_fit_below_every_whole_block_plan(name: str, tmp_path: Path) -> None:
    case: Case = CASES[name]
    torch.manual_seed(0)
    model, args = case.build().train(), case.inputs()
    whole = remat.plan_of(remat.apply(copy.deepcopy(model), args, plan="block"))
    budget = int(0.97 * whole.predicted_peak_bytes)  # below every block's being recomputed
    with pytest.raises(remat.BudgetError):
        remat.apply(copy.deepcopy(model), args, activation_budget_bytes=budget, solver="exact")
    fitted = remat.apply(copy.deepcopy(model), args, activation_budget_bytes=budget)
    plan = remat.plan_of(fitted)
    state = applied(fitted)
    assert plan.predicted_peak_bytes <= budget
    assert plan.reason.startswith("regions: the blocks' ")
    # Regions in the order the forward runs them (llama's norms before attention and MLP).
    assert sorted(state.blocks) == sorted(split_blocks(model, find_blocks(model)))

    path = remat.save_plan(fitted, tmp_path / "plan.json")
    again = remat.apply(copy.deepcopy(model), args, plan=path)
    assert applied(again).blocks == state.blocks
    assert applied(again).policies == state.policies
    assert remat.plan_of(again).predicted_peak_bytes == plan.predicted_peak_bytes
