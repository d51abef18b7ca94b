"""Shared checkers: every plan of every model goes through the same two checks.

1. Equivalence (:func:`remat.verify.verify`): outputs, parameter gradients, parameters and
   buffers bitwise equal to the unmodified model's over several optimizer steps, dropout on.
2. Memory: at the allocator (profiler) and for live tensors (live-storage meter), each step's
   measured peak equals the plan's prediction within max(1%, 64 KiB).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations_with_replacement
from typing import Any

from torch import nn

from remat.verify import Verification, verify

TOLERANCE_BYTES = 64 * 1024
TOLERANCE_FRACTION = 0.01


def tolerance(predicted: int) -> float:
    """Bytes a measured peak may differ from ``predicted`` by: max(1%, 64 KiB)."""
    return max(TOLERANCE_BYTES, TOLERANCE_FRACTION * predicted)


def assert_peak_close(predicted: int, measured: int, what: str) -> None:
    tol = tolerance(predicted)
    assert abs(predicted - measured) <= tol, (
        f"{what}: predicted peak {predicted:,} B, measured {measured:,} B "
        f"(diff {measured - predicted:+,} B, tolerance {tol:,.0f} B)"
    )


def gloo_late(
    predicted: int,
    measured: int,
    buffer: int | Sequence[int],
    more: int = 0,
    on_time: int | None = None,
) -> bool:
    """A peak measured under gloo's tensor-parallel collectives, as the prediction counts
    them (``tests/parallel/test_tensor_ranks.py``'s docstring): the predicted peak, or
    one counted collective output ``buffer`` below it (gloo's worker thread had already let
    it go), then up to ``more`` uncounted ones above that (the thread let go later still).
    Collectives whose outputs differ in size (sequence parallelism's all-gathers and
    reduce-scatters): ``buffer`` lists the sizes, any of which can be the counted one or
    the uncounted ones. ``on_time``: the step's peak with every counted output let go as
    Python lets go (``tests/parallel/tp_worker.py``'s :func:`on_time`); the measured peak,
    less the uncounted ones, may then be anything from it to the predicted peak: where the
    counted output is gone at the predicted peak, the step's peak can fall at another
    moment, lower by less than that output."""
    sizes = (buffer,) if isinstance(buffer, int) else tuple(buffer)
    held = {sum(c) for k in range(more + 1) for c in combinations_with_replacement(sizes, k)}
    if on_time is not None:
        return any(on_time <= measured - h <= predicted for h in held)
    return any(measured - base in held for base in (predicted, *(predicted - s for s in sizes)))


def gloo_held(predicted: int, measured: int, buffers: Sequence[int], more: int = 2) -> bool:
    """An allocator peak measured under FSDP2 on gloo: the predicted one (within
    :func:`assert_peak_close`'s tolerance), or above it by at most ``more`` of the
    collectives' buffers (``buffers``: their sizes) whose free the profiler missed. gloo's
    worker thread drops its reference to a collective's work after marking it done; when
    it is the last holder, the work's buffers (a reduce-scatter's copy of its input, an
    all-gather's output) die on that thread, whose frees the profiler does not record, and
    the meter counts them live until their address is reused (:mod:`tests.executors.sac.
    gloo_settle`). Such a buffer can overlap any later moment, so it raises the peak by
    anything up to its size. Never below: nothing the prediction counts leaves early."""
    tol = tolerance(predicted)
    return predicted - tol <= measured <= predicted + tol + more * max(buffers, default=0)


def assert_trains_like_eager(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, steps: int = 3, **opts: Any
) -> Verification:
    """Both checks; returns the verification for further assertions."""
    result = verify(model, args, example_kwargs=kwargs, steps=steps, **opts)
    assert result.equal, "\n".join(result.mismatches)
    for s in result.steps:
        assert_peak_close(
            s.predicted_peak_bytes, s.measured_peak_bytes, f"step {s.step}, allocator"
        )
        assert_peak_close(
            s.predicted_tensor_peak_bytes, s.measured_tensor_peak_bytes, f"step {s.step}, tensors"
        )
    return result
