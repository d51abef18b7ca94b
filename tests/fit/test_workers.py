"""A native fit's traces on forked workers (``remat.fit.workers``): the same fit as in one
process, and processes forked only where asked or where the traces take long."""

from __future__ import annotations

import multiprocessing
import os
import sys

import pytest
import torch

from remat.fit import workers
from remat.fit.sac_formula import native_dynamic
from remat.request import Request
from tests.zoo import llama

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="remat forks its tracing workers on Linux only"
)


def _pid(k: int) -> tuple[int, int]:
    return k, os.getpid()


class _Clock:
    """Each reading ``step`` seconds after the last: the first unit "takes" ``step``."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


def test_units_run_in_order_on_workers_only_where_asked_or_worth_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    here = os.getpid()
    units = [(k,) for k in range(6)]
    forked = list(workers.mapped(_pid, units, 2))
    assert [k for k, _ in forked] == list(range(6))
    assert {p for _, p in forked} - {here}  # ran in forked processes
    # The automatic count, decided by the first unit's time on a stand-in clock and 2 cores.
    monkeypatch.delenv(workers.WORKERS_ENV, raising=False)
    monkeypatch.setattr(workers, "_cores", lambda: 2)
    monkeypatch.setattr(workers, "time", _Clock(workers.MIN_WORK_S / 10))  # 5 more: half
    assert list(workers.mapped(_pid, units, None)) == [(k, here) for k in range(6)]
    monkeypatch.setattr(workers, "time", _Clock(workers.MIN_WORK_S / 4))  # 5 more: 1.25x
    auto = list(workers.mapped(_pid, units, None))
    assert [k for k, _ in auto] == list(range(6)) and auto[0] == (0, here)
    assert {p for _, p in auto[1:]} - {here}
    with pytest.raises(ValueError, match="positive"):
        list(workers.mapped(_pid, [(0,)], 0))
    # The environment's cap: 1 keeps the automatic count in this process; a bad value is
    # named.
    monkeypatch.setenv(workers.WORKERS_ENV, "1")
    assert list(workers.mapped(_pid, units, None)) == [(k, here) for k in range(6)]
    monkeypatch.setenv(workers.WORKERS_ENV, "two")
    with pytest.raises(ValueError, match="REMAT_WORKERS must be a positive integer, got 'two'"):
        list(workers.mapped(_pid, units, None))


def test_a_fit_traced_on_two_workers_is_the_fit_traced_in_one_process() -> None:
    torch.manual_seed(0)
    model = llama(2, 64).train()
    args = (torch.randint(0, 128, (2, 16)),)
    seen: list[str] = []
    fits = {}
    for n in (1, 2):
        req = Request.of(device_profile="cpu", workers=n, progress=seen.append)
        fits[n], _ = native_dynamic(model, args, {}, req, plans=("block",), batch=2)
    assert any("on 2 processes" in m for m in seen)
    one, two = fits[1], fits[2]
    assert one.policies == two.policies and len(one.ranges) == len(two.ranges)
    for r1, r2 in zip(one.ranges, two.ranges, strict=True):
        assert r1.shapes == r2.shapes and list(r1.steps) == list(r2.steps)
        for name, s1 in r1.steps.items():
            s2 = r2.steps[name]
            assert s1.peak == s2.peak and s1.monomials == s2.monomials
            assert s1.dtypes == s2.dtypes
            for field in ("flops", "moved", "timed", "recompute", "weights"):
                assert torch.equal(getattr(s1, field), getattr(s2, field)), (name, field)


def test_forked_workers_start_before_their_results_are_read() -> None:
    """The caller works while the workers trace (a deep fit analyses the model meanwhile):
    the pool's processes are running when ``mapped`` returns, before any result is read."""
    units = [(k,) for k in range(4)]
    before = set(multiprocessing.active_children())
    with workers.mapped(_pid, units, 2) as results:
        assert len(set(multiprocessing.active_children()) - before) == 2
        assert [k for k, _ in results] == list(range(4))
