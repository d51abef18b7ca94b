"""Benchmark (not a test): does the ``sac`` executor's predicted step time order plans as the
clock does? On the zoo's models and torchtitan's Llama 3 debugmodel (with its trainer's
loss; skipped where torchtitan is not installed), ``remat.apply`` makes several plans: the
fixed ones (``keep_all``, ``keep_matmuls``, ``block``; ``torchtitan_op`` on torchtitan's
model) and ``auto`` at the least budget and halfway to the eager peak. Each plan's step is
timed on one thread, interleaved over ``--reps`` rounds (median), beside its predicted step
time, with and without SAC's own dispatch (:class:`remat.problem.DispatchCosts`, the
``cpu`` profile's).

For every pair of plans of one model whose measured times are at least 10% apart, the check
is whether the prediction orders them the same way. Per model: the pairs, how many of them
the prediction with dispatch orders right, and how many the prediction without it (the time
model before dispatch was counted) does. Writes ``experiments/results/step_order.csv``.

    .venv/bin/python experiments/step_order.py [--reps 7] [--models tiny_gpt,hf_gpt2,...]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import remat  # noqa: E402
from experiments import peers  # noqa: E402
from experiments.rows import save, show  # noqa: E402
from remat.measure.meter import Loss, training_step  # noqa: E402
from tests.zoo import NATIVE_ZOO  # noqa: E402

APART = 1.10
"""Pairs whose measured step times are at least this far apart are checked."""

FIXED = ("keep_all", "keep_matmuls", "block")


@dataclass(frozen=True)
class Model:
    name: str
    build: Callable[[], nn.Module]
    args: tuple[Any, ...]
    options: dict[str, Any]
    """``remat.apply``'s step options (``loss_fn``, ``target``)."""
    fixed: tuple[str, ...] = FIXED


def _zoo(names: list[str]) -> list[Model]:
    return [
        Model(c.name, c.build, c.inputs(), {"example_kwargs": c.kwargs} if c.kwargs else {})
        for c in NATIVE_ZOO
        if c.name in names
    ]


def _titan() -> list[Model]:
    try:
        from experiments import torchtitan_duel as duel

        duel.build()
    except ImportError:
        print("torchtitan is not installed: its model is skipped (pip install -e '.[titan]')")
        return []
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 2048, (2, 256), generator=g)
    labels = torch.randint(0, 2048, (2, 256), generator=g)
    options = {"loss_fn": duel.titan_loss, "target": labels}
    return [Model("torchtitan_llama3", duel.build, (tokens,), options, (*FIXED, "torchtitan_op"))]


def _least(model: Model) -> int:
    try:
        remat.apply(model.build(), model.args, activation_budget_bytes=1, **model.options)
    except remat.BudgetError as e:
        return e.least_peak_bytes
    raise AssertionError("a 1-byte budget fitted")


def _plans(model: Model) -> dict[str, nn.Module]:
    """Each plan's model, applied."""
    plans: dict[str, nn.Module] = {}
    for fixed in model.fixed:
        plans[fixed] = remat.apply(model.build(), model.args, plan=fixed, **model.options)
    least = _least(model)
    eager = remat.plan_of(plans["keep_all"]).predicted_peak_bytes
    for label, budget in (("auto @ least", least), ("auto @ mid", (least + eager) // 2)):
        plans[label] = remat.apply(
            model.build(), model.args, activation_budget_bytes=budget, **model.options
        )
    return plans


def _stepper(model: Model, module: nn.Module) -> Callable[[], object]:
    loss = (
        Loss(model.options["loss_fn"], model.options["target"])
        if "loss_fn" in model.options
        else None
    )
    kwargs = model.options.get("example_kwargs")

    def step() -> object:
        for p in module.parameters():
            p.grad = None
        return training_step(module, model.args, kwargs, loss=loss)

    return step


def _agree(a: float, b: float, x: float, y: float) -> bool:
    return (a < b) == (x < y)


def run(models: list[Model], reps: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    for model in models:
        plans = _plans(model)
        measured = peers.step_times({k: _stepper(model, m) for k, m in plans.items()}, reps)
        predicted: dict[str, tuple[float, float]] = {}
        for name, module in plans.items():
            sim = remat.plan_of(module).simulation
            predicted[name] = (sim.step_time_s, sim.step_time_s - sim.dispatch_time_s)
            rows.append(
                {
                    "model": model.name,
                    "plan": name,
                    "measured ms": f"{measured[name] * 1e3:.2f}",
                    "predicted ms": f"{sim.step_time_s * 1e3:.2f}",
                    "of which dispatch ms": f"{sim.dispatch_time_s * 1e3:.2f}",
                    "recompute ms": f"{sim.recompute_time_s * 1e3:.2f}",
                }
            )
        pairs = [
            (a, b)
            for a, b in itertools.combinations(plans, 2)
            if max(measured[a], measured[b]) >= APART * min(measured[a], measured[b])
        ]

        right = [
            [
                (a, b)
                for a, b in pairs
                if _agree(measured[a], measured[b], predicted[a][i], predicted[b][i])
            ]
            for i in (0, 1)
        ]
        wrong = [p for p in pairs if p not in right[0]]
        summary.append(
            {
                "model": model.name,
                "pairs 10% apart": len(pairs),
                "ordered right, with dispatch": len(right[0]),
                "ordered right, without": len(right[1]),
                "misordered with dispatch": "; ".join(f"{a} / {b}" for a, b in wrong),
            }
        )
    return rows, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--models", default=",".join(c.name for c in NATIVE_ZOO))
    parser.add_argument("--no-titan", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    models = _zoo(args.models.split(",")) + ([] if args.no_titan else _titan())
    rows, summary = run(models, args.reps)
    show(rows, "Step time per plan: measured (1 thread, interleaved) and predicted")
    show(summary, f"Pairs of plans measured at least {APART - 1:.0%} apart: ordered right?")
    print(save(rows, "step_order.csv"))
    print(save(summary, "step_order_pairs.csv"))


if __name__ == "__main__":
    main()
