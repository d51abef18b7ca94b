"""``remat.apply`` on architectures nobody here wrote, from small random configs: each
trains bitwise like the unmodified model over 3 AdamW steps (dropout on) with the predicted
peaks the measured ones, on the blocks a user would name: Swin's layers (not its stages),
Whisper's encoder and decoder layers together, BLOOM's layers with its custom
``autograd.Function`` (which ``remat.optimize`` refuses: ``tests/executors/graph/test_capture.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import remat
from tests.checks import assert_trains_like_eager
from tests.zoo import Stack, StraightThrough

transformers = pytest.importorskip("transformers")


def _blocks(model: nn.Module) -> tuple[str, ...]:
    return remat.executors.sac.state.applied(model).blocks


def test_swin_is_planned_on_its_layers() -> None:
    cfg = transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 2],
        window_size=4, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    result = assert_trains_like_eager(
        transformers.SwinModel(cfg), (torch.randn(2, 3, 32, 32),), {}, executor="sac", plan="block"
    )
    assert _blocks(result.module) == tuple(
        f"encoder.layers.{s}.blocks.{b}" for s in range(2) for b in range(2)
    )
    assert "2 from encoder.layers" in result.plan.reason  # the stages, traced and not chosen


def test_whisper_is_planned_on_its_encoder_and_decoder_layers() -> None:
    cfg = transformers.WhisperConfig(
        num_mel_bins=8, encoder_layers=2, decoder_layers=2, d_model=32,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_source_positions=16, max_target_positions=16, vocab_size=64,
        pad_token_id=1, bos_token_id=2, eos_token_id=3, decoder_start_token_id=2, dropout=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    kwargs: dict[str, Any] = {"decoder_input_ids": torch.randint(0, 64, (2, 8))}
    model = transformers.WhisperForConditionalGeneration(cfg)
    result = assert_trains_like_eager(
        model, (torch.randn(2, 8, 32),), kwargs, executor="sac", plan="block"
    )
    assert _blocks(result.module) == (
        *(f"model.encoder.layers.{i}" for i in range(2)),
        *(f"model.decoder.layers.{i}" for i in range(2)),
    )


def test_bloom_runs_its_custom_autograd_function_backward() -> None:
    cfg = transformers.BloomConfig(
        n_layer=2, hidden_size=32, n_head=2, vocab_size=64, hidden_dropout=0.1
    )
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(cfg)
    assert_trains_like_eager(
        model, (torch.randint(0, 64, (2, 16)),), {}, executor="sac", plan="block"
    )


class _QuantBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(StraightThrough.apply(torch.tanh(self.lin(x))))


def test_a_straight_through_estimator_trains_bitwise() -> None:
    """Its gradient is not its forward ops' (``round``'s is zero): the blocks' own backward
    runs, so every gradient is eager's, none zero."""
    torch.manual_seed(0)
    result = assert_trains_like_eager(
        Stack(_QuantBlock, 3), (torch.randn(4, 16),), {}, executor="sac", plan="block"
    )
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in result.module.parameters())
