"""The GPU measurement behind experiments/results/gpu_h200_measured.json (run once on a lent H200
through the device tool: ``OUT=<dir> python experiments/gpu_check.py``; ~35 s of device time).

A: the bytes autograd saves for one paper GPT layer (Korthikanti et al. 2022), per precision
mode (fp16 model, fp16 autocast, fused SDPA), in units of s*b*h, with the share that is weight
copies (autocast's fp16 casts). B: HF GPT-2 24x2048, batch 4, fp16 autocast, with and without
``gradient_checkpointing_enable()``: CUDA allocator peak above the parameters, and step time.
Kept as it ran (terse names); experiments/megatron_check.py and gpu_table.py compare its
figures with remat's.
"""

import json
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

D = "cuda" if torch.cuda.is_available() else "cpu"
R = {}


class L(nn.Module):
    def __init__(s, h, a, fused):
        super().__init__()
        s.a = a
        s.fu = fused
        s.l1 = nn.LayerNorm(h)
        s.q = nn.Linear(h, 3 * h)
        s.o = nn.Linear(h, h)
        s.l2 = nn.LayerNorm(h)
        s.f1 = nn.Linear(h, 4 * h)
        s.f2 = nn.Linear(4 * h, h)

    def forward(s, x):
        b, n, h = x.shape
        a = s.a
        d = h // a
        q, k, v = (t.view(b, n, a, d).transpose(1, 2) for t in s.q(s.l1(x)).split(h, -1))
        if s.fu:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        else:
            y = F.dropout(torch.softmax((q @ k.transpose(-2, -1)) / math.sqrt(d), -1), 0.1) @ v
        x = x + F.dropout(s.o(y.transpose(1, 2).reshape(b, n, h)), 0.1)
        return x + F.dropout(s.f2(F.gelu(s.f1(s.l2(x)))), 0.1)


def layer(n, h, a, mode, b=4):
    with torch.device(D):
        m = L(h, a, mode == "sdpa")
        x = torch.randn(b, n, h)
    if mode != "amp":
        m.half()
        x = x.half()
    x.requires_grad_()
    P = {p.untyped_storage().data_ptr() for p in m.parameters()}
    S = {}

    def pk(t):
        st = t.untyped_storage()
        k = st.data_ptr()
        if k not in P:
            S[k] = (
                st.nbytes(),
                t.dim() == 2
                and t.shape[0] * t.shape[1] % (h * h) == 0
                and t.shape[0] != b * n
                and t.shape[1] != b * n,
            )
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pk, lambda t: t),
        torch.autocast(D, torch.float16, enabled=mode == "amp"),
    ):
        m(x)
    sbh = n * b * h
    tot = sum(v[0] for v in S.values())
    w = sum(v[0] for v in S.values() if v[1])
    R[f"A {n},{h},{a} {mode}"] = dict(
        saved_sbh=tot / sbh, weights_sbh=w / sbh, paper=34 + 5 * a * n / h
    )
    print(R[f"A {n},{h},{a} {mode}"], flush=True)


CF = [(2048, 4096, 32), (1024, 2048, 16), (512, 1024, 16)] if D == "cuda" else [(64, 64, 4)]
for c in CF:
    for mo in ("fp16", "amp", "sdpa"):
        layer(*c, mo)


def hf(s, ck):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.cuda.empty_cache()
    with torch.device(D):
        m = GPT2LMHeadModel(GPT2Config(n_layer=24, n_embd=2048, n_head=16, n_positions=8192))
    m.train()
    if ck:
        m.gradient_checkpointing_enable()
    x = torch.randint(0, 50257, (4, s), device=D)
    base = torch.cuda.memory_allocated()
    ts = []
    try:
        for _i in range(3):
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
            t = time.time()
            with torch.autocast(D, torch.float16):
                loss = m(input_ids=x, labels=x).loss
            loss.backward()
            torch.cuda.synchronize()
            ts.append(time.time() - t)
            pk = torch.cuda.max_memory_allocated()
            m.zero_grad(set_to_none=True)
        R[f"B {s} ck={ck}"] = dict(
            params_gb=base / 1e9, peak_gb=pk / 1e9, step_gb=(pk - base) / 1e9, t_s=min(ts)
        )
    except torch.OutOfMemoryError:
        R[f"B {s} ck={ck}"] = "OOM"
    print(f"B {s} ck={ck}", R[f"B {s} ck={ck}"], flush=True)
    del m


if D == "cuda":
    for s, ck in ((2048, 0), (2048, 1), (8192, 1), (8192, 0)):
        hf(s, ck)
with open(os.environ.get("OUT", ".") + "/gpu.json", "w") as f:
    json.dump(R, f, indent=1)
