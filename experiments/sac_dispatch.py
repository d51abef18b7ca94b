"""Benchmark (not a test): what PyTorch's selective checkpointing costs per op by itself, on
one CPU thread. The ``sac`` executor's time model counts recomputed ops only; this measures
the rest: the policy called on every op of a checkpointed region in the forward, and the
region's replay in the backward, where a saved op returns its cached output.

A region of ``--ops`` tiny ops (an elementwise multiply on 16 floats: the kernels cost
little, so what differs is dispatch), run as:

- ``eager``: no checkpoint;
- ``sac save all``: ``checkpoint(..., context_fn=create_selective_checkpoint_contexts(
  MUST_SAVE for every op))``, early stop on (PyTorch's default): nothing is recomputed;
- ``sac save all, full replay``: the same with ``early_stop=False`` (torchtitan's wrapper);
- ``sac recompute all``: every op ``PREFER_RECOMPUTE`` (each op runs twice).

Per variant the forward alone and the step (forward and backward) are timed, interleaved
over ``--rounds`` rounds (these machines are shared: only ratios within a round mean
anything), median per round. Per op, in microseconds: each variant's time and its excess
over eager. Writes ``experiments/results/sac_dispatch.csv``.

    .venv/bin/python experiments/sac_dispatch.py [--ops 200] [--rounds 21]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
from rows import save, show
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)


def _region(ops: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        for _ in range(ops):
            x = x * 1.0001
        return x

    return run


def _variants(ops: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    region = _region(ops)

    def sac(policy: CheckpointPolicy, early_stop: bool = True) -> Callable[..., torch.Tensor]:
        def decide(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
            return policy

        context = functools.partial(create_selective_checkpoint_contexts, decide)
        return lambda x: checkpoint(
            region, x, use_reentrant=False, context_fn=context, early_stop=early_stop
        )

    return {
        "eager": region,
        "sac save all": sac(CheckpointPolicy.MUST_SAVE),
        "sac save all, full replay": sac(CheckpointPolicy.MUST_SAVE, early_stop=False),
        "sac recompute all": sac(CheckpointPolicy.PREFER_RECOMPUTE),
    }


def _time(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(16, requires_grad=True)
    variants = _variants(args.ops)
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for name, fn in variants.items():

            def step(fn: Callable[[torch.Tensor], torch.Tensor] = fn) -> None:
                fn(x).sum().backward()

            def forward(fn: Callable[[torch.Tensor], torch.Tensor] = fn) -> None:
                fn(x)

            times.setdefault((name, "forward"), []).append(_time(forward))
            times.setdefault((name, "step"), []).append(_time(step))
    per_op = {k: 1e6 * statistics.median(v) / args.ops for k, v in times.items()}
    rows = [
        {
            "variant": name,
            "forward us/op": f"{per_op[(name, 'forward')]:.2f}",
            "forward excess us/op": f"{per_op[(name, 'forward')] - per_op[('eager', 'forward')]:.2f}",
            "step us/op": f"{per_op[(name, 'step')]:.2f}",
            "step excess us/op": f"{per_op[(name, 'step')] - per_op[('eager', 'step')]:.2f}",
        }
        for name in variants
    ]
    show(
        rows, f"SAC's own cost per op: {args.ops} ops of 16 floats, 1 thread, {args.rounds} rounds"
    )
    print(save(rows, "sac_dispatch.csv"))


if __name__ == "__main__":
    main()
