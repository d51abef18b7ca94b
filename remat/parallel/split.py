"""A Hugging Face causal LM cut into pipeline stages, to plan a pipeline ahead of the job.

Inside a job each rank builds its own stage module and ``remat.apply`` (or
:func:`remat.plan_pipeline`) takes it as it is. To plan a pipeline from the command line
(``remat plan MODEL --executor sac --pp-size 4``) remat cuts the model it built on
FakeTensors as torchtitan cuts Llama: the decoder layers split evenly over the stages, the
token embeddings on the first, the final norm and the head on the last. Each stage runs its
layers as the model's own forward does (rotary embeddings and the causal mask recomputed
per stage from the positions, as every stage of a real pipeline does).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["CausalLMStage", "causal_lm_stages", "stage_example"]


class CausalLMStage(nn.Module):
    """Decoder layers ``[lo, hi)`` of a Llama-family causal LM (Llama, Mistral, Qwen2: a
    ``model.layers`` list, ``model.rotary_emb``), with the embeddings on the first stage and
    the final norm and head on the last. The modules are the model's own (shared)."""

    def __init__(self, lm: Any, lo: int, hi: int, *, first: bool, last: bool) -> None:
        super().__init__()
        inner: Any = lm.model
        self.config = inner.config
        self.embed_tokens: nn.Module | None = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[lo:hi])
        self.rotary_emb: nn.Module = inner.rotary_emb
        self.norm: nn.Module | None = inner.norm if last else None
        self.lm_head: nn.Module | None = lm.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=h,
            attention_mask=None,
            cache=None,
            position_ids=positions,
        )
        rotary = self.rotary_emb(h, position_ids=positions)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
        if self.norm is not None and self.lm_head is not None:
            h = self.lm_head(self.norm(h))
        return h


def causal_lm_stages(lm: nn.Module, n_stages: int) -> list[CausalLMStage]:
    """``lm`` cut into ``n_stages`` stages of (nearly) equal numbers of layers, the earlier
    stages taking one more where they do not divide; a clear error for other layouts."""
    inner = getattr(lm, "model", None)
    if not all(
        hasattr(x, a)
        for x, a in ((lm, "lm_head"), (inner, "layers"), (inner, "rotary_emb"), (inner, "norm"))
    ):
        raise ValueError(
            f"{type(lm).__name__} is not a Llama-family causal LM (model.layers, "
            "model.rotary_emb, lm_head): build the stage modules in the job and use "
            "remat.plan_pipeline or remat.apply(..., pipeline=...) on them"
        )
    assert inner is not None
    layers = len(inner.layers)
    if not 2 <= n_stages <= layers:
        raise ValueError(
            f"--pp-size {n_stages}: a pipeline of 2 to {layers} stages (one layer each)"
        )
    cuts = [layers * i // n_stages for i in range(n_stages + 1)]
    return [
        CausalLMStage(lm, cuts[i], cuts[i + 1], first=i == 0, last=i == n_stages - 1)
        for i in range(n_stages)
    ]


def stage_example(stage: CausalLMStage, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One microbatch's input of ``stage``: the token ids for the first, else the hidden
    states it receives (made like ``tokens``: FakeTensors when they are)."""
    if stage.embed_tokens is not None:
        return tokens
    from remat._torch_compat import fake_mode_of

    mode = fake_mode_of(stage)
    hidden = stage.config.hidden_size
    shape = (*tokens.shape, hidden)
    if mode is None:
        return torch.zeros(shape, dtype=dtype)
    with mode:
        return torch.zeros(shape, dtype=dtype)
