"""A pipeline's step time from each rank's action order and per-action times.

Recompute lengthens a stage's backwards; what that costs the step depends on where the stage
waits anyway. Each rank runs its actions in its own order (as its schedule ran them; under a
multi-stage schedule a rank holds several stages, and runs one action at a time across
them); a forward of microbatch m on stage s starts once stage s - 1's forward of m is done, a
backward once stage s + 1's backward of m is, and stage s's own forward of m (transfers take
no time here). The step ends with the last action; a rank's idle time is the step minus its
busy time, and the bubble share is the idle share of all the ranks' time together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PipelineTiming", "RankAction", "StageTimes", "simulate_pipeline", "simulate_ranks"]


@dataclass(frozen=True)
class StageTimes:
    """One microbatch's forward and backward time on a stage (the backward with what the
    stage's plan recomputes)."""

    forward_s: float
    backward_s: float


@dataclass(frozen=True)
class PipelineTiming:
    step_s: float
    busy_s: tuple[float, ...]

    @property
    def idle_s(self) -> tuple[float, ...]:
        return tuple(self.step_s - b for b in self.busy_s)

    @property
    def bubble_share(self) -> float:
        total = self.step_s * len(self.busy_s)
        return sum(self.idle_s) / total if total else 0.0


@dataclass(frozen=True)
class RankAction:
    """One action of a rank: the forward (``F``) or backward (``B``) of ``microbatch`` on
    ``stage``, taking ``time_s``."""

    stage: int
    kind: str
    microbatch: int
    time_s: float


def simulate_pipeline(
    orders: Sequence[Sequence[tuple[str, int]]], times: Sequence[StageTimes]
) -> PipelineTiming:
    """The step of stages, one per rank, running ``orders[s]`` (``("F", m)``, ``("B", m)``)
    with ``times[s]``: :func:`simulate_ranks` with stage ``s`` on rank ``s``."""
    if len(orders) != len(times):
        raise ValueError(f"{len(orders)} stage orders for {len(times)} stages' times")
    return simulate_ranks(
        [
            [
                RankAction(s, kind, mb, t.forward_s if kind == "F" else t.backward_s)
                for kind, mb in order
            ]
            for s, (order, t) in enumerate(zip(orders, times, strict=True))
        ]
    )


def simulate_ranks(orders: Sequence[Sequence[RankAction]]) -> PipelineTiming:
    """The step of ranks running ``orders[r]`` each, in order (the module docstring);
    ``busy_s`` per rank. Raises ``ValueError`` on orders that cannot all run (a rank waiting
    on an action that never comes)."""
    n_stages = 1 + max((a.stage for order in orders for a in order), default=-1)
    done: dict[tuple[int, str, int], float] = {}
    free = [0.0] * len(orders)
    busy = [0.0] * len(orders)
    nxt = [0] * len(orders)
    while any(nxt[r] < len(order) for r, order in enumerate(orders)):
        progressed = False
        for r, order in enumerate(orders):
            while nxt[r] < len(order):
                a = order[nxt[r]]
                s, mb = a.stage, a.microbatch
                deps = [(s - 1, "F", mb)] if a.kind == "F" else [(s + 1, "B", mb), (s, "F", mb)]
                deps = [d for d in deps if 0 <= d[0] < n_stages]
                if any(d not in done for d in deps):
                    break
                start = max([free[r], *(done[d] for d in deps)])
                free[r] = done[(s, a.kind, mb)] = start + a.time_s
                busy[r] += a.time_s
                nxt[r] += 1
                progressed = True
        if not progressed:
            waiting = [
                f"rank {r}: {o[nxt[r]].stage}{o[nxt[r]].kind}{o[nxt[r]].microbatch}"
                for r, o in enumerate(orders)
                if nxt[r] < len(o)
            ]
            raise ValueError(f"the ranks' orders cannot all run: waiting at {waiting}")
    return PipelineTiming(max(free, default=0.0), tuple(busy))
