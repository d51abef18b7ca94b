"""remat's native plans (SAC policies on the model's own blocks) against what users write by
hand, at matched measured peak, on one CPU.

Peers, each applied to the model's own blocks:

- ``every block``: each block fully recomputed (``checkpoint`` around it; what Hugging Face's
  ``gradient_checkpointing_enable()`` does, measured with HF's own switch on HF models);
- ``selective op``: each block keeps the outputs of its ops with FLOPs (matmuls,
  convolutions, attention) and recomputes the rest (``keep_matmuls``; torchtitan's own policy
  recomputes every second matmul and CPU attention: ``torchtitan_op``);
- ``torch budget F``: ``torch.compile`` with the min-cut partitioner under
  ``activation_memory_budget = F`` (``--partitioner``; compiled, so not the same executor).

For each peer, remat is asked for exactly the peer's measured allocator peak (where a step
runs out of memory; remat's prediction is at that level). Columns: live peak and allocator
peak (MiB), remat's prediction, recompute GFLOP (FlopCounterMode over the whole step, minus eager's), step time over
eager (one thread, interleaved rounds, one process), and whether outputs and every gradient
are bitwise eager's. Writes ``experiments/results/native/<model>.csv``.

    .venv/bin/python experiments/native.py --models gpt2_small,llama,bert
"""

from __future__ import annotations

import argparse
import copy
import csv
import functools
import gc
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import remat  # noqa: E402
from experiments import peers  # noqa: E402
from experiments.compare import _hf, _tiny_gpt  # noqa: E402

MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[Any, ...]]]] = {
    "tiny": functools.partial(_tiny_gpt, 3, 64, 128, 4),
    "gpt2_small": functools.partial(_hf, "gpt2", 12, 768, 256, 2),
    "llama": functools.partial(_hf, "llama", 8, 512, 512, 2),
    "bert": functools.partial(_hf, "bert", 12, 768, 256, 2),
}
RESULTS = Path(__file__).parent / "results" / "native"


def _applied(model: nn.Module, args: tuple[Any, ...], **opts: Any) -> nn.Module:
    m = copy.deepcopy(model)
    remat.apply(m, args, **opts)
    return m


def _hf_every_layer(model: nn.Module) -> nn.Module | None:
    if not hasattr(model, "gradient_checkpointing_enable"):
        return None
    return peers.hf_checkpointed(model)


def run(name: str, reps: int, time_limit: float, partitioner: bool) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model, args = MODELS[name]()
    ref = peers.eager_reference(model, args)
    rows: list[dict[str, Any]] = []
    steps: dict[str, Callable[[], Any]] = {}

    def add(peer: str, module: nn.Module, solver: str, predicted: int | None) -> None:
        row = peers._row(peer, "", module, module, args, ref, None)
        flops = peers.step_flops(module, args) - ref.flops
        rows.append(
            {
                "model": name,
                "peer": peer,
                "solver": solver,
                "peak_mib": row.peak_bytes / 2**20,
                "predicted_mib": None if predicted is None else predicted / 2**20,
                "allocator_mib": row.allocator_peak_bytes / 2**20,
                "recompute_gflop": flops / 1e9,
                "bitwise": row.equal,
                "peak_bytes": row.peak_bytes,
                "allocator_bytes": row.allocator_peak_bytes,
            }
        )
        steps[peer] = functools.partial(peers.step, module, args)

    eager = copy.deepcopy(model)
    add("eager", eager, "", None)
    hf = _hf_every_layer(model)
    every = hf if hf is not None else _applied(model, args, plan="block")
    add("every block", every, "hf" if hf is not None else "native:block", None)
    add("selective op", _applied(model, args, plan="keep_matmuls"), "native:keep_matmuls", None)
    if partitioner:
        for fraction in (0.1, 0.5):
            compiled = peers.memory_budget_step(model, args, fraction)
            row = peers.memory_budget_peer(model, args, fraction, ref)
            rows.append(
                {
                    "model": name,
                    "peer": f"torch budget {fraction:g}",
                    "solver": "compiled",
                    "peak_mib": row.peak_bytes / 2**20,
                    "predicted_mib": None,
                    "allocator_mib": row.allocator_peak_bytes / 2**20,
                    "recompute_gflop": (row.recompute_flops or 0) / 1e9,
                    "bitwise": row.equal,
                    "peak_bytes": row.peak_bytes,
                    "allocator_bytes": row.allocator_peak_bytes,
                }
            )
            steps[f"torch budget {fraction:g}"] = compiled
    for peer_row in [r for r in rows if r["peer"] != "eager"]:
        target = peer_row["allocator_bytes"]
        label = f"remat @ {peer_row['peer']}"
        try:
            m = _applied(model, args, activation_budget_bytes=target, time_limit_s=time_limit)
        except remat.BudgetError as e:
            rows.append({"model": name, "peer": label, "solver": f"infeasible: {e}"})
            continue
        add(label, m, remat.plan_of(m).solver, remat.plan_of(m).predicted_peak_bytes)
    ratios = peers.time_ratio(steps, reps=reps)
    for r in rows:
        r["time_x"] = ratios.get(r["peer"])
    return rows


def show(console: Console, rows: list[dict[str, Any]]) -> None:
    table = Table(title=rows[0]["model"])
    for col in (
        "peer",
        "peak MiB",
        "predicted",
        "allocator",
        "recompute GFLOP",
        "time x",
        "bitwise",
    ):
        table.add_column(col)
    for r in rows:
        if "peak_mib" not in r:
            table.add_row(r["peer"], r["solver"], "", "", "", "", "")
            continue
        table.add_row(
            r["peer"],
            f"{r['peak_mib']:.2f}",
            "" if r["predicted_mib"] is None else f"{r['predicted_mib']:.2f}",
            f"{r['allocator_mib']:.2f}",
            f"{r['recompute_gflop']:.3f}",
            "" if r.get("time_x") is None else f"{r['time_x']:.2f}x",
            "yes" if r["bitwise"] else "NO",
        )
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--partitioner", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    opts = parser.parse_args(argv)
    console = Console(width=140)
    opts.out.mkdir(parents=True, exist_ok=True)
    for name in opts.models.split(","):
        rows = run(name, opts.reps, opts.time_limit, opts.partitioner)
        show(console, rows)
        fields = sorted({k for r in rows for k in r})
        with open(opts.out / f"{name}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
        gc.collect()


if __name__ == "__main__":
    main()
