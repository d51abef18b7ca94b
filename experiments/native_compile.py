"""A model prepared with ``remat.apply``, compiled with Inductor: its step's allocator peak
beside remat's (eager) prediction, for no checkpoint and two budgets.

    .venv/bin/python experiments/native_compile.py

Inductor fuses and frees earlier than eager, so the prediction (the eager step's, exact for
the live meter) bounds the compiled step rather than predicting it.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import remat  # noqa: E402
from remat import _torch_compat as tc  # noqa: E402
from remat.measure.meter import allocator_peak_bytes, measure_step, training_step  # noqa: E402
from remat.models import TinyGPT  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab=128, dim=64, heads=4, layers=2, seq=64)
    tokens = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(1))
    eager = measure_step(copy.deepcopy(model), (tokens,)).peak_bytes
    print(f"{'budget':>12} {'plan':>16} {'predicted':>10} {'eager live':>10} "
          f"{'eager alloc':>11} {'compiled alloc':>14}")  # fmt: skip
    with tc.inductor_config(fallback_random=True), tc.compile_caches_off():
        for budget in (None, eager * 3 // 4, 1):
            try:
                work = remat.apply(copy.deepcopy(model), tokens, activation_budget_bytes=budget)
            except remat.BudgetError as e:  # 1 byte: the least peak a native plan reaches
                budget = e.least_peak_bytes
                work = remat.apply(copy.deepcopy(model), tokens, activation_budget_bytes=budget)
            plan = remat.plan_of(work)
            tc.dynamo_reset()
            compiled = torch.compile(work)
            training_step(compiled, (tokens,))  # compiles
            for p in work.parameters():
                p.grad = None
            compiled_alloc = allocator_peak_bytes(lambda c=compiled: training_step(c, (tokens,)))
            for p in work.parameters():
                p.grad = None
            eager_alloc = allocator_peak_bytes(lambda w=work: training_step(w, (tokens,)))
            for p in work.parameters():
                p.grad = None
            live = measure_step(work, (tokens,)).peak_bytes
            print(f"{budget or '-':>12} {plan.solver:>16} {plan.predicted_peak_bytes:>10,} "
                  f"{live:>10,} {eager_alloc:>11,} {compiled_alloc:>14,}")  # fmt: skip


if __name__ == "__main__":
    main()
