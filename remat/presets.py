"""Models the CLI can plan by name: well-known shapes as Hugging Face configs (random init).

No weights are downloaded: a preset is a config, built under ``remat.fake_mode()`` so that a
70B shape costs no memory. ``hf:NAME`` builds any architecture transformers knows by its
``model_type`` (``hf:mistral``, ``hf:qwen2``, ...), ``pkg.module:factory`` calls a function
returning ``(model, example_inputs)``, ``(model, example_inputs, example_kwargs)`` or, for a
loss computed outside the model, ``(model, example_inputs, loss_fn, target)``.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat._torch_compat import fake_mode


@dataclass(frozen=True)
class Preset:
    description: str
    model_type: str
    config: Mapping[str, Any]
    head: str = "causal-lm"
    """``causal-lm`` or ``masked-lm``: which head (and loss) the model trains with."""


_LLAMA3: dict[str, Any] = {
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
"""What Llama 3 8B and 70B share in Meta's published configurations."""


PRESETS: dict[str, Preset] = {
    "gpt2": Preset("GPT-2 small, 124M (12 x 768)", "gpt2", {}),
    "gpt2-medium": Preset(
        "GPT-2 medium, 355M (24 x 1024)", "gpt2", {"n_layer": 24, "n_embd": 1024, "n_head": 16}
    ),
    "bert-base": Preset("BERT base, 110M (12 x 768)", "bert", {}, head="masked-lm"),
    "llama-7b": Preset(
        "Llama 2 7B (32 x 4096, MHA)",
        "llama",
        {
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
        },
    ),
    "llama-13b": Preset(
        "Llama 2 13B (40 x 5120, MHA)",
        "llama",
        {
            "hidden_size": 5120,
            "intermediate_size": 13824,
            "num_hidden_layers": 40,
            "num_attention_heads": 40,
            "num_key_value_heads": 40,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
        },
    ),
    "llama-70b": Preset(
        "Llama 2 70B (80 x 8192, GQA 64/8)",
        "llama",
        {
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
        },
    ),
    # Llama 3 as Meta's published config.json files give it (rms_norm_eps 1e-5 for both).
    "llama3-8b": Preset(
        "Llama 3 8B (32 x 4096, GQA 32/8)",
        "llama",
        {
            **_LLAMA3,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
        },
    ),  # fmt: skip
    "llama3-70b": Preset(
        "Llama 3 70B (80 x 8192, GQA 64/8)",
        "llama",
        {
            **_LLAMA3,
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
        },
    ),  # fmt: skip
}


@dataclass(frozen=True)
class Built:
    model: nn.Module
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    description: str
    loss_fn: Callable[[Any, Any], Any] | None = None
    """The training loop's loss, ``loss_fn(output, target)``, where a factory gives one."""
    target: Any = None

    def loss(self) -> dict[str, Any]:
        """``loss_fn=``/``target=`` for :func:`remat.apply`, where the factory gave a loss."""
        return {} if self.loss_fn is None else {"loss_fn": self.loss_fn, "target": self.target}


def parse_settings(items: list[str]) -> dict[str, Any]:
    """``["hidden_size=4096", "use_cache=False"]`` -> a dict, values as Python literals."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set takes KEY=VALUE, got {item!r}")
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def build(
    spec: str,
    *,
    seq: int,
    batch: int,
    settings: Mapping[str, Any] | None = None,
    fake: bool = True,
) -> Built:
    """The model and example inputs a CLI spec names (see the module docstring)."""
    settings = dict(settings or {})
    if spec in PRESETS:
        p = PRESETS[spec]
        what = p.description + "".join(f", {k}={v!r}" for k, v in settings.items())
        return _hf(p.model_type, {**p.config, **settings}, p.head, seq, batch, fake, what)
    if spec.startswith("hf:"):
        name = spec[3:]
        head = settings.pop("head", "masked-lm" if name in ("bert", "roberta") else "causal-lm")
        return _hf(name, settings, head, seq, batch, fake, f"{name} (transformers config)")
    if ":" in spec:
        return _factory(spec, settings, fake)
    raise ValueError(
        f"unknown model {spec!r}: a preset ({', '.join(PRESETS)}), hf:MODEL_TYPE "
        "(any transformers architecture), or pkg.module:factory"
    )


def _hf(
    model_type: str,
    settings: Mapping[str, Any],
    head: str,
    seq: int,
    batch: int,
    fake: bool,
    description: str,
) -> Built:
    try:
        import transformers
    except ImportError:
        raise ValueError("Hugging Face models need transformers: pip install 'remat[hf]'") from None
    try:
        config = transformers.AutoConfig.for_model(model_type, **settings)
    except ValueError as e:
        raise ValueError(f"transformers does not know model type {model_type!r}: {e}") from None
    positions = getattr(config, "max_position_embeddings", getattr(config, "n_positions", None))
    if positions is not None and seq > positions:
        raise ValueError(
            f"--seq {seq} exceeds the model's {positions} positions; raise it with "
            "--set max_position_embeddings=N (or n_positions=N for GPT-2)"
        )
    auto = {
        "causal-lm": transformers.AutoModelForCausalLM,
        "masked-lm": transformers.AutoModelForMaskedLM,
    }.get(head)
    if auto is None:
        raise ValueError(f"unknown head {head!r}; valid: causal-lm, masked-lm")
    with fake_mode() if fake else contextlib.nullcontext():
        model = auto.from_config(config)
        tokens = torch.randint(0, config.vocab_size, (batch, seq))
    # Train as a language model does: the loss inside the step, against the inputs as labels.
    return Built(model, (tokens,), {"labels": tokens}, f"{description}, batch {batch} x seq {seq}")


def _factory(spec: str, settings: Mapping[str, Any], fake: bool) -> Built:
    module_name, _, attr = spec.partition(":")
    try:
        fn: Callable[..., Any] = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load factory {spec!r}: {e}") from None
    with fake_mode() if fake else contextlib.nullcontext():
        out = fn(**settings)
    if (
        not isinstance(out, tuple)
        or len(out) not in (2, 3, 4)
        or (len(out) == 4 and not callable(out[2]))
    ):
        raise ValueError(
            f"{spec} must return (model, example_inputs[, example_kwargs]) or (model, "
            "example_inputs, loss_fn, target)"
        )
    model, args = out[0], out[1]
    args = args if isinstance(args, tuple) else (args,)
    if len(out) == 4:
        return Built(model, args, {}, spec, loss_fn=out[2], target=out[3])
    kwargs = out[2] if len(out) == 3 else {}
    return Built(model, args, kwargs, spec)
