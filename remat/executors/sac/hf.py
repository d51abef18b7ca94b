"""Hugging Face's one data-dependent branch in a decoder's step, taken on FakeTensors as on
real ones.

Without an attention mask, a decoder checks its position ids for packed sequences
(``transformers.masking_utils.find_packed_sequence_indices``): on real tensors it finds one
sequence per row and lets SDPA apply causality (no mask); on FakeTensors it cannot read the
values and materialises a ``[batch, 1, seq, seq]`` boolean mask instead, so a traced plan
would hold bytes the real run never allocates. While remat traces, the check answers as it
would on the real inputs: from the caller's own ``position_ids`` when given, else "one
sequence per row" (the position ids HF makes itself are ``arange``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from remat import _torch_compat as tc


@contextlib.contextmanager
def real_packing_check(example_kwargs: Mapping[str, Any]) -> Iterator[None]:
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if masking is None or original is None:
        yield
        return
    given = example_kwargs.get("position_ids")
    real = given if isinstance(given, torch.Tensor) and not tc.is_fake(given) else None

    def find(position_ids: torch.Tensor) -> torch.Tensor | None:
        if not tc.is_fake(position_ids):
            return original(position_ids)  # type: ignore[no-any-return]
        if real is None or original(real.expand(position_ids.shape)) is None:
            return None
        return torch.zeros_like(position_ids)  # packed: the mask is built (values unused)

    setattr(masking, "find_packed_sequence_indices", find)  # noqa: B010
    try:
        yield
    finally:
        setattr(masking, "find_packed_sequence_indices", original)  # noqa: B010


@contextlib.contextmanager
def kv_cache_off(model: nn.Module) -> Iterator[None]:
    """The model's KV caches off while remat traces it, restored after (see
    :func:`disable_kv_cache`)."""
    previous = disable_kv_cache(model)
    try:
        yield
    finally:
        restore_kv_cache(model, previous)


def restore_kv_cache(model: nn.Module, previous: tuple[str, ...]) -> None:
    modules = dict(model.named_modules())
    for path in previous:
        modules[path].config.use_cache = True  # type: ignore[union-attr]


def disable_kv_cache(model: nn.Module) -> tuple[str, ...]:
    """Turn the KV cache off (``config.use_cache``) in every Hugging Face model inside
    ``model`` -- the model itself or one a training wrapper calls -- as
    ``gradient_checkpointing_enable()`` does in training: a cache updated inside a block makes
    the recomputation differ from the forward (it concatenates the forward's keys again, and
    SAC stops at an op the forward did not run). Returns the paths of the modules whose
    configuration had it on (a configuration shared by several, once)."""
    turned_off: list[str] = []
    seen: set[int] = set()
    for path, m in model.named_modules():
        config = getattr(m, "config", None)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        if getattr(config, "use_cache", None) is True:
            config.use_cache = False
            turned_off.append(path)
    return tuple(turned_off)
