"""Spawning a check's ranks: forked from a server that has imported torch, transformers and
remat once, not each a fresh interpreter (``mp.spawn``: about 2.7 s of CPU per rank, importing,
on these 2 cores). The server only imports (it runs no op, starts no thread pool), so forking
it is safe; each rank still builds its own process group."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.tensor.parallel",
    "transformers.models.llama.modeling_llama",
    "remat",
    "tests.executors.sac.agree_worker",
    "tests.executors.sac.dist_worker",
    "tests.parallel.pp_worker",
    "tests.parallel.tp_worker",
]
"""What the ranks import, imported once by the server (a module missing here is imported by
the rank itself)."""

ENV = ("MASTER_ADDR", "MASTER_PORT")
"""The variables a rank reads from the caller's environment: the server's is the one it
started with, so they are passed along."""


def spawn(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """``mp.spawn(fn, args, nprocs)`` with the ranks forked from the server."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # before the server starts; once per process
    env = {k: os.environ[k] for k in ENV if k in os.environ}
    mp.start_processes(_rank, args=(env, fn, *args), nprocs=nprocs, start_method="forkserver")


def _rank(rank: int, env: dict[str, str], fn: Callable[..., None], *args: Any) -> None:
    os.environ.update(env)
    fn(rank, *args)
