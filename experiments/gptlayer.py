"""A GPT layer as in Korthikanti et al. 2022, Fig./Sec. 4.1: explicit (unfused) attention."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, h, a, s, p, fused=False):
        super().__init__()
        self.h, self.a, self.p, self.fused = h, a, p, fused
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.attn_drop = nn.Dropout(p)
        self.register_buffer(
            "causal", torch.ones(s, s, dtype=torch.bool).tril().logical_not(), persistent=False
        )

    def forward(self, x):
        b, s, h = x.shape
        a, d = self.a, h // self.a
        q, k, v = self.qkv(x).split(h, dim=-1)
        q = q.view(b, s, a, d).transpose(1, 2)  # (b, a, s, d)
        k = k.view(b, s, a, d).transpose(1, 2)
        v = v.view(b, s, a, d).transpose(1, 2)
        if self.fused:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True
            )
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d))  # QK^T
            scores = scores.masked_fill(self.causal[:s, :s], float("-inf"))
            probs = self.attn_drop(torch.softmax(scores, dim=-1))
            y = torch.matmul(probs, v)  # attention over V
        y = y.transpose(1, 2).reshape(b, s, h)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Layer(nn.Module):
    def __init__(self, h, a, s, p=0.1, fused=False):
        super().__init__()
        self.ln1 = nn.LayerNorm(h)
        self.attn = Attention(h, a, s, p, fused)
        self.drop1 = nn.Dropout(p)
        self.ln2 = nn.LayerNorm(h)
        self.mlp = MLP(h)
        self.drop2 = nn.Dropout(p)

    def forward(self, x):
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.mlp(self.ln2(x)))


class Stack(nn.Module):
    """L identical layers and a final LayerNorm (so the last layer's output is read by a
    LayerNorm backward, as every other layer's output is by the next layer's ln1)."""

    def __init__(self, layers, h, a, s, p=0.1, fused=False):
        super().__init__()
        self.layers = nn.ModuleList(Layer(h, a, s, p, fused) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.ln_f(x)
