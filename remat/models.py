"""Small built-in models: the demo's default, the test zoo's and the experiments' members.

``TinyGPT`` is a GPT-style decoder written out op by op (explicit attention with dropout, as in
the Megatron paper's accounting) with tied input/output embeddings. ``ResNet`` (residual blocks
with BatchNorm) and ``UNet`` (an encoder-decoder whose skip connections keep early activations
alive until late) are the CNN shapes of the experiments.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        attn = self.attn_drop(scores.softmax(dim=-1))
        y = (attn @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.resid_drop(self.proj(y))
        return x + self.resid_drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(
        self,
        vocab: int = 256,
        dim: int = 64,
        heads: int = 4,
        layers: int = 2,
        seq: int = 64,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class ResBlock(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class ResNet(nn.Module):
    """A ResNet-style CNN: a stem, ``blocks`` identical residual blocks, a classifier."""

    def __init__(self, channels: int = 16, blocks: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()
        )
        self.blocks = nn.ModuleList(ResBlock(channels) for _ in range(blocks))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def _conv_bn(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
    )


class UNet(nn.Module):
    """A U-Net-style CNN: ``depth`` levels down (conv, pool), up (upsample, concatenate the
    level's skip connection, conv). Input sides must be divisible by 2**depth."""

    def __init__(self, channels: int = 8, depth: int = 3, out_channels: int = 2) -> None:
        super().__init__()
        widths = [channels * 2**i for i in range(depth + 1)]
        self.inp = _conv_bn(3, widths[0])
        self.down = nn.ModuleList(_conv_bn(widths[i], widths[i + 1]) for i in range(depth))
        self.up = nn.ModuleList(
            _conv_bn(widths[i + 1] + widths[i], widths[i]) for i in reversed(range(depth))
        )
        self.out = nn.Conv2d(widths[0], out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = 2 ** len(self.down)
        if x.shape[-1] % side or x.shape[-2] % side:
            raise ValueError(
                f"UNet of depth {len(self.down)} needs input sides divisible by {side}, "
                f"got {tuple(x.shape[-2:])}"
            )
        x = self.inp(x)
        skips = []
        for down in self.down:
            skips.append(x)
            x = down(F.max_pool2d(x, 2))
        for up in self.up:
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")
            x = up(torch.cat([x, skips.pop()], dim=1))
        return self.out(x)
