"""``remat.apply``'s ``auto`` with regions on the blocks only against regions that may also be
the blocks' sub-modules (what ``auto`` does), at three budgets between every block recomputed
and no checkpointing, on the zoo's decoders: each plan's traced recompute time (the CPU
profile's roofline estimate, not a wall-clock measurement).

The blocks-only run replaces :func:`remat.executors.sac.regions.split_blocks` with one that finds no
sub-modules. Writes ``experiments/results/regions.csv``.

    .venv/bin/python experiments/regions.py
"""

from __future__ import annotations

import copy
import csv
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import remat  # noqa: E402
import remat.executors.sac.regions as regions  # noqa: E402
from tests.zoo import NATIVE_ZOO  # noqa: E402

DECODERS = ("hf_gpt2", "hf_llama_gqa", "hf_bert", "hf_mixtral_moe")
SHARES = (0.25, 0.5, 0.75)


def main() -> None:
    split = regions.split_blocks
    rows = []
    for case in (c for c in NATIVE_ZOO if c.name in DECODERS):
        torch.manual_seed(0)
        model, args = case.build().train(), case.inputs()

        def peak(plan: str) -> int:
            applied = remat.apply(copy.deepcopy(model), args, plan=plan)  # noqa: B023
            return remat.plan_of(applied).predicted_peak_bytes

        eager, block = peak("keep_all"), peak("block")
        for share in SHARES:
            budget = int(block + share * (eager - block))
            ms = {}
            for label, finder in (("blocks", lambda m, b: ()), ("sub-modules", split)):
                regions.split_blocks = finder
                try:
                    plan = remat.plan_of(
                        remat.apply(copy.deepcopy(model), args, activation_budget_bytes=budget,
                                    time_limit_s=10)
                    )  # fmt: skip
                finally:
                    regions.split_blocks = split
                ms[label] = plan.simulation.recompute_time_s * 1e3
            rows.append({"model": case.name, "budget_bytes": budget, "share": share,
                         "blocks_ms": round(ms["blocks"], 4),
                         "with_sub_modules_ms": round(ms["sub-modules"], 4)})  # fmt: skip
            print(rows[-1], flush=True)
    out = Path(__file__).parent / "results" / "regions.csv"
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
