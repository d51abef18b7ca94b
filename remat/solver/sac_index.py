"""What the ``sac`` executor's schedule reads of a problem whatever the plan.

:mod:`remat.solver.executor` orders a SAC step once per plan a solver tries and once per
region for the lifetimes; each time it reads the same regions (their forward values, inputs,
backward ops and replay spans), the same inputs of every value and the same creator of every
storage. These indexes depend on the problem alone, so they are resolved once per problem
object (:func:`_per_problem`, the cache the executor's other per-problem answers use too)
and kept here, apart from the schedule that reads them: nothing here depends on a plan.
"""

from __future__ import annotations

import functools
import weakref
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from remat.problem import Problem, Role

NO_CHECKPOINT = "<no checkpoint>"
"""Op of a ``sac`` problem's marker value, one per region: keeping it runs the region
without checkpoint (eagerly: autograd keeps what the region's backward reads)."""


_T = TypeVar("_T")


def _per_problem(fn: Callable[[Problem], _T]) -> Callable[[Problem], _T]:
    """``fn`` computed once per problem object (held weakly): the lifetimes ask for the same
    regions and candidates once per region (a 7B model's 129 regions). Callers must not
    mutate what it returns."""
    cache: dict[int, tuple[weakref.ref[Problem], _T]] = {}

    @functools.wraps(fn)
    def cached(problem: Problem) -> _T:
        key = id(problem)
        hit = cache.get(key)
        if hit is not None and hit[0]() is problem:
            return hit[1]
        value = fn(problem)
        cache[key] = (weakref.ref(problem, lambda _: cache.pop(key, None)), value)
        return value

    return cached


@dataclass(frozen=True)
class _Regions:
    """A SAC problem's regions: their forward values, inputs, backward ops and replay stops."""

    values: Mapping[str, tuple[str, ...]]
    markers: Mapping[str, str]
    """Region -> its no-checkpoint marker."""
    inputs: Mapping[str, frozenset[str]]
    backward: Mapping[str, tuple[str, ...]]
    needed: Mapping[str, frozenset[str]]
    """Values of the region its own backward ops read."""


@_per_problem
def _regions(problem: Problem) -> _Regions:
    by_name = problem.by_name
    values: dict[str, list[str]] = defaultdict(list)
    markers: dict[str, str] = {}
    inputs: dict[str, set[str]] = defaultdict(set)
    backward: dict[str, list[str]] = defaultdict(list)
    needed: dict[str, set[str]] = defaultdict(set)
    for v in problem.values:
        if v.op == NO_CHECKPOINT:
            markers[v.region] = v.name
        elif v.role is Role.FORWARD and v.region:
            values[v.region].append(v.name)
            for i in v.inputs:
                w = by_name[i]
                if w.role is Role.FORWARD and w.region != v.region:
                    inputs[v.region].add(i)
        elif v.role is Role.BACKWARD and v.region:
            backward[v.region].append(v.name)
            needed[v.region].update(i for i in v.inputs if by_name[i].region == v.region)
    return _Regions(
        {r: tuple(x) for r, x in values.items()},
        markers,
        {r: frozenset(x) for r, x in inputs.items()},
        {r: tuple(x) for r, x in backward.items()},
        {r: frozenset(x & set(values[r])) for r, x in needed.items()},
    )


@dataclass(frozen=True)
class _Reads:
    """What :func:`remat.solver.executor._sac_order` reads of a SAC problem whatever the plan,
    resolved once: it runs once per region for the lifetimes (81 regions of a 70B model's
    24,000 values)."""

    forward: tuple[str, ...]
    backward: tuple[tuple[str, str], ...]
    """The backward's values in order, each with its region."""
    inputs: Mapping[str, tuple[tuple[str, str, bool], ...]]
    """Value -> its inputs, each with its region and whether it is a forward value."""
    region: Mapping[str, str]
    never_recomputed: frozenset[str]
    """The regions' forward values that must never re-run (kept by every plan)."""
    policy: Mapping[str, tuple[str, ...]]
    """Region -> its forward values the policy sees."""
    span: Mapping[str, tuple[str, ...]]
    """Region -> the forward values its replay runs through (early stop: to the last one its
    backward reads), kept or not."""
    span_policy: Mapping[str, tuple[str, ...]]
    """Region -> the values of its span the policy sees (the replay's calls)."""
    in_span: frozenset[str]
    """Every value of some region's span."""
    device_s: Mapping[str, float]
    """Region -> the op time of its policy-called forward values and of its backward (what
    an overlapped dispatch hides behind, with the replay's)."""


@_per_problem
def _reads(problem: Problem) -> _Reads:
    by_name = problem.by_name
    regions = _regions(problem)
    span = {}
    for r, names in regions.values.items():
        needed = regions.needed.get(r, frozenset())
        stop = max((k for k, n in enumerate(names) if n in needed), default=-1)
        span[r] = names[: stop + 1]
    return _Reads(
        forward=tuple(v.name for v in problem.values if v.role is Role.FORWARD),
        backward=tuple((v.name, v.region) for v in problem.values if v.role is Role.BACKWARD),
        inputs={
            v.name: tuple((i, by_name[i].region, by_name[i].role is Role.FORWARD) for i in v.inputs)
            for v in problem.values
        },
        region={v.name: v.region for v in problem.values},
        never_recomputed=frozenset(
            v.name
            for v in problem.values
            if v.role is Role.FORWARD and v.region and v.never_recomputed
        ),
        policy={
            r: tuple(n for n in names if by_name[n].policy) for r, names in regions.values.items()
        },
        span=span,
        span_policy={r: tuple(n for n in s if by_name[n].policy) for r, s in span.items()},
        in_span=frozenset(n for s in span.values() for n in s),
        device_s={
            r: sum(by_name[n].time_s for n in names if by_name[n].policy)
            + sum(by_name[n].time_s for n in regions.backward.get(r, ()))
            for r, names in regions.values.items()
        },
    )


@_per_problem
def _creators(problem: Problem) -> Mapping[str, str]:
    """Storage -> the value that allocates it."""
    return {s: v.name for v in problem.values for s in v.allocates}
