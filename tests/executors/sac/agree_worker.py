"""One rank of the plan-agreement check (spawned by ``test_agree.py``): ``remat.apply``
under a gloo group, where rank 0 solves and the others apply its broadcast plan."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import remat
from remat.models import TinyGPT


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyGPT(vocab=64, dim=32, heads=2, layers=2, seq=32)


def _outcome(fn: Any) -> dict[str, Any]:
    try:
        plan = remat.plan_of(fn())
    except Exception as e:  # what each rank saw, for the test to check
        return {"error": type(e).__name__, "message": str(e)}
    return {"saved": sorted(plan.saved), "reason": plan.reason, "peak": plan.predicted_peak_bytes}


def main(rank: int, world: int, budget: int, out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(rank))
    try:
        results = {
            # The same step on every rank (their batches differ in values only).
            "same": _outcome(lambda: remat.apply(_model(), tokens, activation_budget_bytes=budget)),
            # Rank 1 traces a shorter sequence than rank 0 planned for.
            "differs": _outcome(
                lambda: remat.apply(
                    _model(), tokens[:, : 32 - 16 * rank], activation_budget_bytes=budget
                )
            ),
            # No plan fits: rank 0's error reaches rank 1.
            "fails": _outcome(lambda: remat.apply(_model(), tokens, activation_budget_bytes=1)),
        }
        torch.save(results, Path(out) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()
