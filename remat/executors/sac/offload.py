"""A checkpointed region's inputs in host memory between its forward and its backward.

A checkpointed region holds its inputs (the activation entering a decoder layer) from its
forward to its backward, where its replay needs them: on a stack of N checkpointed blocks,
N activations wait in device memory. Offloaded, a region's activation inputs wait in a host
store (:class:`remat.executors.host_store.HostStore`) instead, at three fixed points of the
op order:

- **copy-out**: when the region's forward returns;
- **release**: the device copy is let go when the *next* region's forward returns (on a
  GPU, where the copy's event would be waited on, the next region's forward hiding it);
- **prefetch**: when the gradient of the next region's output arrives (a tensor hook: the
  backward is about to run that region), the copy comes back to the device, where the
  region's replay takes it; the next region's backward hides it.

The device peak depends on those points alone, not on how fast the link is: the FakeTensor
trace that predicts it runs this very code (with a store that counts bytes,
:class:`CountingStore`), and the tests measure the real run against it. The link's speed
decides only whether a copy stalls the step, which :func:`exposed_copy_s` counts.

What is offloaded: a region's inputs that are activations -- plain tensors that require a
gradient and have a ``grad_fn`` -- not parameters, nor tensors every region shares (masks,
rotary tables), nor DTensors. The checkpoint then takes no tensor argument: the region's
function reads its inputs from :class:`Held`, the originals in the forward and the fetched
copies in the replay, each a leaf that requires its gradient as the original did (the replay
re-saves what the forward saved; the gradient flows through the forward's graph).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from remat import _torch_compat as tc
from remat.executors.host_store import HostStore, Stored
from remat.problem import Link

__all__ = ["CopyMark", "CountingStore", "Held", "Offloads", "exposed_copy_s"]


@dataclass(frozen=True)
class CopyMark:
    """An offloaded input's fixed point in a traced step (:mod:`remat.executors.sac.offload`):
    ``kind`` is ``out`` (its copy-out starts), ``release`` (its device copy is let go),
    ``prefetch`` (its copy back starts) or ``use`` (the region's replay takes it); ``event``:
    how many ops of the step had run by then."""

    kind: str
    copy: int
    region: str
    nbytes: int
    event: int


class CountingStore(HostStore):
    """The host store of a FakeTensor trace: it counts the bytes a real store would take,
    copies nothing, and fetches a new (fake) device storage of the same size and layout."""

    def offload(self, value: torch.Tensor) -> Stored:
        nbytes = value.untyped_storage().nbytes()
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        # nbytes bytes by their count alone: a broadcast view takes no memory.
        return Stored.of(value, np.broadcast_to(np.uint8(0), (nbytes,)))

    def fetch(self, stored: Stored) -> torch.Tensor:
        """A new storage of the stored size, viewed in the stored layout: what
        :meth:`HostStore.fetch` allocates (there with ``set_``, whose target's storage
        FakeTensorMode keeps alive after the tensor dies, so a trace would never free it)."""
        nbytes = stored.data.nbytes
        self.live_bytes -= nbytes
        storage = torch.empty(nbytes, dtype=torch.uint8, device=stored.device)
        return storage.view(stored.dtype).as_strided(stored.shape, stored.stride, stored.offset)


class Offloads:
    """The offload state of one model's regions: the store, the copy-outs whose device copy
    is still held, and the latest offloaded call whose successor has not run yet."""

    def __init__(self, store: HostStore) -> None:
        self.store = store
        self.pending: list[Held] = []
        self.last: Held | None = None
        self.observer: Callable[[str, Held], None] | None = None
        """Told of every copy's fixed points (the FakeTensor trace's marks)."""
        self._count = 0

    def held(self, path: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Held | None:
        """``args`` and ``kwargs`` held for region ``path``'s call, or None where none of them is
        an activation to offload (or the step records no gradient)."""
        if not torch.is_grad_enabled():
            return None
        leaves, spec = tc.tree_flatten((args, dict(kwargs)))
        chosen = [k for k, t in enumerate(leaves) if _activation(t)]
        if not chosen:
            return None
        self._count += 1
        return Held(self, path, self._count, leaves, spec, chosen)

    def after_forward(self, held: Held | None, out: Any) -> None:
        """A region's forward returned ``out``: earlier copy-outs let their device copy go;
        the latest offloaded call is prefetched when ``out``'s gradient arrives; ``held``'s
        copy-out starts."""
        self.release()
        if not torch.is_grad_enabled():
            return
        outputs = [t for t in tc.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn]
        if self.last is not None:
            _on_gradient(outputs, self.last.prefetch)
            self.last = None
        if held is not None:
            held.copy_out()
            self.pending.append(held)
            # Its own backward fetches it where no successor did (a region run last).
            _on_gradient(outputs, held.prefetch)
            self.last = held

    def release(self) -> None:
        for held in self.pending:
            held.release()
        self.pending.clear()

    def mark(self, kind: str, held: Held) -> None:
        if self.observer is not None:
            self.observer(kind, held)


def _activation(t: object) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.requires_grad
        and t.grad_fn is not None
        and not tc.is_dtensor(t)
    )


def _on_gradient(outputs: Sequence[torch.Tensor], fn: Callable[[], None]) -> None:
    """Call ``fn`` when each of ``outputs``' gradients arrives: the first call does the work
    (``Held.prefetch`` does nothing a second time)."""
    for t in outputs:
        t.register_hook(lambda _grad: fn())


class Held:
    """One region call's inputs while its checkpoint waits for the backward: the leaves of
    ``(args, kwargs)``, those at ``chosen`` offloaded after the forward."""

    def __init__(
        self,
        offloads: Offloads,
        path: str,
        number: int,
        leaves: list[Any],
        spec: Any,
        chosen: list[int],
    ) -> None:
        self._offloads = weakref.ref(offloads)
        self.path = path
        self.number = number
        self.leaves = leaves
        self.spec = spec
        self.chosen = chosen
        self.requires_grad = [bool(leaves[k].requires_grad) for k in chosen]
        self.stored: list[Stored] = []
        self.device: list[torch.Tensor] = []
        """The device copies between the copy-out and the release."""
        self.state = "forward"

    @property
    def nbytes(self) -> int:
        return sum(int(s.data.nbytes) for s in self.stored)

    def inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The region's inputs: the originals in the forward, the fetched copies in the
        replay (then let go of: the replay's saved tensors hold them from there)."""
        if self.state == "forward":
            return tc.tree_unflatten(self.leaves, self.spec)  # type: ignore[no-any-return]
        if self.state != "fetched":
            raise RuntimeError(
                "an offloaded region's inputs were needed twice in the backward (a second "
                "backward through the graph, retain_graph=True?), or before their prefetch: "
                "offload runs one backward per forward; plan without a host budget"
            )
        args, kwargs = tc.tree_unflatten(self.leaves, self.spec)
        for k in self.chosen:
            self.leaves[k] = None
        self.state = "replayed"
        self._mark("use")
        return args, kwargs

    def copy_out(self) -> None:
        offloads = self._offloads()
        assert offloads is not None
        for k in self.chosen:
            self.stored.append(offloads.store.offload(self.leaves[k]))
            self.device.append(self.leaves[k])
            self.leaves[k] = None
        self.state = "offloaded"
        self._mark("out")

    def release(self) -> None:
        if self.device:
            self.device.clear()
            self._mark("release")

    def prefetch(self) -> None:
        if self.state != "offloaded":
            return
        offloads = self._offloads()
        assert offloads is not None
        offloads.release()
        self._mark("prefetch")
        for k, stored, grad in zip(self.chosen, self.stored, self.requires_grad, strict=True):
            self.leaves[k] = offloads.store.fetch(stored).requires_grad_(grad)
        self.state = "fetched"

    def _mark(self, kind: str) -> None:
        offloads = self._offloads()
        if offloads is not None:
            offloads.mark(kind, self)


def exposed_copy_s(marks: Sequence[CopyMark], event_times: Sequence[float], link: Link) -> float:
    """The time copies add to a traced step: each copy-out runs from its ``out`` mark to its
    ``release``, each prefetch from its ``prefetch`` to its ``use``, behind the ops between
    them (on a synchronous link, a CPU device's host store, behind none). A copy longer than
    its window stalls the step by the difference. Copy-outs run in the forward and prefetches
    in the backward, so the two directions do not share the link."""
    starts: dict[tuple[int, str], CopyMark] = {}
    exposed = 0.0
    for m in marks:
        if m.kind in ("out", "prefetch"):
            starts[(m.copy, m.kind)] = m
            continue
        start = starts.pop((m.copy, "out" if m.kind == "release" else "prefetch"), None)
        if start is None:
            continue
        to_host = m.kind == "release"
        length = start.nbytes / link.rate(to_host=to_host, both=False)
        hidden = 0.0 if link.synchronous else sum(event_times[start.event : m.event])
        exposed += max(0.0, length - hidden)
    return exposed
