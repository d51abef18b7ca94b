"""``remat.apply`` on a tensor-parallel model: 2 processes, gloo, CPU.

The model is parallelized with ``parallelize_module`` first (DTensor weights, all-reduces
after the row-wise projections), then planned and wrapped: the trace runs the parallel step
on FakeTensors (collectives on fake tensors never leave the process). Per rank: parameters
after each of 3 AdamW steps (attention dropout on) bitwise equal to the same parallel run
without remat; the live-meter peak and the allocator's equal to the prediction, below the
budget and the eager peak; and as many collectives per step as without remat (a collective
is never recomputed). Applied before ``parallelize_module``, the first step refuses. And
planned ahead, on FakeTensors over a fake process group (``remat plan --tp-size``), each
fixed plan's live-tensor peak is the one measured on the ranks.

At the allocator the measured peak is the predicted one, or (in about half the runs, on rank
0) one all-reduced activation more: a clone that the functional all-reduce made, which
Python has already let go of (the live-storage meter, exact in every run, saw it freed) but
gloo's worker thread still holds when the backward reaches its peak, in RMSNorm's backward
just after an all-reduce of an input gradient. Its release races the main thread; remat does
not yet count that window, so under gloo a TP plan's allocator figure can be one such buffer
short of the real peak. The test asserts exactly those two outcomes, so a third fails it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.native import tp_worker
from tests.native.test_distributed import _free_port, assert_trained_alike

WORLD = 2


@pytest.mark.slow
def test_tensor_parallel_bitwise_and_predicted_per_rank(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    mp.spawn(tp_worker.main, args=(WORLD, str(tmp_path)), nprocs=WORLD)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"tp_{rank}.pt")
        assert got["solver"] == "native:auto"
        assert_trained_alike(got, rank)
        ours = got["remat"]
        assert got["least"] < ours["peak"] <= got["budget"] < got["plain"]["peak"], got
        assert ours["peak"] == got["predicted_tensors"], (rank, ours["peak"])
        assert got["predicted"] <= got["budget"]
        in_flight = 4 * 128 * 64 * 4  # batch x sequence x hidden, fp32: one all-reduced output
        assert ours["allocator"] - got["predicted"] in (0, in_flight), (rank, ours, got)
        plain_collectives, remat_collectives = got["collectives"]
        assert plain_collectives > 0 and remat_collectives == plain_collectives
        assert "parallelize_module ran after remat.apply" in got["wrong_order"]
        assert "Parallelize first, then call remat.apply" in got["wrong_order"]
        measured, ahead = got["fixed"]
        assert ahead == measured, (rank, ahead, measured)  # planned with no process group
