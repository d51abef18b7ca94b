"""``remat.apply`` with the Hugging Face stack: the Trainer, unchanged, and PEFT LoRA."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

import remat
from tests.checks import assert_trains_like_eager
from tests.zoo import llama


def _llama() -> nn.Module:
    torch.manual_seed(0)
    return llama()


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 128, (16, 64), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(model: nn.Module, out: Path) -> list[torch.Tensor]:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        seed=0,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=_Tokens()).train()
    return [p.detach().clone() for p in model.parameters()]


def test_trainer_runs_an_applied_model_unchanged(tmp_path: Path) -> None:
    model = _llama()
    plain = _train(copy.deepcopy(model), tmp_path / "plain")
    batch = _Tokens()[0]
    work = copy.deepcopy(model)
    kwargs: dict[str, Any] = {"labels": batch["labels"].expand(4, -1)}
    remat.apply(work, batch["input_ids"].expand(4, -1), example_kwargs=kwargs, plan="block")
    ours = _train(work, tmp_path / "remat")
    assert all(torch.equal(a, b) for a, b in zip(plain, ours, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(plain, model.parameters(), strict=True))


def test_peft_lora_plan_counts_frozen_weights_and_trains_bitwise() -> None:
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(
        _llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    )
    tokens = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(5))
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in lora.parameters() if not p.requires_grad)
    assert frozen > 10 * trainable

    result = assert_trains_like_eager(
        lora, (tokens,), {}, executor="sac", budget_bytes=8_000_000, optimizer="adamw"
    )
    memory = result.plan.device_memory
    assert memory is not None
    assert memory["optimizer_state"] == 8 * trainable  # AdamW moments of the LoRA weights only
    assert memory["parameters"] == 4 * (trainable + frozen)
    for step in result.steps:
        assert step.predicted_tensor_peak_bytes == step.measured_tensor_peak_bytes


def test_a_training_wrapper_around_a_gqa_decoder_trains_bitwise() -> None:
    """A loss wrapper calls the decoder with its KV cache on (Qwen2's default): ``apply`` turns
    off the cache of the HF model inside, or the replay would concatenate the forward's keys
    again (SAC: "slice invocation index 4 ... not found"). GQA without attention dropout runs
    SDPA's flash kernel with the heads grouped in it."""
    from tests.zoo import GQA_ZOO

    case = next(c for c in GQA_ZOO if c.name == "qwen2_gqa_loss")
    torch.manual_seed(0)
    model = case.build()
    inner = model.lm
    assert inner.config.use_cache
    for plan in ("block", "keep_matmuls"):
        result = assert_trains_like_eager(model, case.inputs(), {}, executor="sac", plan=plan)
        assert result.plan.solver.startswith("native")
    wrapped = copy.deepcopy(model)
    remat.apply(wrapped, case.inputs(), plan="block")
    assert not wrapped.lm.config.use_cache
    remat.unapply(wrapped)
    assert wrapped.lm.config.use_cache
