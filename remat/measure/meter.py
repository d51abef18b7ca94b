"""Measure the memory of a real training step on CPU: live tensor storages, op by op.

:class:`LiveMemoryMeter` is a TorchDispatchMode that sees every ATen op, registers each storage
an op creates with a weakref finalizer, and tracks the live total and its peak. Storages that
existed before the meter started (parameters, inputs) and views of them cost nothing, exactly
as in remat's simulator. A tensor subclass that wraps others (a DTensor) counts as the tensors
it wraps (:func:`remat._torch_compat.storage_tensors`). It does not see memory a kernel
allocates internally and frees before returning (e.g. convolution workspace);
:func:`allocator_peak_bytes` measures that level.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from remat import _torch_compat as tc
from remat.measure.autocast import autocast_for


class LiveMemoryMeter(tc.TorchDispatchMode):
    """Peak bytes of tensor storages allocated while the meter is active."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._tracked: dict[int, int] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let ``torch.compile``d code run under the meter. Otherwise Dynamo silently runs every
        frame eagerly while a dispatch mode is active, and keeps doing so for that code after
        the meter exits (until ``torch._dynamo.reset()``): a compiled peer would be measured as
        eager. Graphs compiled with ``aot_eager`` run their aten ops eagerly, so those still
        dispatch through the meter; kernels a backend fuses (Inductor) would not."""
        return True

    def _free(self, key: int, nbytes: int) -> None:
        if self._tracked.get(key) == nbytes:
            del self._tracked[key]
            self.live_bytes -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self._count(tc.storage_tensors((args, kwargs)), tc.storage_tensors(out))
        return out

    def _count(self, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """Account the storages ``outs`` create (those not among ``ins``' or known)."""
        self._counted({tc.storage_key(t) for t in ins}, outs, [tc.storage_key(t) for t in outs])

    def _counted(self, inputs: set[int], outs: list[torch.Tensor], keys: list[int]) -> None:
        """:meth:`_count` given the storage keys of ``ins`` (``inputs``) and of ``outs``."""
        for t, key in zip(outs, keys, strict=True):
            if key in self._tracked or key in inputs:
                continue  # already counted, or a view of a storage that existed before
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            self._tracked[key] = nbytes
            self.live_bytes += nbytes
            weakref.finalize(storage, self._free, key, nbytes)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)


def allocator_peak_bytes(step: Callable[[], Any]) -> int:
    """Peak of the CPU allocator during ``step()`` (sees kernel scratch memory too).

    Sums the profiler's allocation events in order, counting a free only if its block was
    allocated inside ``step()``: the profiler also reports frees of blocks allocated before
    (the previous step's gradients, freed as this one starts) whenever their address was
    allocated during an earlier profiled step, which lowered this peak by up to 31% depending
    on where malloc placed them. The live-storage meter's peak is then a lower bound of this
    one, and the gap is what a reserve must cover.
    """
    with allocator_profile() as prof:
        step()
    return _peak_of(prof)


def peaks_of(step: Callable[[], Any]) -> tuple[int, int]:
    """The live-storage meter's and the allocator's peaks (:func:`allocator_peak_bytes`)
    during ``step()``, measured in the same run: for steps other than
    :func:`training_step`'s (a pipeline schedule's ``step()``)."""
    with allocator_profile() as prof, LiveMemoryMeter() as meter:
        step()
    return meter.peak_bytes, _peak_of(prof)


@contextlib.contextmanager
def allocator_profile() -> Iterator[torch.profiler.profile]:
    """``torch.profiler.profile`` recording allocations, without the lines Kineto writes to
    the process's stderr when it starts and stops (``USDT: ... profiler_start``; no setting
    turns them off, so file descriptor 2 is pointed at /dev/null while it does)."""
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    )
    with _stderr_silenced():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _stderr_silenced():
            prof.__exit__(None, None, None)


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2 (an embedded interpreter): nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _peak_of(prof: torch.profiler.profile) -> int:
    return peak_of_events(tc.allocator_events(prof))


def peak_of_events(events: Iterable[tuple[int, int, int]]) -> int:
    """The peak of the blocks allocated among ``events`` ((time, bytes, address), in order:
    + an allocation, - a free), counting a free only if its block was allocated among them
    (:func:`allocator_peak_bytes`). A block whose address is allocated again before its free
    was freed where the profiler does not record frees, on a thread that does not profile
    (gloo's worker, dropping a collective's work last, ``tests/executors/sac/gloo_settle.py``): it
    stops counting there, the latest it can have died, not at the end of the step."""
    live = peak = 0
    mine: dict[int, int] = {}
    for _, nbytes, address in events:
        if nbytes >= 0:
            live -= mine.pop(address, 0)
            mine[address] = nbytes
        elif address in mine:
            del mine[address]
        else:
            continue  # allocated before step()
        live += nbytes
        peak = max(peak, live)
    return peak


@dataclass(frozen=True)
class StepMeasurement:
    peak_bytes: int
    """Live-storage meter."""
    outputs: tuple[torch.Tensor, ...]
    """The tensor leaves of the output, detached."""
    allocator_peak_bytes: int | None = None
    """The allocator's peak in the same step (``measure_step(..., allocator=True)``)."""


def output_tensors(out: Any) -> list[torch.Tensor]:
    """The tensor leaves of ``out`` (any pytree: an op's output or its arguments)."""
    return [t for t in tc.tree_leaves(out) if isinstance(t, torch.Tensor)]


class LossError(ValueError):
    """The user's ``loss_fn`` did not return a scalar loss to start the backward from."""


@dataclass(frozen=True)
class Loss:
    """The user's loss, part of the step remat plans: ``fn(output, target)`` returns the
    scalar the backward starts from. The step is then the one a training loop runs, ``out =
    model(*inputs); loss = fn(out, target); del out; loss.backward()``: the model's output
    lives only as long as the loss keeps it (cross-entropy keeps its log-softmax, not the
    logits), and the loss's own buffers count."""

    fn: Callable[[Any, Any], torch.Tensor]
    target: Any = None

    @classmethod
    def of(cls, fn: Callable[[Any, Any], torch.Tensor] | None, target: Any) -> Loss | None:
        """The front doors' ``loss_fn=``/``target=`` as a loss, or None without ``loss_fn``."""
        return None if fn is None else cls(fn, target)

    def __call__(self, output: Any) -> torch.Tensor:
        value = self.fn(output, self.target)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise LossError(
                f"loss_fn must return the loss as a scalar tensor, not {_describe(value)}"
            )
        if not value.requires_grad:
            raise LossError(
                "loss_fn's result does not require grad: it must be computed from the model's "
                "output (not detached, not under torch.no_grad)"
            )
        return value


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def training_step(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    seed: int = 0,
    autocast: torch.dtype | None = None,
    on_backward: Callable[[list[torch.Tensor]], None] | None = None,
    autocast_policy: str = "native",
    loss: Loss | None = None,
) -> tuple[torch.Tensor, ...]:
    """One training step; gradients accumulate into ``.grad``. With ``loss``: forward, the
    loss (both under autocast, as training loops run them), the output released, backward
    from the loss; returns the loss, detached. Without: forward, then backward with dense
    random output gradients (as a loss such as cross-entropy produces), drawn from their own
    generator so the global random stream is untouched; the outputs stay alive until the
    backward has run; returns the outputs, detached. ``autocast``: run the forward (not the
    backward, as PyTorch recommends) under ``torch.autocast`` with this dtype.
    ``on_backward`` is called with the outputs (the loss) just before the backward starts
    (tracers mark the phase with it). ``autocast_policy``: ``cuda`` casts as CUDA autocast
    does on any device (:mod:`remat.measure.autocast`)."""
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    region = (
        autocast_for(device, autocast, autocast_policy)
        if autocast is not None
        else torch.autocast(device, enabled=False)
    )
    if loss is not None:
        with region:
            value = loss(module(*args, **(kwargs or {})))
        if on_backward is not None:
            on_backward([value])
        value.backward()
        return (value.detach(),)
    gen = torch.Generator().manual_seed(seed)
    with region:
        out = output_tensors(module(*args, **(kwargs or {})))
    if on_backward is not None:
        on_backward(out)
    diff = [t for t in out if t.requires_grad]
    # Drawn on the CPU (the generator's device), then moved: never on the default device.
    tangents = [
        torch.randn(t.shape, generator=gen, dtype=t.dtype, device="cpu").to(t.device) for t in diff
    ]
    torch.autograd.backward(diff, tangents)
    return tuple(t.detach() for t in out)


def measure_step(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    seed: int = 0,
    autocast: torch.dtype | None = None,
    allocator: bool = False,
    loss: Loss | None = None,
) -> StepMeasurement:
    """Run :func:`training_step` under a :class:`LiveMemoryMeter`; ``allocator``: and under
    the profiler's allocator accounting (:func:`allocator_peak_bytes`), in the same run.
    ``loss``: the step with the user's loss (:class:`Loss`); the outputs are then the loss."""
    with contextlib.ExitStack() as stack:
        prof = stack.enter_context(allocator_profile()) if allocator else None
        with LiveMemoryMeter() as meter:
            outputs = training_step(module, args, kwargs, seed=seed, autocast=autocast, loss=loss)
    return StepMeasurement(meter.peak_bytes, outputs, None if prof is None else _peak_of(prof))
