"""Check a plan against the unmodified model on a real run.

:func:`verify` trains a remat module and an untouched copy of the model side by side for a few
optimizer steps, with the same random stream (dropout active), and reports every difference in
outputs, gradients, parameters and buffers (bitwise, ``torch.equal``) together with the
predicted and measured memory peak of each step. Tests, the demo and benchmarks all use it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.executors import GRAPH, SAC, Executor, executor_named
from remat.measure.autocast import AUTOCAST
from remat.measure.meter import Loss, measure_step
from remat.request import as_args as _as_args
from remat.solver.plan import Plan


@dataclass(frozen=True)
class StepCheck:
    step: int
    predicted_peak_bytes: int
    """The plan's peak at the allocator (:attr:`remat.Plan.predicted_peak_bytes`)."""
    measured_peak_bytes: int
    """Allocator (profiler), remat module, the same step as ``measured_tensor_peak_bytes``."""
    predicted_tensor_peak_bytes: int
    measured_tensor_peak_bytes: int
    """Live-storage meter, remat module."""
    eager_peak_bytes: int
    """Live-storage meter, the unmodified model."""
    mismatches: tuple[str, ...]


@dataclass(frozen=True)
class Verification:
    module: nn.Module
    """The remat module (:func:`remat.optimize`), or the model wrapped in place
    (:func:`remat.apply`, ``executor="sac"``)."""
    plan: Plan
    steps: tuple[StepCheck, ...]

    @property
    def equal(self) -> bool:
        return not any(s.mismatches for s in self.steps)

    @property
    def mismatches(self) -> list[str]:
        return [m for s in self.steps for m in s.mismatches]


def compare(ref: nn.Module, fast: nn.Module, outs: Any, fast_outs: Any, step: int) -> list[str]:
    bad = []
    if len(outs) != len(fast_outs):
        return [f"step {step}: {len(fast_outs)} outputs instead of {len(outs)}"]
    bad += [
        f"step {step}: output {i} differs"
        for i, (a, b) in enumerate(zip(outs, fast_outs, strict=True))
        if not torch.equal(a, b)
    ]
    ref_params = dict(ref.named_parameters())
    for name, p in fast.named_parameters():
        g, h = ref_params[name].grad, p.grad
        if (g is None) != (h is None) or (
            g is not None and h is not None and not torch.equal(g, h)
        ):
            bad.append(f"step {step}: gradient of {name} differs")
    ref_buffers = dict(ref.named_buffers())
    bad += [
        f"step {step}: buffer {name} differs"
        for name, b in fast.named_buffers()
        if not torch.equal(b, ref_buffers[name])
    ]
    return bad


def verify(
    model: nn.Module,
    example_inputs: Any,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    steps: int = 3,
    lr: float = 1e-2,
    executor: str | Executor = "graph",
    native: bool | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    **optimize_kwargs: Any,
) -> Verification:
    """Optimize a copy of ``model`` and train it beside another copy with AdamW for ``steps``.

    ``model`` itself is not touched. ``loss_fn``: both train on ``loss_fn(output, target)``,
    the step planned with that loss (the outputs compared are then the losses); without it,
    output gradients are dense and random (as a loss such as cross-entropy would give), drawn
    from their own generator. ``executor``: the one that plans and runs the copy
    (:mod:`remat.executors`): ``graph``, :func:`remat.optimize`; ``sac``, :func:`remat.apply`
    (the copy's own blocks under SAC policies). ``native=True`` is the old spelling of
    ``executor="sac"`` (deprecated).
    """
    if native is not None:
        warnings.warn(
            'remat.verify(native=...) is deprecated: pass executor="sac" (or "graph")',
            DeprecationWarning,
            stacklevel=2,
        )
        executor = SAC if native else GRAPH
    runner = executor_named(executor)
    args = _as_args(example_inputs)
    kwargs = dict(example_kwargs or {})
    # Mixed precision: the eager reference runs its forward under autocast; the remat module
    # carries the casts in its graphs.
    precision = optimize_kwargs.get("precision", "fp32")
    if precision not in AUTOCAST:
        raise ValueError(
            f"remat.verify runs one process; precision {precision!r} needs FSDP2 over ranks "
            f"(valid here: {', '.join(AUTOCAST)})"
        )
    autocast = AUTOCAST[precision]
    ref, work = copy.deepcopy(model), copy.deepcopy(model)
    loss = Loss.of(loss_fn, target)
    planned = runner.plan(
        work, args, example_kwargs=kwargs, loss_fn=loss_fn, target=target, **optimize_kwargs
    )
    fast, plan = planned.module, planned.plan
    # The user's own forward runs under the reference's autocast; remat's module carries the
    # casts in its graphs.
    fast_autocast = autocast if runner.own_forward else None
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=lr)
    opt_fast = torch.optim.AdamW(fast.parameters(), lr=lr)
    checks = []
    # Planning leaves garbage in reference cycles (capture graphs, solver models), which the
    # cyclic collector must not free inside a measured step: freeing a tensor allocated
    # before the profiler started makes the allocator warn on stderr ("memory block of
    # unknown size ..."; seen once in `remat demo` under the suite). The collector is paused
    # over the steps rather than run before them: a full collection of a long-lived
    # process's heap took a quarter of a second a call in the test suite.
    with _collector_paused():
        for step in range(steps):
            opt_ref.zero_grad(set_to_none=True)
            opt_fast.zero_grad(set_to_none=True)
            torch.manual_seed(1000 + step)
            eager = measure_step(ref, args, kwargs, seed=step, autocast=autocast, loss=loss)
            torch.manual_seed(1000 + step)
            measured = measure_step(
                fast, args, kwargs, seed=step, autocast=fast_autocast, allocator=True, loss=loss
            )
            bad = compare(ref, fast, eager.outputs, measured.outputs, step)
            opt_ref.step()
            opt_fast.step()
            checks.append(
                StepCheck(
                    step=step,
                    predicted_peak_bytes=plan.predicted_peak_bytes,
                    measured_peak_bytes=measured.allocator_peak_bytes or 0,
                    predicted_tensor_peak_bytes=plan.predicted_tensor_peak_bytes,
                    measured_tensor_peak_bytes=measured.peak_bytes,
                    eager_peak_bytes=eager.peak_bytes,
                    mismatches=tuple(bad),
                )
            )
    ref_params = dict(ref.named_parameters())
    final = [
        f"after {steps} steps: parameter {n} differs"
        for n, p in fast.named_parameters()
        if not torch.equal(p, ref_params[n])
    ]
    if final:
        last = checks[-1]
        checks[-1] = dataclasses.replace(last, mismatches=last.mismatches + tuple(final))
    return Verification(fast, plan, tuple(checks))


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block (as it was, after)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
