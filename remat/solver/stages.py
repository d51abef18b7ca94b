"""A pipeline's step time from each stage's action order and per-microbatch times.

Recompute lengthens a stage's backwards; what that costs the step depends on where the stage
waits anyway. Each stage runs its actions in its own order (as its schedule ran them); a
forward of microbatch m starts once the previous stage's forward of m is done, a backward
once the next stage's backward of m is, and its own forward of m (transfers take no time
here). The step ends with the
last action; a stage's idle time is the step minus its busy time, and the bubble share is the
idle share of all the stages' time together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PipelineTiming", "StageTimes", "simulate_pipeline"]


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


def simulate_pipeline(
    orders: Sequence[Sequence[tuple[str, int]]], times: Sequence[StageTimes]
) -> PipelineTiming:
    """The step of stages running ``orders[s]`` (``("F", m)``, ``("B", m)``) with
    ``times[s]``. Raises ``ValueError`` on orders that cannot all run (a stage waiting on
    an action that never comes)."""
    if len(orders) != len(times):
        raise ValueError(f"{len(orders)} stage orders for {len(times)} stages' times")
    n = len(orders)
    done: dict[tuple[int, str, int], float] = {}
    free = [0.0] * n
    busy = [0.0] * n
    nxt = [0] * n
    while any(nxt[s] < len(orders[s]) for s in range(n)):
        progressed = False
        for s in range(n):
            while nxt[s] < len(orders[s]):
                kind, mb = orders[s][nxt[s]]
                deps = [(s - 1, "F", mb)] if kind == "F" else [(s + 1, "B", mb), (s, "F", mb)]
                deps = [d for d in deps if 0 <= d[0] < n]
                if any(d not in done for d in deps):
                    break
                start = max([free[s], *(done[d] for d in deps)])
                took = times[s].forward_s if kind == "F" else times[s].backward_s
                free[s] = done[(s, kind, mb)] = start + took
                busy[s] += took
                nxt[s] += 1
                progressed = True
        if not progressed:
            waiting = [orders[s][nxt[s]] for s in range(n) if nxt[s] < len(orders[s])]
            raise ValueError(f"the stages' orders cannot all run: waiting at {waiting}")
    return PipelineTiming(max(free, default=0.0), tuple(busy))
