"""remat's two executors against eager at the same saved set, on one CPU thread.

Per model, one process, interleaved rounds (these machines are shared: only ratios within a
round are meaningful), each step timed alone after warm-ups, median over the rounds:

- ``eager``: the unmodified model;
- ``optimize keep_all`` / ``optimize keep_matmuls``: ``remat.optimize(model, plan=...)``,
  remat's whole-graph executor (the traced joint graph, run op by op);
- ``apply keep_all`` / ``apply keep_matmuls``: ``remat.apply(copy, plan=...)``, PyTorch's
  selective checkpointing on the model's blocks.

``keep_all`` recomputes nothing in either, so its ratio is the executor's own overhead.
``keep_matmuls`` keeps the matmul outputs and recomputes the rest: the whole graph's in
``optimize``, each block's (with the attention outputs, torchtitan's policy) in ``apply``,
so the two recompute about the same, not exactly the same. Every variant is first checked bitwise against
eager over one step (outputs and gradients). Writes ``experiments/results/executor_speed.csv``.

    .venv/bin/python experiments/executor_speed.py [--rounds 15] [--models neox,gpt2,llama]
"""

from __future__ import annotations

import os
import sys

_FAST_MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "1000000000000"}
if any(os.environ.get(k) != v for k, v in _FAST_MALLOC.items()):
    # Fresh large allocations page-fault at ~2.5 GB/s with default glibc malloc settings.
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_FAST_MALLOC})

import argparse  # noqa: E402
import copy  # noqa: E402
import csv  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import remat  # noqa: E402
from experiments.compare import _hf  # noqa: E402
from remat._torch_compat import tensor_leaves  # noqa: E402
from remat.measure.meter import training_step  # noqa: E402

RESULTS = Path(__file__).parent / "results"
KWARGS = {"use_cache": False}


def _neox() -> tuple[nn.Module, tuple[Any, ...]]:
    """The GPT-NeoX model of last sessions' measurements (4x256, ffn 1024, seq 256, batch 4)."""
    import transformers as tf

    cfg = tf.GPTNeoXConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=1024,
                           num_attention_heads=4, vocab_size=512, max_position_embeddings=512,
                           hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    return tf.GPTNeoXForCausalLM(cfg).train(), (torch.randint(0, 512, (4, 256)),)


def _llama() -> tuple[nn.Module, tuple[Any, ...]]:
    """Llama 4x256 (GQA 4/2), seq 256, batch 4, with Llama's own MLP ratio (8/3, rounded):
    :func:`experiments.compare._hf` builds a 2x one."""
    import transformers as tf

    cfg = tf.LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=688,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                         max_position_embeddings=256)  # fmt: skip
    return tf.LlamaForCausalLM(cfg).train(), (torch.randint(0, 512, (4, 256)),)


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[Any, ...]]]] = {
    "neox": _neox,
    "gpt2": functools.partial(_hf, "gpt2", 4, 256, 256, 4),  # dropout 0.1, the default
    "llama": _llama,
}


def _step(model: nn.Module, args: tuple[Any, ...]) -> tuple[Any, list[torch.Tensor | None]]:
    """One training step from the same random state: the output and every gradient."""
    torch.manual_seed(0)
    for p in model.parameters():
        p.grad = None
    out = training_step(model, args, KWARGS)
    return out, [p.grad for p in model.parameters()]


def _same(a: Any, b: Any) -> bool:
    (out_a, grads_a), (out_b, grads_b) = a, b
    leaves = zip(tensor_leaves(out_a), tensor_leaves(out_b), strict=True)
    same_out = all(torch.equal(x, y) for x, y in leaves)
    same_grads = all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(grads_a, grads_b, strict=True)
    )
    return same_out and same_grads


def _variants(model: nn.Module, args: tuple[Any, ...]) -> dict[str, nn.Module]:
    out: dict[str, nn.Module] = {"eager": model}
    for plan in ("keep_all", "keep_matmuls"):
        out[f"optimize {plan}"] = remat.optimize(model, args, plan=plan, example_kwargs=KWARGS)
        applied = copy.deepcopy(model)
        remat.apply(applied, args, example_kwargs=KWARGS, plan=plan)
        out[f"apply {plan}"] = applied
    return out


def measure(name: str, rounds: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model, args = MODELS[name]()
    variants = _variants(model, args)
    reference = _step(model, args)
    bitwise = {k: _same(reference, _step(m, args)) for k, m in variants.items()}
    for m in variants.values():  # warm-ups
        for _ in range(2):
            _step(m, args)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for k, m in variants.items():
            for p in m.parameters():
                p.grad = None
            t0 = time.perf_counter()
            training_step(m, args, KWARGS)
            times[k].append(time.perf_counter() - t0)
    eager = statistics.median(times["eager"])
    return [
        {
            "model": name,
            "variant": k,
            "median_ms": round(1e3 * statistics.median(ts), 2),
            "ratio": round(statistics.median(ts) / eager, 4),
            "bitwise": bitwise[k],
        }
        for k, ts in times.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--models", default=",".join(MODELS))
    ns = parser.parse_args()
    torch.set_num_threads(1)
    rows = [r for name in ns.models.split(",") for r in measure(name, ns.rounds)]
    table = Table(title=f"step time / eager, 1 thread, median of {ns.rounds} interleaved rounds")
    for col in ("model", "variant", "median ms", "ratio", "bitwise"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["model"], r["variant"], f"{r['median_ms']:.1f}", f"{r['ratio']:.3f}",
                      str(r["bitwise"]))  # fmt: skip
    Console().print(table)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "executor_speed.csv"
    measured = {r["model"] for r in rows}
    if path.exists():  # a --models subset replaces its own models' rows, keeps the others'
        with path.open() as f:
            kept = [r for r in csv.DictReader(f) if r["model"] not in measured]
        order = list(MODELS)
        rows = sorted([*kept, *rows], key=lambda r: order.index(r["model"]))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
