"""Presets: each builds under FakeTensorMode with the published shape."""

from __future__ import annotations

import pytest

from remat.presets import PRESETS, build


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("llama3-8b", 8_030_261_248),  # Meta-Llama-3-8B: 8.03B
        ("llama3-70b", 70_553_706_496),  # Meta-Llama-3-70B: 70.55B
    ],
)
def test_llama3_parameter_count(name: str, params: int) -> None:
    built = build(name, seq=16, batch=1)
    model = built.model
    assert sum(p.numel() for p in model.parameters()) == params
    config = model.config
    assert config.vocab_size == 128256 and config.num_key_value_heads == 8
    assert config.max_position_embeddings == 8192 and config.rms_norm_eps == 1e-5
    assert config.rope_parameters["rope_theta"] == 500000.0
    assert not config.tie_word_embeddings
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert name in PRESETS and PRESETS[name].description in built.description
