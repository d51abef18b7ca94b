"""Planning tensor parallelism ahead, with no process group (:mod:`remat.native.parallel`).

That such a plan's peaks are the ones measured on real ranks is checked in
``test_tensor_parallel.py``; here, what needs no processes: the shards, and the errors.
"""

from __future__ import annotations

import pytest
import torch

import remat
from remat.budget import Options
from remat.cli import main
from remat.native.parallel import llama_tp_plan, tensor_parallel
from remat.request import model_static_memory
from tests.zoo import ZOO, llama

LLAMA = ["hf:llama", "--set", "num_hidden_layers=2", "--set", "hidden_size=64",
         "--set", "intermediate_size=128", "--set", "num_attention_heads=4",
         "--set", "num_key_value_heads=2", "--set", "vocab_size=128", "--seq", "64",
         "--batch", "2", "--budget-gb", "0.05", "--device", "cpu", "--time-limit", "5"]  # fmt: skip


def test_static_memory_counts_this_ranks_shards() -> None:
    with remat.fake_mode():
        whole = llama(2, 64)
        model = llama(2, 64)
    tensor_parallel(model, 2)
    sharded = sum(
        p.numel()
        for path, m in whole.named_modules()
        if path.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj")
        or path.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj")
        for p in m.parameters()
    )
    everything = sum(p.numel() for p in whole.parameters())
    options = Options()
    assert model_static_memory(model, options).parameters == 4 * (everything - sharded // 2)
    assert model_static_memory(whole, options).parameters == 4 * everything


def test_a_model_without_llama_projections_is_refused() -> None:
    gpt2 = next(c for c in ZOO if c.name == "hf_gpt2").build()
    with pytest.raises(ValueError, match="no Llama-style projections"):
        llama_tp_plan(gpt2, 2)
    with pytest.raises(ValueError, match="at least 2"):
        tensor_parallel(gpt2, 1)


def test_cli_plans_rank_0_of_a_tensor_parallel_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *LLAMA, "--tp-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel x 2" in out and "remat.apply" in out
    assert main(["plan", *LLAMA, "--tp-size", "2", "--executor", "graph"]) == 2
    assert "--tp-size plans remat.apply's executor" in capsys.readouterr().out
    zero3 = ["--zero-stage", "3", "--world-size", "2"]
    assert main(["plan", *LLAMA, "--tp-size", "2", *zero3]) == 2
    assert "cannot be planned ahead yet" in capsys.readouterr().out


def test_collectives_are_always_kept() -> None:
    from remat.native.regions import KeyPolicy

    policy = KeyPolicy(frozenset())
    all_reduce = torch.ops._c10d_functional.all_reduce.default
    assert policy(None, all_reduce).name == "MUST_SAVE"  # type: ignore[arg-type]
    assert policy(None, torch.ops.aten.mm.default).name == "PREFER_RECOMPUTE"  # type: ignore[arg-type]


def test_each_rank_recomputes_its_shards_flops() -> None:
    """FLOPs of the ops a DTensor runs are this rank's (matmuls and attention split by the
    tensor-parallel degree), not the whole layer's."""
    flops = {}
    for tp in (1, 2):
        with remat.fake_mode():
            model = llama(3, 128)
        if tp > 1:
            tensor_parallel(model, tp)
        tokens = torch.randint(0, 128, (4, 128), generator=torch.Generator().manual_seed(7))
        remat.apply(model, tokens, plan="block")
        flops[tp] = remat.plan_of(model).recompute_flops
    assert flops[1] > 0 and flops[2] * 2 == flops[1]
