"""Benchmark (not a test): "will it fit?" for the practitioners' GPU table, and Megatron's
per-layer formula against the one remat derives.

1. ``remat fit`` on the table's model (HF GPT-2 shapes, 24 layers, hidden 2048, 16 heads,
   fp16-mixed, a100 profile, FakeTensorMode) at 80 GB with batch 4, at ``--seq`` 2048 and 8192:
   per plan the longest sequence at batch 4 and the largest batch at that length. Device
   memory is counted as the table counts it: fp32 parameters plus the step (``--optimizer
   none``; AdamW's moments would add 8 B/param, 10.6 GB). Attention is HF's default SDPA with
   ``attn_pdrop=0``, as a GPU run's flash kernel: no s x s tensor, so no s^2 term.
2. The paper's GPT layer (``gptlayer.py``: explicit attention, dropout 0.1), as a 16-bit model:
   ``remat.memory_formula`` of keep-all for 1 and 2 layers; their difference is one layer's
   saved bytes as a polynomial in (b, s), and its coefficients, in units of b*s*h and
   a*b*s^2, stand beside Korthikanti et al.'s s*b*h*(34 + 5*a*s/h).

    python experiments/fit_table.py    # ~4 minutes on 2 cores; results/fit_table.csv, fit_layer.csv
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import sys
import time
from fractions import Fraction
from pathlib import Path

import torch

import remat
from remat.cli import main as cli

sys.path.insert(0, str(Path(__file__).parent))
from gptlayer import Stack

RESULTS = Path(__file__).parent / "results"
MODEL = ["hf:gpt2", "--set", "n_layer=24", "--set", "n_embd=2048", "--set", "n_head=16",
         "--set", "n_positions=16384", "--set", "attn_pdrop=0"]  # fmt: skip
LAYER_CONFIGS = [(1024, 16, 512), (2048, 16, 1024), (4096, 32, 1024)]  # (h, a, example s)


def fit_rows(seq: int) -> list[dict[str, object]]:
    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out):
        code = cli(["fit", *MODEL, "--seq", str(seq), "--batch", "4", "--precision",
                    "fp16-mixed", "--device", "a100", "--budget-gb", "80", "--optimizer",
                    "none", "--json"])  # fmt: skip
    if code != 0:
        raise SystemExit(f"remat fit failed: {out.getvalue()[-2000:]}")
    report = json.loads(out.getvalue())
    print(f"seq {seq}: {time.perf_counter() - t0:.0f} s")
    return [
        {"seq": seq, "plan": name, **{k: v for k, v in row.items() if not isinstance(v, dict)}}
        for name, row in report["plans"].items()
    ]


def layer_terms(h: int, a: int, s: int) -> dict[str, object]:
    saved = []
    for layers in (1, 2):
        torch.set_default_dtype(torch.float16)
        try:
            with remat.fake_mode():
                model = Stack(layers, h, a, 2 * s, p=0.1)  # mask buffer past s: sliced
                x = torch.randn(2, s, h)
        finally:
            torch.set_default_dtype(torch.float32)
        f = remat.memory_formula(model, (x,), plan="keep_all", seq=True, max_seq=2 * s - 1)
        saved.append(next(r for r in f.ranges if r.b_max is None).saved)
    layer = saved[1] - saved[0]
    terms = dict(layer.terms)
    bs, bs2 = Fraction(terms.pop((1, 1), 0)), Fraction(terms.pop((1, 2), 0))
    return {
        "h": h,
        "a": a,
        "layer_saved_bytes": str(layer),
        "bs_coefficient": str(bs),
        "bs_in_h": f"{bs // h} h + {bs % h}",
        "bs2_coefficient": str(bs2),
        "bs2_in_a": str(bs2 / a),
        "other_terms": "; ".join(f"b^{i} s^{j}: {c}" for (i, j), c in terms.items()) or "none",
    }


def write(name: str, rows: list[dict[str, object]]) -> None:
    with (RESULTS / name).open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(r)


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    write("fit_table.csv", fit_rows(2048) + fit_rows(8192))
    write("fit_layer.csv", [layer_terms(h, a, s) for h, a, s in LAYER_CONFIGS])


if __name__ == "__main__":
    main()
