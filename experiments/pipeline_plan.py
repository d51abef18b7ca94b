"""``remat.plan_pipeline`` on a GPT decoder cut into stages: the README's figures.

``tests.zoo.GPTStage`` stages of 2 blocks (dropout on), 8 microbatches, the a100 roofline
(step times estimated, never measured): 4 stages under 1F1B at stage 2's eager peak per
stage, and 8 stages on 4 ranks under Interleaved1F1B (2 stages per rank) at the least
rank's eager peak per rank. Prints each ``PipelinePlan.summary()``.

    .venv/bin/python experiments/pipeline_plan.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import remat  # noqa: E402
from tests.zoo import GPTStage, pipeline_loss, stage_inputs  # noqa: E402


def plan(
    schedule: str, n: int, budgets: list[int | None] | None = None, per_rank: int = 1
) -> remat.PipelinePlan:
    inputs = [stage_inputs(i) for i in range(n)]
    return remat.plan_pipeline(
        [GPTStage(i, n, layers=2) for i in range(n)],
        [x for x, _ in inputs],
        schedule=schedule,
        microbatches=8,
        loss_fn=pipeline_loss,
        target=inputs[-1][1],
        stage_budgets=budgets,
        stages_per_rank=per_rank,
        block_types=("blocks.*", "*.blocks.*"),
        device_profile="a100",
        time_limit_s=20,
    )


def main() -> None:
    eager = plan("1F1B", 4)
    print(plan("1F1B", 4, [eager.stages[2].eager_peak_bytes] * 4).summary())
    eager = plan("Interleaved1F1B", 8, per_rank=2)
    least = min(s.eager_peak_bytes for s in eager.stages)
    print(plan("Interleaved1F1B", 8, [least] * 4, per_rank=2).summary())


if __name__ == "__main__":
    main()
