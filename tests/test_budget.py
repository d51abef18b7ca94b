"""Whole-device budgets: static memory by hand, sharding, errors, and the planned step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.budget import Options, StaticMemoryError, device_budget, static_memory
from remat.executors.graph.module import RematModule
from remat.models import TinyGPT
from tests.checks import assert_peak_close

P = 1_000_000  # trainable parameters of the hand computations below


def _static(**opts: object) -> remat.budget.StaticMemory:
    return static_memory(4 * P, 0, P, 0, Options(**opts))  # type: ignore[arg-type]


def test_adam_fp32_is_16_bytes_per_parameter() -> None:
    s = _static()
    # parameters 4 + optimizer 8 held across steps; gradients 4 inside the step's peak
    assert (s.parameters, s.optimizer_state, s.gradient_shards) == (4 * P, 8 * P, 0)
    assert s.unsharded == 16 * P


def test_mixed_precision_follows_amp() -> None:
    # autocast keeps fp32 parameters (they are the master weights) and fp32 gradients
    for precision in ("bf16-mixed", "fp16-mixed"):
        assert _static(precision=precision) == _static()


def test_optimizers() -> None:
    assert _static(optimizer="sgd").optimizer_state == 4 * P
    assert _static(optimizer="none").optimizer_state == 0


def test_zero_stages_shard_the_right_parts() -> None:
    n = 8
    assert _static(zero_stage=1, world_size=n).optimizer_state == 8 * P // n
    assert _static(zero_stage=1, world_size=n).parameters == 4 * P
    s2 = _static(zero_stage=2, world_size=n)
    assert (s2.parameters, s2.gradient_shards, s2.optimizer_state) == (4 * P, 4 * P // n, P)
    s3 = _static(zero_stage=3, world_size=n)
    assert (s3.parameters, s3.gradient_shards, s3.optimizer_state) == (P // 2, P // 2, P)
    assert s3.total == 16 * P // n
    assert Options(zero_stage=2, world_size=n).grads_released
    assert not Options(zero_stage=2, world_size=1).grads_released


def test_fsdp_mixed_precision_is_fp32_shards() -> None:
    # FSDP2 MixedPrecisionPolicy(bf16, reduce fp32): fp32 sharded master parameters and fp32
    # sharded gradients held across the step, AdamW's fp32 moments sharded; the bf16 gathered
    # parameters and pre-reduce gradients are inside the traced step
    n = 8
    s = _static(precision="bf16-fsdp", zero_stage=3, world_size=n)
    assert (s.parameters, s.gradient_shards, s.optimizer_state) == (P // 2, P // 2, P)
    assert s.total == 16 * P // n == 2 * P
    assert s == _static(zero_stage=3, world_size=n)


@pytest.mark.parametrize(("zero_stage", "world_size"), [(0, 2), (1, 2), (2, 2), (3, 1), (0, 1)])
def test_fsdp_mixed_precision_needs_zero3_over_ranks(zero_stage: int, world_size: int) -> None:
    match = r"bf16-fsdp.*zero_stage=3 and world_size > 1"
    with pytest.raises(ValueError, match=match):
        Options(precision="bf16-fsdp", zero_stage=zero_stage, world_size=world_size)
    model, tokens = _tiny()
    with pytest.raises(ValueError, match=match):
        remat.apply(
            model,
            tokens,
            activation_budget_bytes=1 << 30,
            precision="bf16-fsdp",
            zero_stage=zero_stage,
            world_size=world_size,
        )


def test_fsdp_mixed_precision_is_refused_by_optimize() -> None:
    model, tokens = _tiny()
    with pytest.raises(ValueError, match=r"bf16-fsdp.*remat\.apply"):
        remat.optimize(
            model,
            tokens,
            activation_budget_bytes=1 << 30,
            precision="bf16-fsdp",
            zero_stage=3,
            world_size=2,
        )


def test_fsdp_mixed_precision_is_refused_by_single_process_verify() -> None:
    from remat.verify import verify

    model, tokens = _tiny()
    with pytest.raises(ValueError, match=r"one process; precision 'bf16-fsdp' needs FSDP2"):
        verify(model, tokens, executor="sac", precision="bf16-fsdp", zero_stage=3, world_size=2)


def _tiny() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return TinyGPT(vocab=32, dim=16, heads=2, layers=2, seq=16), torch.randint(0, 32, (2, 16))


def test_frozen_parameters_cost_their_bytes_only() -> None:
    s = static_memory(4 * P, 4 * P, P, P, Options())
    assert (s.parameters, s.optimizer_state) == (8 * P, 8 * P)


def test_bad_options_list_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="adamw, adam, sgd, none"):
        Options(optimizer="lion")
    with pytest.raises(ValueError, match="fp32, bf16-mixed, fp16-mixed, bf16-fsdp"):
        Options(precision="fp8")
    with pytest.raises(ValueError, match="zero_stage"):
        Options(zero_stage=4)


def test_budget_below_static_memory_explains() -> None:
    s = _static()
    with pytest.raises(StaticMemoryError) as err:
        device_budget(10 * P, s, Options())
    msg = str(err.value)
    assert "optimizer state (adamw) 8.00 MB" in msg and "ZeRO stage 3" in msg
    assert "more than 1 devices" in msg


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return TinyGPT(vocab=64, dim=32, heads=2, layers=2, seq=64), torch.randint(0, 64, (4, 64))


def test_device_budget_plans_the_step_in_what_is_left() -> None:
    model, x = _model()
    n = sum(p.numel() for p in model.parameters())
    keep_all = remat.optimize(model, x, plan="keep_all").plan.predicted_peak_bytes
    target = remat.optimize(model, x, plan="keep_matmuls").plan.predicted_peak_bytes
    assert target < keep_all
    static = 12 * n  # fp32 parameters + Adam moments; gradients are inside the step
    budget = int((static + target) / 0.95) + 1  # reserve 5%
    fast = remat.optimize(model, x, budget_bytes=budget, device_profile="cpu", time_limit_s=3)
    mem = fast.plan.device_memory
    assert mem is not None
    assert mem["parameters"] + mem["optimizer_state"] == static
    assert mem["reserve"] == int(budget * 0.05)
    assert mem["step_peak"] == fast.plan.predicted_peak_bytes < keep_all
    assert mem["total"] <= budget == mem["budget"]
    # The step peak is still what a run measures, at the allocator.
    measured = remat.measure_step(fast, (x,), allocator=True)
    assert measured.allocator_peak_bytes is not None
    assert_peak_close(fast.plan.predicted_peak_bytes, measured.allocator_peak_bytes, "budget")


def test_budget_below_the_least_step_peak_names_the_total_it_needs() -> None:
    model, x = _model()
    n = sum(p.numel() for p in model.parameters())
    with pytest.raises(remat.BudgetError) as err:
        remat.optimize(model, x, budget_bytes=12 * n + 2000, reserve_fraction=0.0, time_limit_s=3)
    assert "so the device needs at least" in str(err.value)
    total = err.value.least_total_bytes  # type: ignore[attr-defined]
    fast = remat.optimize(model, x, budget_bytes=total, reserve_fraction=0.0, time_limit_s=3)
    assert fast.plan.device_memory is not None and fast.plan.device_memory["total"] <= total


def test_budget_arguments_exclude_each_other() -> None:
    model, x = _model()
    with pytest.raises(ValueError, match="budget_gb or budget_bytes"):
        remat.optimize(model, x, budget_gb=1, budget_bytes=10**9)
    with pytest.raises(ValueError, match="activation_budget_bytes"):
        remat.optimize(model, x, budget_gb=1, activation_budget_bytes=10**6)


def test_report_prints_the_breakdown_and_the_plan_by_module() -> None:
    from remat.plan.report import _bytes, module_group

    assert module_group("model.layers.11.self_attn") == "model.layers.*.self_attn"
    assert module_group("blocks.0") == "blocks.*"
    model, x = _model()
    fast = remat.optimize(model, x, budget_bytes=2_500_000, time_limit_s=3)
    text = fast.report()
    mem = fast.plan.device_memory
    assert mem is not None
    measured = remat.measure_step(fast, (x,), allocator=True).allocator_peak_bytes
    assert measured is not None
    assert_peak_close(fast.plan.predicted_peak_bytes, measured, "report")
    for label, value in (
        ("parameters", mem["parameters"]),
        ("optimizer state", mem["optimizer_state"]),
        ("step peak, planned", measured),
        ("total", mem["total"]),
    ):
        line = next(ln for ln in text.splitlines() if ln.strip("│ ").startswith(label))
        assert _bytes(value) in line, (label, line)
    assert "blocks.*" in text and "fits: budget 2.50 MB" in text


def test_mixed_precision_trains_bitwise_without_dropout_and_keeps_module_paths() -> None:
    """bf16 autocast: same outputs and gradients as eager under autocast, measured ==
    predicted, and the graph keeps its module paths (export's autocast regions are inlined op
    by op)."""
    from tests.checks import assert_trains_like_eager

    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, heads=2, layers=2, seq=16, dropout=0.0)
    x = torch.randint(0, 64, (2, 16))
    for plan in ("keep_all", "keep_matmuls"):
        result = assert_trains_like_eager(
            model, (x,), {}, steps=2, plan=plan, precision="bf16-mixed"
        )
    assert isinstance(result.module, RematModule)
    problem = result.module._first.problem
    assert any(v.op == "aten._to_copy.default" for v in problem.values)  # the casts are there
    paths = {v.module_path for v in problem.values if v.role.value == "forward"}
    assert {"blocks.0.qkv", "blocks.1.fc1"} <= paths


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
@pytest.mark.parametrize("p", [0.1, 0.3])
def test_mixed_precision_dropout_trains_bitwise(precision: str, p: float) -> None:
    """16-bit dropout on CPU: eager's backward is ``g * noise`` with ``1 / (1 - p)`` rounded to
    16 bits, not ``native_dropout_backward``'s float scale; the joint graph computes it so."""
    from tests.checks import assert_trains_like_eager

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(p), nn.Linear(8, 8))
    x = torch.randn(4, 16, 8)
    for plan in ("keep_all", "keep_inputs"):
        assert_trains_like_eager(model, (x,), {}, steps=2, plan=plan, precision=precision)
    torch.manual_seed(0)
    gpt = TinyGPT(vocab=64, dim=32, heads=2, layers=1, seq=16, dropout=p)
    assert_trains_like_eager(
        gpt, (torch.randint(0, 64, (2, 16)),), {}, steps=2, plan="keep_matmuls", precision=precision
    )
