"""``remat.apply`` under a real distributed engine: DDP and FSDP2, 2 processes, gloo, CPU.

Per rank: parameters after each of 3 AdamW steps (dropout on, each rank its own batch and
random stream) bitwise equal to the same run without remat, and the steady step's live-meter
peak lower, and equal to remat's prediction: for DDP the single-device step's, for FSDP2
(``zero_stage=3, world_size=2``) the step traced under ``fully_shard`` on a fake process group;
``fsdp2-bf16`` is FSDP2 with its own mixed precision (``precision="bf16-fsdp"``: bf16 gathered
parameters, fp32 reduce-scatter), traced under the same ``MixedPrecisionPolicy``;
``fsdp2-offload`` is FSDP2 with a host budget, whose plan offloads block inputs (each rank's
host store's peak is the predicted one). The
allocator's peak, also lower, is the predicted one, or above it by at most two buffers that
gloo's worker thread let go of late (:func:`tests.checks.gloo_held`; the ranks wait for it,
:func:`tests.executors.sac.gloo_settle.settle_work_waits`, which makes that rare).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checks import gloo_held
from tests.executors.sac import dist_worker
from tests.executors.sac.ranks import spawn

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


ENGINES = ("ddp", "fsdp2", "fsdp2-bf16", "fsdp2-offload")


def _budgets() -> dict[str, int]:
    """Per engine, half-way between the every-block plan's peak and eager's, one device (DDP
    and FSDP2 alike: their budget is the single-device step's); under FSDP2's bf16 mixed
    precision (activations half as large) the same between the peaks traced for one rank of
    that step; with a host budget, a tenth of the way between those of FSDP2's fp32 step,
    where the plan offloads block inputs."""
    import copy

    import remat
    from remat.measure.meter import measure_step

    model, tokens = dist_worker.build()

    def peak(plan: str, options: dict[str, Any]) -> int:
        applied = remat.apply(copy.deepcopy(model), tokens, plan=plan, **options)
        return remat.plan_of(applied).predicted_peak_bytes

    out = {}
    for engine in ("fsdp2", "fsdp2-bf16", "fsdp2-offload"):
        options: dict[str, Any] = {}
        if engine == "fsdp2":
            eager = measure_step(copy.deepcopy(model), (tokens,)).peak_bytes
        else:
            options = {"zero_stage": 3, "world_size": WORLD}
            if engine == "fsdp2-bf16":
                options["precision"] = "bf16-fsdp"
            eager = peak("keep_all", options)
        block = peak("block", options)
        out[engine] = block + (eager - block) // (10 if engine == "fsdp2-offload" else 2)
    return {"ddp": out["fsdp2"], **out}


def _gloo_buffers(engine: str) -> list[int]:
    """Bytes of the buffers gloo's thread can hold past a collective under ``engine``
    (:func:`tests.checks.gloo_held`): each FSDP2 unit's all-gather output (its parameters,
    dim 0 padded to the world size, in the gathered dtype) and its reduce-scatter's copy of
    the gradients (in fp32). DDP's buckets live through the step: none."""
    if engine == "ddp":
        return []
    model, _ = dist_worker.build()
    units = [list(b.parameters()) for b in model.blocks]  # type: ignore[union-attr]
    inside = {id(p) for unit in units for p in unit}
    units.append([p for p in model.parameters() if id(p) not in inside])
    gathered = 2 if engine == "fsdp2-bf16" else 4
    out = []
    for unit in units:
        numel = sum(-(-p.shape[0] // WORLD) * WORLD * p[0].numel() for p in unit)
        out += [numel * gathered, numel * 4]
    return out


def assert_trained_alike(got: dict[str, Any], rank: int | str) -> None:
    """A rank's parameters after every step, with remat and without, bitwise equal
    (``rank``: the rank, or where it ran)."""
    for step, (a, b) in enumerate(zip(got["plain"]["params"], got["remat"]["params"], strict=True)):
        for name in a:
            assert torch.equal(a[name], b[name]), f"rank {rank} step {step}: {name}"


@pytest.mark.slow
def test_bitwise_and_lower_peak_per_rank(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every engine of :data:`ENGINES`, one after the other in one spawn; every rank
    trains rank 0's plan (``remat.apply``'s default ``group``)."""
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    spawn(dist_worker.main, (WORLD, _budgets(), str(tmp_path)), WORLD)
    for engine in ENGINES:
        buffers = _gloo_buffers(engine)
        first = torch.load(tmp_path / f"{engine}_0.pt")
        for rank in range(WORLD):
            got = torch.load(tmp_path / f"{engine}_{rank}.pt")
            where = f"{engine} rank {rank}"
            assert got["solver"] == "native:auto", where
            # One plan for the group: rank 0 solved it, the others applied its broadcast.
            assert got["saved"] == first["saved"], where
            if rank:
                assert got["reason"].startswith("planned on rank 0 and broadcast"), where
            assert_trained_alike(got, where)
            ours = got["remat"]
            assert ours["peak"] < got["plain"]["peak"], (where, ours["peak"])
            assert ours["allocator"] < got["plain"]["allocator"], (where, ours["allocator"])
            assert ours["peak"] == got["predicted_tensors"], (where, ours["peak"])
            held = gloo_held(got["predicted"], ours["allocator"], buffers)
            assert held, (f"{where}, allocator", got["predicted"], ours["allocator"])
            if engine == "fsdp2-offload":  # every rank's host store holds what rank 0 planned
                assert got["offloaded_bytes"] > 0, (where, got["reason"])
                assert got["host_measured"] == got["host_predicted"] > 0, where


@pytest.mark.slow
def test_fsdp2_example_script_runs() -> None:
    """The README's recipe, ``examples/fsdp2_native.py``, as a user runs it."""
    import subprocess
    import sys

    script = Path(__file__).parents[3] / "examples" / "fsdp2_native.py"
    done = subprocess.run(
        [sys.executable, str(script), "--steps", "1", "--port", str(_free_port())],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "plan 'native:auto'" in done.stdout and "step 0: loss" in done.stdout
