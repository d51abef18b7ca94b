"""The pipeline step simulator against hand-computed schedules."""

from __future__ import annotations

import pytest

from remat.solver.stages import RankAction, StageTimes, simulate_pipeline, simulate_ranks


def _gpipe(stages: int, mbs: int) -> list[list[tuple[str, int]]]:
    return [[("F", m) for m in range(mbs)] + [("B", m) for m in range(mbs)]] * stages


def _1f1b(stages: int, mbs: int) -> list[list[tuple[str, int]]]:
    orders = []
    for s in range(stages):
        warm = min(mbs, stages - s)
        order = [("F", m) for m in range(warm)]
        f = warm
        for b in range(mbs):
            order.append(("B", b))
            if f < mbs:
                order.append(("F", f))
                f += 1
        orders.append(order)
    return orders


def test_gpipe_bubble_is_the_textbook_one() -> None:
    """Equal stages, F = 1, B = 2: step (M + P - 1)(F + B), bubble (P - 1) / (M + P - 1)."""
    p, m = 4, 8
    timing = simulate_pipeline(_gpipe(p, m), [StageTimes(1.0, 2.0)] * p)
    assert timing.step_s == (m + p - 1) * 3.0
    assert timing.bubble_share == pytest.approx((p - 1) / (m + p - 1))


def test_1f1b_takes_gpipe_step_and_a_slower_stage_waits_less() -> None:
    p, m = 4, 8
    even = simulate_pipeline(_1f1b(p, m), [StageTimes(1.0, 2.0)] * p)
    assert even.step_s == (m + p - 1) * 3.0
    assert even.bubble_share == pytest.approx((p - 1) / (m + p - 1))
    slow = [StageTimes(1.0, 2.5)] + [StageTimes(1.0, 2.0)] * (p - 1)  # stage 0 recomputes
    slower_first = simulate_pipeline(_1f1b(p, m), slow)
    assert even.step_s < slower_first.step_s <= even.step_s + m * 0.5
    assert slower_first.busy_s[0] == m * 3.5
    assert slower_first.idle_s[0] < even.idle_s[0]


def test_orders_that_wait_forever_are_refused() -> None:
    orders = [[("F", 0), ("B", 0)], [("B", 0), ("F", 0)]]
    with pytest.raises(ValueError, match="cannot all run"):
        simulate_pipeline(orders, [StageTimes(1.0, 1.0)] * 2)


def test_a_rank_holding_two_stages_runs_one_action_at_a_time() -> None:
    """Looped BFS, 2 ranks x 2 stages (rank r holds stages r and r + 2), 2 microbatches,
    F = 1 and B = 2 on every stage: worked by hand, the step is 15 and each rank is busy 12
    (4 forwards, 4 backwards) -- rank 0 waits for rank 1's stages 1 and 3 in between."""

    def rank(r: int) -> list[RankAction]:
        loop = [(s, "F", m) for s in (r, r + 2) for m in (0, 1)]
        loop += [(s, "B", m) for s in (r + 2, r) for m in (0, 1)]
        return [RankAction(s, k, m, 1.0 if k == "F" else 2.0) for s, k, m in loop]

    timing = simulate_ranks([rank(0), rank(1)])
    assert timing.step_s == 15.0
    assert timing.busy_s == (12.0, 12.0)
    assert timing.bubble_share == pytest.approx(6 / 30)
