"""The live-storage meter counts exactly what is allocated during the step, nothing else."""

from __future__ import annotations

import torch

from remat.measure.meter import LiveMemoryMeter, allocator_peak_bytes, peak_of_events


def test_counts_new_storages_and_frees() -> None:
    pre = torch.randn(1024)  # exists before: never charged
    with LiveMemoryMeter() as m:
        a = torch.empty(1000, dtype=torch.float32)  # 4,000 B
        v = a.view(10, 100)  # a view: free
        b = pre * 2  # 4,096 B
        del a
        assert m.live_bytes == 8096  # v still holds a's storage
        del v
        assert m.live_bytes == 4096
        c = pre.t() if pre.dim() == 2 else pre.view(32, 32)  # view of a pre-existing storage
        assert m.live_bytes == 4096
        del b, c
    assert m.live_bytes == 0
    assert m.peak_bytes == 8096


def test_peak_is_taken_when_outputs_exist_beside_inputs() -> None:
    with LiveMemoryMeter() as m:
        x = torch.ones(256)  # 1 KiB
        y = x + 1  # 1 KiB more while x is alive
        del x, y
        z = torch.ones(128)
        del z
    assert m.peak_bytes == 2048


def test_allocator_meter_sees_at_least_the_tensors() -> None:
    def step() -> None:
        x = torch.ones(1 << 16)
        (x * 2).sum()

    assert allocator_peak_bytes(step) >= 2 * 4 * (1 << 16)


def test_compiled_code_runs_compiled_under_the_meter() -> None:
    """Dynamo runs frames eagerly while a dispatch mode is active unless the mode says it
    ignores compile internals: without that, a torch.compile peer would be measured as eager."""
    calls = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        def run(*args: torch.Tensor):  # type: ignore[no-untyped-def]
            calls.append(1)
            return gm.forward(*args)

        return run

    torch._dynamo.reset()
    try:
        fn = torch.compile(lambda x: (x * 2).sin(), backend=backend)
        x = torch.randn(64)
        fn(x)  # compiled outside the meter
        calls.clear()
        with LiveMemoryMeter() as meter:
            fn(x)
    finally:
        torch._dynamo.reset()
    assert calls == [1]
    assert meter.peak_bytes >= 64 * 4


def test_allocator_peak_ignores_frees_of_blocks_allocated_before_the_step() -> None:
    """The profiler reports the free of a block allocated before the profiled step when an
    earlier profiled region allocated it (a training step frees the previous step's gradients
    as it starts): such a free must not lower the step's peak."""
    held: dict[str, torch.Tensor] = {}

    def allocate() -> None:
        held["old"] = torch.empty(1 << 20)

    allocator_peak_bytes(allocate)  # "old" is allocated inside a profiled region

    def step() -> torch.Tensor:
        del held["old"]
        return torch.ones(1 << 18)

    assert allocator_peak_bytes(step) == 4 * (1 << 18)


def test_a_block_whose_free_the_profiler_missed_stops_counting_when_its_address_returns() -> None:
    """gloo's worker thread, when it drops a collective's work last, frees the work's buffers
    where the profiler records no frees; the address coming back from malloc proves the block
    died. Events: (time, bytes, address)."""
    missed = [(0, 100, 1), (1, 50, 2), (2, -50, 2), (3, 80, 1), (4, 30, 3), (5, -80, 1)]
    assert peak_of_events(missed) == 150  # not 100 + 80 + 30 from t=4 on
    assert peak_of_events([*missed, (6, 200, 4)]) == 230  # 30 + 200: block 1 is gone
    recorded = [(0, 100, 1), (1, -100, 1), (2, 80, 1), (3, -80, 1)]
    assert peak_of_events(recorded) == 100
