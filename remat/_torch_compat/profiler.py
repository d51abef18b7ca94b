"""The allocator's events as the profiler records them."""

from __future__ import annotations

from typing import Any

import torch


def allocator_events(prof: torch.profiler.profile) -> list[tuple[int, int, int]]:
    """(time ns, bytes, address) of every allocation (+) and free (-) the profiler recorded,
    in order. The address matters: the profiler also records the free of a block allocated
    outside the profiled region when an earlier profiled region allocated that address."""
    results: Any = prof.profiler.kineto_results  # type: ignore[union-attr]
    out = []
    stack = list(results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == torch._C._profiler._EventType.Allocation:
            out.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr))
    return sorted(out, key=lambda t: t[0])


def allocator_events_by_label(
    prof: torch.profiler.profile, prefix: str
) -> dict[str, list[tuple[int, int, int]]]:
    """:func:`allocator_events` grouped by the innermost enclosing
    ``torch.profiler.record_function`` whose name starts with ``prefix``."""
    results: Any = prof.profiler.kineto_results  # type: ignore[union-attr]
    out: dict[str, list[tuple[int, int, int]]] = {}
    stack = list(results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag != torch._C._profiler._EventType.Allocation:
            continue
        parent = e.parent
        while parent is not None and not parent.name.startswith(prefix):
            parent = parent.parent
        if parent is not None:
            out.setdefault(parent.name, []).append(
                (e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr)
            )
    return {k: sorted(v, key=lambda t: t[0]) for k, v in out.items()}
