"""FakeTensor traces on several CPU cores.

A fit traces every plan at every shape of its ranges (:mod:`remat.fit.sac_shapes`): 180
traces of half a second each on a 70B Llama's copies, one core busy with Python (FakeTensor
dispatch), the others idle. The traces are independent, so they can run in forked worker
processes that inherit the analysed FakeTensor copies as they are (no rebuild, no warm-up)
and send back only what the fit reads of each trace (a
:class:`~remat.fit.sac_shapes.Sample`, a :class:`~remat.fit.deep.CopyStep`). Fork is taken only
on Linux and where CUDA is not initialised in this process (a forked child cannot use it);
each worker runs one intra-op thread, as DataLoader's workers do.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["AUTO_MAX", "MIN_WORK_S", "WORKERS_ENV", "Mapped", "mapped"]

AUTO_MAX = 8
"""Workers at most when the count is automatic."""
WORKERS_ENV = "REMAT_WORKERS"
"""An environment variable capping the automatic count (``1``: never fork), for a machine
whose cores other processes keep busy (a test runner's workers, other jobs): forked workers
only contend with them there (the ``sac`` executor's tests, two test workers on 2 cores:
5:24 with forks, 4:05 without)."""
MIN_WORK_S = 10.0
"""With the count automatic, the traces run here unless they add up to this much (timed from
the first): forking and pickling would cost more than they save."""

_WORK: Callable[..., Any] | None = None


def _cores() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def _auto_count() -> int:
    """One worker per core, at most :data:`AUTO_MAX` and :data:`WORKERS_ENV` where it is set."""
    count = min(_cores(), AUTO_MAX)
    cap = os.environ.get(WORKERS_ENV)
    if cap is None or not cap.strip():
        return count
    if not cap.strip().isdigit() or int(cap) < 1:
        raise ValueError(f"{WORKERS_ENV} must be a positive integer, got {cap!r}")
    return min(count, int(cap))


def _forkable() -> bool:
    """Linux only, as DataLoader forks only there (macOS's system libraries are not safe to
    use in a forked child)."""
    return sys.platform.startswith("linux") and not torch.cuda.is_initialized()


def _run(unit: Sequence[Any]) -> Any:
    assert _WORK is not None
    return _WORK(*unit)


def _start() -> None:
    torch.set_num_threads(1)


class Mapped(Iterator[Any]):
    """:func:`mapped`'s results, in order. :meth:`close` (or leaving a ``with`` block) stops
    the workers, where the caller gives up before reading them all."""

    def __init__(self, done: list[Any], rest: Iterator[Any], pool: Any = None) -> None:
        self._done, self._rest, self._pool = done, rest, pool

    def __next__(self) -> Any:
        if self._done:
            return self._done.pop(0)
        try:
            return next(self._rest)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        global _WORK
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None
            _WORK = None

    def __enter__(self) -> Mapped:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def mapped(
    work: Callable[..., Any],
    units: Sequence[Sequence[Any]],
    workers: int | None,
    announce: Callable[[int], None] | None = None,
    min_work_s: float = MIN_WORK_S,
) -> Mapped:
    """``work(*unit)`` for each unit, in order. ``workers``: processes (1: this one alone);
    None: the first unit here, then, where the rest would take ``min_work_s`` or more at its
    pace, one forked process per core (up to :data:`AUTO_MAX` and :data:`WORKERS_ENV`).
    ``work`` need not be picklable (the workers inherit it); its results must be.
    ``announce`` is called with the number of processes where there are several.

    Forked workers start on the units before this returns, so the caller can do other work
    while they trace; in this process, each unit runs as the iterator reaches it."""
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    todo = list(units)
    done: list[Any] = []
    if workers is None and todo:
        t0 = time.perf_counter()
        done.append(work(*todo[0]))
        todo = todo[1:]
        enough = (time.perf_counter() - t0) * len(todo) >= min_work_s
        workers = _auto_count() if enough else 1
    count = min(workers or 1, len(todo)) if _forkable() else 1
    if count <= 1:
        return Mapped(done, (work(*unit) for unit in todo))
    if announce:
        announce(count)
    global _WORK
    _WORK = work  # the workers inherit it as they fork (in Pool(), or to replace one)
    try:
        pool = multiprocessing.get_context("fork").Pool(count, initializer=_start)
    except BaseException:
        _WORK = None
        raise
    return Mapped(done, pool.imap(_run, todo), pool)
