"""Regions other than the blocks: ``auto`` also plans on each block's sub-modules, and every
solver on the modules outside the blocks where recomputing them holds less; both reach below
every plan on the blocks alone, and their plans re-apply from a plan file."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import remat
from remat.executors.sac.hf import kv_cache_off
from remat.executors.sac.passes import analyze
from remat.executors.sac.planner import NATIVE_PLANS, fixed_policies, uniform_plans
from remat.executors.sac.regions import find_blocks, outside_blocks, split_blocks
from remat.executors.sac.state import applied
from remat.measure.profiles import get_profile
from remat.request import Request
from tests.checks import assert_trains_like_eager
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
    # Regions in the order the forward runs them (llama's norms before attention and MLP),
    # with those of the modules outside the blocks that gain from a recomputation.
    blocks = find_blocks(model)
    assert set(split_blocks(model, blocks)) <= set(state.blocks)
    assert set(state.blocks) - set(split_blocks(model, blocks)) <= set(
        outside_blocks(model, blocks)
    )

    path = remat.save_plan(fitted, tmp_path / "plan.json")
    again = remat.apply(copy.deepcopy(model), args, plan=path)
    assert applied(again).blocks == state.blocks
    assert applied(again).policies == state.policies
    assert remat.plan_of(again).predicted_peak_bytes == plan.predicted_peak_bytes


def test_outside_blocks_are_the_outermost_modules_with_parameters_around_the_blocks() -> None:
    model = CASES["hf_llama_gqa"].build()
    assert outside_blocks(model, find_blocks(model)) == (
        "model.embed_tokens",
        "model.norm",
        "lm_head",
    )  # not model.rotary_emb: no parameters
    resnet = CASES["resnet_bn"].build()
    assert outside_blocks(resnet, find_blocks(resnet)) == ("stem", "head")


def _least_on_the_blocks(case: Case, model: torch.nn.Module, args: tuple) -> int:
    """The least traced peak of every plan on the blocks alone (the fixed plans and the chain
    DP's menu applied to every block), as ``experiments/least_peaks.py`` finds it."""
    blocks = find_blocks(model)
    with kv_cache_off(model):
        traced, problem = analyze(
            model, blocks, args, case.kwargs, Request.of(), get_profile("cpu")
        )
        plans = [fixed_policies(problem, n) for n in NATIVE_PLANS]
        plans += list(uniform_plans(problem).values())
        return min(traced.trace(args, case.kwargs, p).peak_bytes for p in plans)


@pytest.mark.parametrize("name", ["hf_bert", "resnet_bn"])
def test_outside_regions_fit_below_every_plan_on_the_blocks(name: str, tmp_path: Path) -> None:
    """BERT's embeddings (sum, LayerNorm, dropout) and a CNN's full-resolution stem save
    much for their backward: recomputed, they let a plan reach below the least peak on the
    blocks alone; bitwise over 3 AdamW steps, predicted == measured, and re-applied from
    its plan file."""
    case: Case = CASES[name]
    torch.manual_seed(0)
    model, args = case.build().train(), case.inputs()
    budget = int(0.97 * _least_on_the_blocks(case, model, args))
    result = assert_trains_like_eager(
        model, args, case.kwargs, executor="sac", activation_budget_bytes=budget
    )
    assert result.plan.predicted_peak_bytes <= budget
    assert all(s.measured_peak_bytes <= budget for s in result.steps)

    fitted = result.module  # the model planned and wrapped in place, as remat.apply does
    state = applied(fitted)
    outside = set(outside_blocks(model, find_blocks(model)))
    recomputed = {p for p, pol in zip(state.blocks, state.policies, strict=True) if pol is not None}
    assert recomputed & outside, (state.blocks, state.policies)
    path = remat.save_plan(fitted, tmp_path / "plan.json")
    again = remat.apply(copy.deepcopy(model), args, example_kwargs=case.kwargs, plan=path)
    assert applied(again).blocks == state.blocks
    assert applied(again).policies == state.policies


def test_regions_out_of_call_order_are_renumbered_as_a_trace_in_that_order_gives() -> None:
    """Llama's sub-modules are declared attention, MLP, norms, and run norm, attention, norm,
    MLP: the analysis renumbers its eager trace in call order rather than tracing again, and
    gets what a trace of the reordered copy gives."""
    from remat.executors.sac.trace import FakeModel

    model = CASES["hf_llama_gqa"].build().train()
    args = CASES["hf_llama_gqa"].inputs()
    split = split_blocks(model, find_blocks(model))
    profile = get_profile("cpu")
    fake = FakeModel(model, split)
    first = fake.trace(args, {}, [None] * len(split), profile=profile)
    order = fake.in_call_order(first)
    assert order != tuple(range(len(split)))
    assert fake.blocks[:4] == tuple(
        f"model.layers.0.{n}"
        for n in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    )
    again = fake.trace(args, {}, [None] * len(split), profile=profile)
    assert first.renumbered(order) == again


def test_a_finer_pass_reuses_the_blocks_copy_and_traces_what_a_fresh_copy_traces() -> None:
    """The sub-modules' pass takes the blocks' FakeTensor copy, sharded by FSDP2 over the
    blocks and warmed up, with the sub-modules as its regions: its steps are a fresh copy's
    with those regions, eager and under a policy."""
    from remat.executors.sac.trace import FakeModel

    model = CASES["hf_llama_gqa"].build().train()
    args = CASES["hf_llama_gqa"].inputs()
    blocks = find_blocks(model)
    split = split_blocks(model, blocks)
    profile = get_profile("cpu")
    with kv_cache_off(model):
        first = FakeModel(model, blocks, fsdp_world=2, fsdp_units=blocks)
        fresh = FakeModel(model, split, fsdp_world=2, fsdp_units=blocks)
        first.trace(args, {}, [None] * len(blocks), profile=profile)
        reused = first.with_regions(split)
        assert reused.module is first.module and reused.blocks == split and first.blocks == blocks
        for fake in (reused, fresh):
            fake.in_call_order(fake.trace(args, {}, [None] * len(split), profile=profile))
        assert reused.blocks == fresh.blocks
        for policies in ([None] * len(split), [frozenset()] * len(split)):
            assert reused.trace(args, {}, policies, profile=profile) == fresh.trace(
                args, {}, policies, profile=profile
            )
