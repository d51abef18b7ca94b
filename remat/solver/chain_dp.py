"""The DP over a chain of blocks: one option per block, least recompute time under a byte
budget, from per-block costs measured in context (:mod:`remat.solver.chain`, steps 3-4).

It sees only :class:`ChainCosts`, which any executor's measured timeline can fill: the
whole-graph executor's simulation and the ``sac`` executor's traces both do.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

GRID = 4000
"""Bytes kept are rounded up to a grid of budget / GRID in the DP."""


@dataclass(frozen=True)
class ChainCosts:
    """Per-block quantities of one option applied to every block (module docstring, step 3).
    Any executor's measured timeline can fill them: the native path's does too."""

    keep: list[int]
    fw_base: list[int]
    bw_base: list[int]
    tail_base: int
    """Peak of the head, loss and first backward ops, less the bytes all blocks keep."""
    head: int
    """Peak before the first block (embeddings): independent of the plan."""
    time_s: list[float]


class ChainCostsBuilder:
    """Fills :class:`ChainCosts` from a step's moments: per region, the peak of its forward
    and of its backward less the bytes the regions before it keep; outside them, the peak
    before the first region's forward (``head``) and every other one less all the regions
    keep (``tail``); and per region the time its backward recomputes."""

    def __init__(self, keep: list[int]) -> None:
        self.keep = keep
        self._prefix = [0, *itertools.accumulate(keep)]
        self._fw = [0] * len(keep)
        self._bw = [0] * len(keep)
        self._time_s = [0.0] * len(keep)
        self._head = self._tail = 0

    def add(self, phase: str, region: int, value: int, *, before_regions: bool = False) -> None:
        """A moment of ``value`` bytes in ``phase`` of ``region`` (-1: outside the regions;
        ``before_regions``: before the first region's forward)."""
        if region < 0:
            if phase == "forward" and before_regions:
                self._head = max(self._head, value)
            else:
                self._tail = max(self._tail, value - self._prefix[-1])
        elif phase == "forward":
            self._fw[region] = max(self._fw[region], value)
        else:
            self._bw[region] = max(self._bw[region], value)

    def recompute(self, region: int, time_s: float) -> None:
        self._time_s[region] += time_s

    def costs(self) -> ChainCosts:
        n = len(self.keep)
        return ChainCosts(
            keep=self.keep,
            fw_base=[self._fw[k] - self._prefix[k] for k in range(n)],
            bw_base=[self._bw[k] - self._prefix[k] for k in range(n)],
            tail_base=self._tail,
            head=self._head,
            time_s=self._time_s,
        )


def chain_peak(costs: Sequence[ChainCosts], choice: Sequence[int]) -> int:
    """The peak :func:`chain_dp`'s additive model gives ``choice`` (option ``choice[k]`` on
    block ``k``): what the DP checks against the budget, for one choice."""
    held = 0
    peak = max(c.head for c in costs)
    for k, o in enumerate(choice):
        c = costs[o]
        peak = max(peak, held + c.fw_base[k], held + c.bw_base[k])
        held += c.keep[k]
    return max(peak, held + max(c.tail_base for c in costs))


def chain_time(costs: Sequence[ChainCosts], choice: Sequence[int]) -> float:
    """The recompute time :func:`chain_dp` minimises, for one choice."""
    return sum(costs[o].time_s[k] for k, o in enumerate(choice))


def chain_dp(costs: list[ChainCosts], budget: int, n_blocks: int) -> list[int] | None:
    """Least total time choice per block under the additive model, or None if none fits.

    ``costs[o]`` are the per-block quantities of option ``o``; the choice is one option index
    per block."""
    if max(c.head for c in costs) > budget:
        return None
    unit = max(1, math.ceil(budget / GRID))
    # state: quantised bytes kept so far -> (time, choice so far)
    states: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for k in range(n_blocks):
        nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
        for held_q, (t, choice) in states.items():
            held = held_q * unit
            for o, c in enumerate(costs):
                if held + c.fw_base[k] > budget or held + c.bw_base[k] > budget:
                    continue
                q = held_q + math.ceil(c.keep[k] / unit)
                cand = (t + c.time_s[k], (*choice, o))
                if q not in nxt or cand[0] < nxt[q][0]:
                    nxt[q] = cand
        # Drop states dominated by one holding fewer bytes for no more time.
        pruned: dict[int, tuple[float, tuple[int, ...]]] = {}
        best_t = math.inf
        for q in sorted(nxt):
            if nxt[q][0] < best_t:
                pruned[q] = nxt[q]
                best_t = nxt[q][0]
        states = pruned
        if not states:
            return None
    tail = max(c.tail_base for c in costs)
    fits = [(t, ch) for q, (t, ch) in states.items() if q * unit + tail <= budget]
    if not fits:
        return None
    return list(min(fits)[1])
