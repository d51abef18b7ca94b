"""Waits that let gloo's worker thread finish before the step goes on (spawned ranks only).

gloo completes a collective's work on its own thread and marks it done *before* it drops
its references to the work's tensors (an all-reduce's output, an all-gather's input and
output). Python can let go of such a tensor first; its storage then dies on gloo's thread,
whenever that thread is next scheduled. With 2 to 4 ranks on 2 cores it can lag by several
ops, and the measured peak of a step varies from run to run with it (seen in CI: a
sequence-parallel keep_all step's live-storage peak an all-gather's input and output above
the same step's in other runs, ``tests/parallel/test_tensor_ranks.py``). The checks give
the thread the core after each wait, so a measured peak is the step's, not the host's
timing.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

SETTLE_S = 0.002
"""How long a wait yields the core to gloo's thread, at most."""


def _storage_refs(t: torch.Tensor) -> int:
    """References to ``t``'s storage, the one this call's storage object adds included."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


def settle_functional_waits() -> None:
    """After each functional collective's wait (tensor parallelism's all-reduces, sequence
    parallelism's all-gathers), yield the core to gloo's thread until its work lets go of
    the waited tensor's storage: the references to it fall below those held when the wait
    began, or to the one tensor Python holds (with the one this check adds). The work drops
    all its tensors at once, the collective's input too. Where Python also holds views of
    the tensor, the count cannot tell the work's references from Python's, and the wait
    yields for :data:`SETTLE_S`: the thread needs only to be scheduled to finish."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed import _functional_collectives as funcol

    wait = funcol.wait_tensor

    def settled(tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, FakeTensor):
            return wait(tensor)  # type: ignore[no-any-return]
        before = _storage_refs(tensor)
        out = wait(tensor)
        deadline = time.monotonic() + SETTLE_S
        while (refs := _storage_refs(out)) >= before and refs > 2:
            if time.monotonic() > deadline:
                break
            time.sleep(0.0001)
        return out  # type: ignore[no-any-return]

    funcol.wait_tensor = settled


def settle_work_waits() -> None:
    """After each wait on a c10d work (FSDP2's all-gathers and reduce-scatters), yield the
    core briefly, so that gloo's thread lets go of the work before Python does. Else the
    work dies on gloo's thread with the buffers it holds (a reduce-scatter's copy of its
    input, an all-gather's output), and the profiler, whose memory reporting is per thread,
    does not record their free: the allocator meter counts them live until their address is
    reused (seen on FSDP2, 2 ranks, one plan: the step's peak over the prediction by up to
    one 199,936-B block in 15 of 36 rank-steps without this wait, in none of 12 with it).
    The work's tensors are not at hand here, so this makes the lag rare (a sleep), where
    :func:`settle_functional_waits` rules it out; :func:`tests.checks.gloo_held` allows
    for it."""
    work = dist.distributed_c10d.Work
    wait = work.wait

    def settled(self: Any, *args: Any, **kwargs: Any) -> Any:
        done = wait(self, *args, **kwargs)
        time.sleep(0.001)
        return done

    work.wait = settled  # type: ignore[method-assign]
