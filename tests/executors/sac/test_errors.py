"""``remat.apply``'s contract: in place, reversible, and refused in the wrong order."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import remat
from remat.models import TinyGPT
from tests.zoo import Stack


def _gpt() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return TinyGPT(vocab=64, dim=32, heads=2, layers=2, seq=16), torch.randint(0, 64, (2, 16))


def test_apply_is_in_place_and_unapply_restores() -> None:
    model, tokens = _gpt()
    keys = list(model.state_dict())
    forward = model.blocks[0].forward
    out = remat.apply(model, tokens, plan="block")
    assert out is model
    assert list(model.state_dict()) == keys
    assert model.blocks[0].forward != forward  # the block now runs through a checkpoint
    plan = remat.plan_of(model)
    assert plan.solver == "native:block"
    assert plan.recompute_flops > 0
    remat.unapply(model)
    assert "forward" not in model.blocks[0].__dict__
    with pytest.raises(ValueError, match="no remat plan"):
        remat.plan_of(model)


def test_no_blocks_names_block_types() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(remat.BlockError, match="block_types="):
        remat.apply(model, torch.randn(2, 4))
    remat.apply(model, torch.randn(2, 4), block_types=("0", "2"), plan="block")
    assert remat.plan_of(model).saved == frozenset()


def test_applying_twice_is_refused() -> None:
    model, tokens = _gpt()
    remat.apply(model, tokens, plan="keep_all")
    with pytest.raises(remat.BlockError, match="unapply"):
        remat.apply(model, tokens, plan="block")


def test_compiled_model_is_refused() -> None:
    model, tokens = _gpt()
    with pytest.raises(remat.BlockError, match="then torch.compile"):
        remat.apply(torch.compile(model), tokens)


def test_after_ddp_or_fully_shard_is_refused(tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model, tokens = _gpt()
        with pytest.raises(remat.BlockError, match=r"apply remat to the model first"):
            remat.apply(nn.parallel.DistributedDataParallel(copy.deepcopy(model)), tokens)
        fully_shard(model.blocks[0], mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(remat.BlockError, match=r"apply remat first.*then fully_shard"):
            remat.apply(model, tokens)
    finally:
        dist.destroy_process_group()


class _MaskedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return x + h[h > 0].sum()  # data-dependent shape


def test_unsupported_op_names_the_op_and_module() -> None:
    with remat.fake_mode():  # too large to copy for real: traced on FakeTensors only
        model, x = Stack(_MaskedBlock, 2), torch.randn(4, 8)
    with pytest.raises(remat.TraceError, match=r"blocks\.0.*aten\.nonzero"):
        remat.apply(model, x, plan="block")


def test_data_dependent_model_on_cpu_is_traced_on_a_copy() -> None:
    model, x = Stack(_MaskedBlock, 2), torch.randn(4, 8)
    messages: list[str] = []
    remat.apply(model, x, plan="block", progress=messages.append)
    assert any("real copy" in m for m in messages)
    assert remat.plan_of(model).predicted_peak_bytes > 0


def test_hf_kv_cache_off_and_restored() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
    assert model.config.use_cache
    remat.apply(model, torch.randint(0, 64, (2, 16)), plan="keep_matmuls")
    assert not model.config.use_cache
    remat.unapply(model)
    assert model.config.use_cache
    with pytest.raises(remat.BudgetError):  # a failed apply leaves the model as it was
        remat.apply(model, torch.randint(0, 64, (2, 16)), activation_budget_bytes=1)
    assert model.config.use_cache
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_plan_file_round_trip_and_mismatch(tmp_path: Path) -> None:
    model, tokens = _gpt()
    remat.apply(model, tokens, activation_budget_bytes=700_000)
    plan = remat.plan_of(model)
    path = remat.save_plan(model, tmp_path / "plan.json")
    again, _ = _gpt()
    remat.apply(again, tokens, plan=path)
    loaded = remat.plan_of(again)
    assert loaded.saved == plan.saved
    assert loaded.predicted_peak_bytes == plan.predicted_peak_bytes
    assert "loaded from" in loaded.reason
    with pytest.raises(remat.PlanFileError, match="other blocks or shapes"):
        remat.apply(_gpt()[0], torch.randint(0, 64, (4, 16)), plan=path)
    with pytest.raises(remat.PlanFileError, match="remat.apply"):
        remat.optimize(_gpt()[0], tokens, plan=path)
    joint = remat.optimize(_gpt()[0], tokens, plan="keep_all").save_plan(tmp_path / "j.json")
    with pytest.raises(remat.PlanFileError, match="remat.optimize"):
        remat.apply(_gpt()[0], tokens, plan=joint)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(remat.PlanFileError, match="not readable"):
        remat.apply(_gpt()[0], tokens, plan=tmp_path / "bad.json")


def test_explain_reports_each_block() -> None:
    model, tokens = _gpt()
    remat.apply(model, tokens, budget_bytes=10_000_000, plan="block")
    text = remat.explain(model, width=100)
    assert "blocks.0" in text and "blocks.1" in text
    assert "optimizer state" in text and "step peak, planned" in text
