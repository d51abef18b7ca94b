"""Benchmark (not a test): a run whose sequence length varies, three ways, side by side.

* ``per length``: ``remat.optimize`` at the example's length; every new length plans again
  (a warning, a capture and a solve), today's behaviour without ``max_seq``;
* ``max_seq``: ``remat.optimize(..., max_seq=N)``, one plan solved at the longest length and
  checked over all of them by its exact formula; a new length is only captured;
* ``buckets``: ``seq_buckets=(...)``, one plan per bucket, each solved at its longest length.

The same model, budget, solver and 20 random lengths for the three. Per strategy: solves,
planning seconds (``optimize`` plus every compile during the run), the largest measured
allocator peak of the run against the budget, the predicted peak against the measured one at
every length (allocator accounting, ``remat.measure.meter.measure_step``), and the recompute the plans
cost summed over the run (the plans' own time estimates). Steps are checked bitwise against
the eager model at every length.

    python experiments/lengths.py          # ~10 min on 2 cores; writes results/lengths.csv
"""

from __future__ import annotations

import argparse
import copy
import csv
import random
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import remat
from remat.executors.graph.analyze import analyze
from remat.measure.meter import measure_step, training_step
from remat.solver.registry import solve

OUT = Path(__file__).parent / "results" / "lengths.csv"


def gpt2(layers: int, hidden: int, positions: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=4, n_positions=positions, vocab_size=512)
    return GPT2LMHeadModel(cfg).train()


def tokens(b: int, s: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 512, (b, s), generator=torch.Generator().manual_seed(seed))


def run(strategy: str, args: argparse.Namespace, lengths: list[int], budget: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = gpt2(args.layers, args.hidden, args.max_seq)
    eager = copy.deepcopy(model)
    extra: dict[str, Any] = {}
    if strategy == "max_seq":
        extra = {"max_seq": args.max_seq}
    elif strategy == "buckets":
        extra = {"max_seq": args.max_seq, "seq_buckets": tuple(args.buckets)}
    t0 = time.perf_counter()
    fast = remat.optimize(
        model,
        (tokens(args.batch, args.example_seq, 1),),
        activation_budget_bytes=budget,
        time_limit_s=args.time_limit,
        **extra,
    )
    planning = time.perf_counter() - t0
    replans = 0
    exact = bitwise = 0
    worst = 0
    recompute = 0.0
    for step, s in enumerate(lengths):
        x = tokens(args.batch, s, 100 + step)
        torch.manual_seed(step)
        expected = training_step(eager, (x,), seed=step)
        for p in eager.parameters():
            p.grad = None
        t1 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fast._compiled_for((x,), {})  # compile outside the measured step
        planning += time.perf_counter() - t1
        replans += sum("planning again" in str(w.message) for w in caught)
        torch.manual_seed(step)
        measured = measure_step(fast, (x,), seed=step, allocator=True)
        plan = fast._compiled_for((x,), {}).executor.plan
        bitwise += all(torch.equal(a, b) for a, b in zip(expected, measured.outputs, strict=True))
        assert measured.allocator_peak_bytes is not None
        exact += measured.allocator_peak_bytes == plan.predicted_peak_bytes
        worst = max(worst, measured.allocator_peak_bytes)
        recompute += plan.recompute_time_s
        for p in fast.parameters():
            p.grad = None
    plans = fast.lengths
    solves = (plans.solves if plans is not None else 1) + replans
    return {
        "strategy": strategy,
        "solves": solves,
        "planning_s": round(planning, 2),
        "fit_s": round(plans.fit_seconds, 2) if plans is not None else 0.0,
        "max_allocator_peak": worst,
        "budget": budget,
        "predicted_eq_measured": f"{exact}/{len(lengths)}",
        "bitwise_outputs": f"{bitwise}/{len(lengths)}",
        "recompute_ms": round(recompute * 1e3, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--example-seq", type=int, default=128)
    ap.add_argument("--max-seq", type=int, default=512)
    ap.add_argument("--buckets", type=int, nargs="+", default=[128, 256, 384])
    ap.add_argument("--fraction", type=float, default=0.6, help="of keep-all's peak at max_seq")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--lengths", type=int, default=20)
    ap.add_argument("--strategies", default="per length,max_seq,buckets")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    lengths = [rng.randint(16, args.max_seq) for _ in range(args.lengths)]
    torch.manual_seed(0)
    model = gpt2(args.layers, args.hidden, args.max_seq)
    keep_all = solve(
        analyze(model, (tokens(args.batch, args.max_seq, 0),)).problem,
        solver="keep_all",
        budget_bytes=None,
    ).predicted_peak_bytes
    budget = int(args.fraction * keep_all)
    print(f"GPT-2 {args.layers}x{args.hidden}, batch {args.batch}, lengths {lengths}")
    print(f"budget {budget:,} B = {args.fraction} x keep-all at {args.max_seq} ({keep_all:,} B)")
    rows = []
    for strategy in args.strategies.split(","):
        row = run(strategy, args, lengths, budget)
        print(row, flush=True)
        rows.append(row)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    base = rows[0]
    for r in rows[1:]:
        print(
            f"{r['strategy']}: {r['solves']} solves against {base['solves']}; planning "
            f"{r['planning_s'] / base['planning_s']:.2f}x; recompute "
            f"{r['recompute_ms'] / max(base['recompute_ms'], 1e-9):.2f}x of {base['strategy']}"
        )
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
