"""Offload: a saved value copied to host memory once the forward is done with it, and copied
back before the backward reads it, at points of the op order the plan fixes.

Why fixed points: a copy's start, the wait on it and the free of its source sit at named ops
of the schedule (:class:`Offload`), so which storages are live at each op, on the device and on
the host, depends on the order alone, never on how fast the link is. The device peak the
simulator predicts is then what a run measures whatever the copies' timing; the timing model
(:func:`copy_timing`) decides only how long compute waits on them.

The points, for an offloaded value ``v`` produced by forward op ``p``:

* the copy-out starts when ``p`` ends; the device copy is freed after forward op ``wait``
  (no earlier than ``v``'s last forward use), once the copy-out has been waited on;
* the copy back (the prefetch) starts before backward op ``prefetch``: the device copy is
  allocated there and held until ``v``'s last backward use; the first backward op that reads
  ``v`` waits on it, and the host copy is freed then.

The two copy channels (device to host, host to device) run beside compute, each copy after the
one before it in its direction; while both run they share the link (:class:`Link`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass

from remat.problem import Link, Problem

SAME_MEMORY = (
    "a CPU device: its host store is the same memory, so this saves no real memory; the "
    "device bytes are those a GPU would hold"
)
"""What a plan that offloads on a CPU device says (its link is synchronous)."""


@dataclass(frozen=True)
class Offload:
    """One offloaded value and the points of the op order its copies are tied to."""

    value: str
    wait: str
    """The forward op after which the copy-out is waited on and the device copy freed."""
    prefetch: str
    """The backward op before which the copy back starts (device memory held from there)."""


@dataclass(frozen=True)
class CopyTiming:
    """What the copies cost the step under the link's timing model."""

    exposed_s: float
    """Time compute waits on copies (added to the step)."""
    to_host_s: float
    """Busy time of the device-to-host channel."""
    to_device_s: float
    """Busy time of the host-to-device channel."""


def copy_timing(
    forward: Sequence[str],
    backward: Sequence[str],
    time_s: Mapping[str, float],
    offloads: Iterable[Offload],
    nbytes: Mapping[str, int],
    first_read: Mapping[str, str],
    link: Link,
) -> CopyTiming:
    """Walk the step's ops in order with the two copy channels beside them; ``first_read``:
    each offloaded value's first backward reader (where the prefetch is waited on)."""
    offloads = tuple(offloads)
    if not offloads:
        return CopyTiming(0.0, 0.0, 0.0)
    busy = {
        True: sum(nbytes[o.value] for o in offloads) / link.d2h,
        False: sum(nbytes[o.value] for o in offloads) / link.h2d,
    }
    if link.synchronous:
        return CopyTiming(busy[True] + busy[False], busy[True], busy[False])
    channels = _Channels(link)
    missing = [o.value for o in offloads if o.value not in forward]
    if missing:
        raise ValueError(f"offloaded values that are not forward ops of the schedule: {missing}")
    waits: dict[str, list[str]] = {}
    starts: dict[str, list[str]] = {}
    reads: dict[str, list[str]] = {}
    for o in offloads:
        waits.setdefault(o.wait, []).append(o.value + ">")
        starts.setdefault(o.prefetch, []).append(o.value)
        reads.setdefault(first_read[o.value], []).append(o.value + "<")
    offloaded = {o.value for o in offloads}
    for name in forward:
        channels.run(time_s[name])
        if name in offloaded:  # its copy-out starts when its op ends
            channels.start(name + ">", nbytes[name], to_host=True)
        for copy in waits.get(name, ()):
            channels.wait(copy)
    for name in backward:
        for value in starts.get(name, ()):
            channels.start(value + "<", nbytes[value], to_host=False)
        for copy in reads.get(name, ()):
            channels.wait(copy)
        channels.run(time_s[name])
    return CopyTiming(channels.stalled, busy[True], busy[False])


@dataclass
class _Copy:
    name: str
    left: float
    """Bytes still to copy."""


class _Channels:
    """Two FIFO copy queues, progressing while compute runs or waits on them."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.queues: dict[bool, deque[_Copy]] = {True: deque(), False: deque()}
        self.done: set[str] = set()
        self.stalled = 0.0

    def start(self, name: str, nbytes: int, *, to_host: bool) -> None:
        self.queues[to_host].append(_Copy(name, float(nbytes)))

    def run(self, seconds: float) -> None:
        """Compute runs ``seconds``; the copies progress meanwhile."""
        left = seconds
        while left > 0 and (self.queues[True] or self.queues[False]):
            left -= self._step(left)

    def wait(self, name: str) -> None:
        """Compute waits until copy ``name`` is done."""
        while name not in self.done:
            if not (self.queues[True] or self.queues[False]):
                raise ValueError(f"copy {name} is waited on before it starts")
            self.stalled += self._step(float("inf"))

    def _step(self, limit: float) -> float:
        """Progress the head of each queue until one finishes or ``limit`` passes."""
        both = bool(self.queues[True]) and bool(self.queues[False])
        heads = {d: q[0] for d, q in self.queues.items() if q}
        rates = {d: self.link.rate(d, both) for d in heads}
        finish = {d: head.left / rates[d] for d, head in heads.items()}
        dt = min(limit, *finish.values())
        for d, head in heads.items():
            if finish[d] <= dt:
                self.queues[d].popleft()
                self.done.add(head.name)
            else:
                head.left -= dt * rates[d]
        return dt


def place(
    forward: Sequence[str],
    backward: Sequence[str],
    time_s: Mapping[str, float],
    values: Iterable[str],
    nbytes: Mapping[str, int],
    last_forward_use: Mapping[str, str],
    first_read: Mapping[str, str],
    link: Link,
    copy_ops: Container[str] | None = None,
) -> tuple[Offload, ...]:
    """Each value's points: the copy-out waited on at the first forward op, no earlier than the
    value's last forward use, by which the ops since the value's own have run as long as its
    copy takes (the forward's last op if none); the prefetch started at the latest backward op
    from which the ops up to its first reader run that long (the backward's first op if
    none). The latest points that hide each copy alone hold device memory the least while
    hiding it; queueing behind other copies is the timing model's to charge.

    ``copy_ops``: the ops the executor can put a copy's wait or start at (None: any). The
    step may hold ops the executor does not run (a loss the training loop computes): a wait
    moves earlier and a prefetch later to the nearest such op, which exposes more of the copy
    but never changes what it holds; a value with no such point raises :class:`OffloadError`.
    """
    at_f = {n: k for k, n in enumerate(forward)}
    at_b = {n: k for k, n in enumerate(backward)}
    ok = (lambda _: True) if copy_ops is None else copy_ops.__contains__
    out = []
    for v in values:
        p = at_f[v]
        first = at_f[last_forward_use[v]]
        k = max(p + 1, first)
        need = nbytes[v] / link.d2h
        ran = sum(time_s[forward[j]] for j in range(p + 1, min(k, len(forward) - 1) + 1))
        while k < len(forward) - 1 and ran < need:
            k += 1
            ran += time_s[forward[k]]
        k = min(k, len(forward) - 1)
        while k > max(p, first) and not ok(forward[k]):
            k -= 1
        u = at_b[first_read[v]]
        f, ran = u, 0.0
        need = nbytes[v] / link.h2d
        while f > 0 and ran < need:
            f -= 1
            ran += time_s[backward[f]]
        while f < u and not ok(backward[f]):
            f += 1
        if not (ok(forward[k]) and ok(backward[f])):
            raise OffloadError(f"{v}: no op the executor runs can wait on or start its copy")
        out.append(Offload(value=v, wait=forward[k], prefetch=backward[f]))
    return tuple(out)


class OffloadError(ValueError):
    """An offload the executor cannot run exactly: a value that is not its storages' only
    holder, points out of order, or a device with no copy link."""


def link_of(problem: Problem) -> Link:
    """``problem``'s copy link; raises :class:`OffloadError` where its profile has none."""
    if problem.link is None:
        raise OffloadError(
            f"the {problem.device_profile!r} profile has no copy link: nothing can be "
            "offloaded; pass a device_profile with one (remat.DeviceProfile(link=...))"
        )
    return problem.link


def first_reads(backward: Sequence[str], inputs: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """Each value's first reader among the ``backward`` ops (recomputations included)."""
    out: dict[str, str] = {}
    for name in backward:
        for i in inputs[name]:
            out.setdefault(i, name)
    return out


def last_forward_uses(
    forward: Sequence[str], inputs: Mapping[str, Sequence[str]]
) -> dict[str, str]:
    """Each forward value's last reader in ``forward`` (itself where none reads it)."""
    out = {n: n for n in forward}
    for name in forward:
        for i in inputs[name]:
            if i in out:
                out[i] = name
    return out


def unfit(
    value: str,
    holders: Sequence[str],
    owners: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]],
) -> str | None:
    """Why freeing ``value``'s device copy would not free its storages exactly, or None: it
    must allocate every storage it references, and no entry of ``holders`` (the saved values
    and the caller's outputs, ``value`` once among them) but its own may reference one.
    ``owners``: each value's (storages, allocated storages). The one rule of :func:`check`
    and of the search's candidates."""
    storages, allocates = owners[value]
    if not storages:
        return "holds no storage"
    if set(storages) != set(allocates):
        return "is a view of another value's storage: offload its base"
    shared = [h for h in holders if set(owners[h][0]) & set(storages)]
    shared.remove(value)
    if shared:
        return f"shares its storage with {shared[:3]}, which stay"
    return None


def check(
    offloads: Iterable[Offload],
    forward: Sequence[str],
    saved: Iterable[str],
    backward: Sequence[str],
    inputs: Mapping[str, Sequence[str]],
    owners: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]],
    held: Iterable[str],
) -> None:
    """Raise :class:`OffloadError` unless each offload can run exactly: a saved value that
    allocates every storage it references, none of them shared with another saved value or
    a value the caller ``held`` (user outputs, buffer updates); its wait no earlier than its
    last forward use; its prefetch no later than its first backward reader. ``owners``: each
    value's (storages, allocated storages)."""
    at_f = {n: k for k, n in enumerate(forward)}
    at_b = {n: k for k, n in enumerate(backward)}
    saved = tuple(saved)
    last = last_forward_uses(forward, inputs)
    first = first_reads(backward, inputs)
    seen: set[str] = set()
    for o in offloads:
        v = o.value
        if v in seen:
            raise OffloadError(f"{v} is offloaded twice")
        seen.add(v)
        if v not in saved or v not in at_f:
            raise OffloadError(f"{v} is offloaded but not a saved forward value")
        why = unfit(v, (*saved, *held), owners)
        if why is not None:
            raise OffloadError(f"{v} {why}")
        if o.wait not in at_f or at_f[o.wait] < at_f[last[v]]:
            raise OffloadError(f"{v}: its copy-out is waited on before its last forward use")
        if v not in first:
            raise OffloadError(f"{v} is offloaded but the backward never reads it")
        if o.prefetch not in at_b or at_b[o.prefetch] > at_b[first[v]]:
            raise OffloadError(f"{v}: its prefetch starts after its first backward reader")


__all__ = [
    "CopyTiming",
    "Link",
    "Offload",
    "SAME_MEMORY",
    "OffloadError",
    "check",
    "copy_timing",
    "first_reads",
    "last_forward_uses",
    "link_of",
    "place",
    "unfit",
]
