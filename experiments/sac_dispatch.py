"""Benchmark (not a test): what PyTorch's selective checkpointing costs per op by itself, on
one CPU thread, run as ``remat.apply`` runs it (remat's own policy, early stop). These are
the figures the ``cpu`` profile's :class:`remat.problem.DispatchCosts` pins.

A region of ``N`` tiny ops (``sin`` on 16 floats: the kernels cost little, so what differs
is dispatch; ``sin`` saves its input, so the backward needs the replay), run as:

- ``eager``: no checkpoint;
- ``keep all``: a checkpoint whose policy keeps every op (``MUST_SAVE``): the forward
  caches each output, the replay returns them (cache hits);
- ``recompute all``: the policy keeps nothing (``PREFER_RECOMPUTE``): the replay re-runs
  every op.

Each variant's forward alone and its step (forward and backward) are timed, interleaved over
``--rounds`` rounds (these machines are shared: only differences within a round mean
anything), median per round, at two region lengths (``--ops`` and a tenth of it). The
excess over eager, split by the two lengths into a per-op slope and a per-region intercept:

- ``forward_saved_s`` / ``forward_recomputed_s``: the policy called on an op it keeps
  (and its output cached) / recomputes, in the forward;
- ``replay_hit_s``: the policy called again in the replay on a kept op (its cached output
  returned);
- ``replay_recomputed_s``: the same on a recomputed op, beyond the op's own time (eager
  forward per op, which the roofline already counts);
- ``region_s``: per checkpointed region call (frame, contexts, the replay's start).

Writes ``experiments/results/sac_dispatch.csv``.

    .venv/bin/python experiments/sac_dispatch.py [--ops 200] [--rounds 21]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.rows import save, show  # noqa: E402
from remat.executors.sac.regions import policy_contexts  # noqa: E402

Region = Callable[[torch.Tensor], torch.Tensor]


def _region(ops: int) -> Region:
    def run(x: torch.Tensor) -> torch.Tensor:
        for _ in range(ops):
            x = torch.sin(x)
        return x

    return run


def _variants(ops: int) -> dict[str, Region]:
    region = _region(ops)
    every = frozenset(("aten.sin.default", k) for k in range(ops))

    def sac(keep: frozenset[tuple[str, int]]) -> Region:
        context = functools.partial(policy_contexts, keep)
        return lambda x: checkpoint(region, x, use_reentrant=False, context_fn=context)

    return {"eager": region, "keep all": sac(every), "recompute all": sac(frozenset())}


def _time(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def _measure(lengths: tuple[int, ...], rounds: int) -> dict[tuple[int, str, str], float]:
    """Median seconds per (length, variant, forward|step) over interleaved rounds."""
    x = torch.randn(16, requires_grad=True)
    variants = {n: _variants(n) for n in lengths}
    times: dict[tuple[int, str, str], list[float]] = {}
    for _ in range(rounds):
        for n, fns in variants.items():
            for name, fn in fns.items():
                times.setdefault((n, name, "forward"), []).append(_time(lambda fn=fn: fn(x)))
                times.setdefault((n, name, "step"), []).append(
                    _time(lambda fn=fn: fn(x).sum().backward())
                )
    return {k: statistics.median(v) for k, v in times.items()}


def _split(at: Callable[[int], float], short: int, long: int) -> tuple[float, float]:
    """A quantity measured at two region lengths as ``(per op, per region)``."""
    slope = (at(long) - at(short)) / (long - short)
    return slope, at(short) - short * slope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(1)
    short, long = max(args.ops // 10, 2), args.ops
    t = _measure((short, long), args.rounds)

    def forward(variant: str) -> Callable[[int], float]:
        return lambda n: t[n, variant, "forward"] - t[n, "eager", "forward"]

    def backward(variant: str) -> Callable[[int], float]:
        def excess(n: int) -> float:
            mine = t[n, variant, "step"] - t[n, variant, "forward"]
            return mine - (t[n, "eager", "step"] - t[n, "eager", "forward"])

        return excess

    def rerun(n: int) -> float:  # the replayed ops' own time, as eager runs them
        return backward("recompute all")(n) - t[n, "eager", "forward"]

    figures = {
        "forward_saved_s": _split(forward("keep all"), short, long),
        "forward_recomputed_s": _split(forward("recompute all"), short, long),
        "replay_hit_s": _split(backward("keep all"), short, long),
        "replay_recomputed_s": _split(rerun, short, long),
        "eager op (reference)": _split(lambda n: t[n, "eager", "forward"], short, long),
    }
    rows = [
        {"figure": name, "per op us": f"{1e6 * op:.2f}", "per region us": f"{1e6 * region:.2f}"}
        for name, (op, region) in figures.items()
    ]
    show(
        rows,
        f"SAC's own cost: regions of {short} and {long} sin ops on 16 floats, remat's policy, "
        f"1 thread, {args.rounds} rounds",
    )
    print(save(rows, "sac_dispatch.csv"))


if __name__ == "__main__":
    main()
