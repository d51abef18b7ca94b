"""Test-session setup shared by every test module."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest-xdist each worker has a core of its own (`./run test` starts one per core):
    # more intra-op threads would only contend with the other worker. Results do not depend
    # on it: every comparison (bitwise, predicted == measured) is made within one process,
    # and the one test whose subject depends on the thread count pins it.
    torch.set_num_threads(1)
    # For the same reason, remat traces in place instead of forking a worker per core (the
    # automatic count; explicit counts still fork): the plans do not depend on it.
    os.environ.setdefault("REMAT_WORKERS", "1")


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, transformers, remat, the tests) lives to the end:
    moved out of the cyclic collector's reach, so that its full collections scan only what
    the tests make (9% of ``test_apply.py``'s and the zoo's ``auto`` sweeps' time without
    this, 5% with it).
    Only the collector's work changes: an object frozen here is still freed when its last
    reference goes, and the measured steps run with the collector off
    (:func:`remat.verify.verify`).

    And the youngest generation is collected every 20,000 allocations net, not 700: traces
    and solves make millions of short-lived objects, and each collection that promotes
    them makes the next full one longer (4.4 s of collection in 52 s of ``test_apply.py``'s
    and the zoo's ``auto`` sweeps on hf_llama with Python's thresholds, 2.1 s so)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, *gc.get_threshold()[1:])


@pytest.fixture(autouse=True)
def _no_terminal_size(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Output does not depend on the terminal pytest runs in: pytest-xdist's workers get
    ``COLUMNS=80``, which the CLI honours as the user's width, and a developer's shell may
    export any."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)
    yield
