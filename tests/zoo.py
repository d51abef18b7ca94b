"""The model zoo every end-to-end test runs: small, random-init, dropout on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat.models import ResNet, TinyGPT


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple[Any, ...]]
    kwargs: dict[str, Any] = field(default_factory=dict)


def _tokens(vocab: int, batch: int = 2, seq: int = 16) -> Callable[[], tuple[Any, ...]]:
    return lambda: (
        torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(7)),
    )


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1, stride=2),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Dropout(0.1),
        )
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


class TwoHeads(nn.Module):
    """Returns a tuple: logits and a projection of the hidden features."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Dropout(0.2))
        self.cls = nn.Linear(64, 5)
        self.proj = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.cls(h), self.proj(h).relu()


class TiedAutoencoder(nn.Module):
    """Decoder reuses the encoder's weight object: one parameter under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(48, 24)
        self.dec = nn.Linear(24, 48, bias=False)
        self.dec.weight = nn.Parameter(self.enc.weight.detach().t().contiguous())
        self.mid = nn.Linear(24, 24)
        self.out = nn.Linear(24, 24, bias=False)
        self.out.weight = self.mid.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.enc(x))
        h = torch.relu(self.out(torch.relu(self.mid(h))))
        return self.dec(h)


def _gpt2(layers: int = 2, positions: int = 64) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=128, n_positions=positions)
    return GPT2LMHeadModel(cfg)


def llama(layers: int = 2, positions: int = 64) -> nn.Module:
    """Grouped-query attention (2 key/value heads for 4 query heads), attention dropout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=positions,
        attention_dropout=0.1,
    )
    return LlamaForCausalLM(cfg)


def _bert(layers: int = 2, positions: int = 64) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        num_hidden_layers=layers,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        vocab_size=128,
        max_position_embeddings=positions,
    )
    return BertForMaskedLM(cfg)


def _images() -> tuple[Any, ...]:
    return (torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(3)),)


def _vectors(n: int) -> Callable[[], tuple[Any, ...]]:
    return lambda: (torch.randn(8, n, generator=torch.Generator().manual_seed(5)),)


ZOO: tuple[Case, ...] = (
    Case("tiny_gpt", lambda: TinyGPT(vocab=128, dim=64, heads=4, layers=2, seq=32), _tokens(128)),
    Case("hf_gpt2", _gpt2, _tokens(128)),
    Case("hf_llama", llama, _tokens(128)),
    Case("hf_bert", _bert, _tokens(128)),
    Case("cnn_bn", ConvBN, _images),
    Case("tuple_out", TwoHeads, _vectors(32)),
    Case("tied", TiedAutoencoder, _vectors(48)),
)


def _mixtral() -> nn.Module:
    """A Mixtral-style MoE decoder: top-2 routing over 4 experts, grouped-query attention."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
        max_position_embeddings=128,
        attention_dropout=0.1,
    )
    return MixtralForCausalLM(cfg)


def _qwen2() -> nn.Module:
    """A Qwen2-style decoder with grouped-query attention (4 query, 2 key/value heads) and no
    attention dropout, so CPU SDPA runs its flash kernel with the heads grouped in the kernel."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
    )
    return Qwen2ForCausalLM(cfg)


class CausalLMLoss(nn.Module):
    """A training wrapper: next-token cross-entropy of a causal LM called without positions."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm(ids).logits[:, :-1]
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


GQA_ZOO: tuple[Case, ...] = (
    Case("qwen2_gqa_loss", lambda: CausalLMLoss(_qwen2()), _tokens(128, batch=2, seq=256)),
    Case("mixtral_moe", _mixtral, _tokens(128, batch=2, seq=256)),
)
"""Grouped-query attention and MoE routing at a sequence of several attention-kernel blocks
(256): where capture once took another branch of transformers' mask code than eager."""


NATIVE_ZOO: tuple[Case, ...] = (
    Case(
        "tiny_gpt",
        lambda: TinyGPT(vocab=128, dim=64, heads=4, layers=3, seq=128),
        _tokens(128, batch=4, seq=128),
    ),
    Case("hf_gpt2", lambda: _gpt2(3, 128), _tokens(128, batch=4, seq=128)),
    Case("hf_llama_gqa", lambda: llama(3, 128), _tokens(128, batch=4, seq=128)),
    Case("hf_bert", lambda: _bert(3, 128), _tokens(128, batch=4, seq=128)),
    Case("hf_mixtral_moe", _mixtral, _tokens(128, batch=4, seq=128)),
    Case(
        "resnet_bn",
        lambda: ResNet(channels=8, blocks=3),
        lambda: (torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(3)),),
    ),
)
"""Models ``remat.apply`` is tested on: shapes where activations, not parameter gradients,
set the peak (sequence 128, batch 4), with GQA and MoE decoders and BatchNorm."""


def tiny_llama_factory() -> tuple[nn.Module, tuple[Any, ...]]:
    """``remat fit tests.zoo:tiny_llama_factory``: a 3-layer GQA Llama and a batch of tokens."""
    torch.manual_seed(0)
    return llama(3, 128), (torch.randint(0, 128, (2, 32)),)


class GPTStage(nn.Module):
    """One stage of a GPT decoder split for ``torch.distributed.pipelining`` (TinyGPT's
    blocks, dropout on): the first embeds the token ids, the last ends with the final norm
    and the head; each runs its ``layers`` blocks."""

    def __init__(
        self, stage: int, n_stages: int, layers: int = 2, *, vocab: int = 128, dim: int = 64
    ) -> None:
        super().__init__()
        from remat.models import Block

        self.first, self.last = stage == 0, stage == n_stages - 1
        torch.manual_seed(stage)
        if self.first:
            self.tok = nn.Embedding(vocab, dim)
            self.pos = nn.Embedding(PIPELINE_SEQ, dim)
        self.blocks = nn.ModuleList(Block(dim, 4, 0.1) for _ in range(layers))
        if self.last:
            self.ln_f = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


PIPELINE_SEQ = 32


def pipeline_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The last stage's loss: next-token cross-entropy over the microbatch."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def stage_inputs(
    stage: int, microbatch: int = 2, *, vocab: int = 128, dim: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """One microbatch's input of ``stage`` (token ids, or the activations it receives) and
    its target (token ids)."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, vocab, (microbatch, PIPELINE_SEQ), generator=g)
    x = tokens if stage == 0 else torch.randn(microbatch, PIPELINE_SEQ, dim, generator=g)
    return x, torch.randint(0, vocab, (microbatch, PIPELINE_SEQ), generator=g)


class TitanBlock(nn.Module):
    """A decoder layer laid out as torchtitan's Llama 3 lays it out: RMSNorm, attention
    through SDPA, a SwiGLU feed-forward, residual adds, no dropout."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.RMSNorm(dim)
        self.wq, self.wk = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.wv, self.wo = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.w3 = nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.attention_norm(x)
        q, k, v = (
            w(h).view(b, s, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, s, d))
        h = self.ffn_norm(x)
        return x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))


class TitanLM(nn.Module):
    """torchtitan's model layout: the blocks in an ``nn.ModuleDict`` (``layers["0"]``), run
    in a loop over its values; the forward returns logits, the loss is the training loop's
    (:func:`titan_loss`)."""

    def __init__(self, vocab: int = 128, dim: int = 64, heads: int = 4, layers: int = 3) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): TitanBlock(dim, heads) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def titan_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's training loss: token cross-entropy summed, then divided by the tokens."""
    loss = nn.functional.cross_entropy(
        pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum"
    )
    return loss / labels.numel()


def titan_factory() -> tuple[nn.Module, tuple[Any, ...], Any, torch.Tensor]:
    """``remat plan tests.zoo:titan_factory``: torchtitan's layout with its loss outside the
    model, as ``(model, inputs, loss_fn, target)``."""
    torch.manual_seed(0)
    return (
        TitanLM(vocab=128, dim=64, heads=4, layers=3),
        (torch.randint(0, 128, (2, 32)),),
        titan_loss,
        torch.randint(0, 128, (2, 32)),
    )


class StraightThrough(torch.autograd.Function):
    """Round forward, identity backward (a straight-through estimator): its gradient is not
    its forward ops' (``round``'s is zero), so only its own backward trains right."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Stack(nn.Module):
    """``n`` blocks made by ``block``, in a ModuleList named ``blocks``, applied in turn."""

    def __init__(self, block: Callable[[], nn.Module], n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x
