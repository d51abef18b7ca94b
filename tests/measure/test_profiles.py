"""Device profiles: the documented spec figures, and what they predict."""

from __future__ import annotations

import pytest

from remat.measure.profiles import (
    ASCEND_GEMM_EFFICIENCY,
    GPU_PROFILES,
    PROFILE_NAMES,
    DeviceProfile,
    get_profile,
)

_GIB = 1024**3


@pytest.mark.parametrize(
    ("name", "bf16", "bandwidth", "memory"),
    [
        ("a100", 312e12, 2.039e12, 80 * _GIB),
        ("h100", 989e12, 3.35e12, 80 * _GIB),
        ("h200", 989e12, 4.8e12, 141 * _GIB),
        ("ascend910b3", 313e12, 1.6e12, 64 * _GIB),
        ("ascend910b4", 280e12, 0.8e12, 32 * _GIB),
    ],
)
def test_documented_figures(name: str, bf16: float, bandwidth: float, memory: int) -> None:
    profile = get_profile(name)
    assert name in PROFILE_NAMES and name in GPU_PROFILES
    assert profile.name == name
    assert profile.matmul_flops["bfloat16"] == bf16
    assert profile.matmul_flops["float16"] == bf16
    assert profile.bandwidth == bandwidth
    assert profile.memory_bytes == memory


def test_ascend_gemm_efficiency_is_15_percent_below_nvidia() -> None:
    assert ASCEND_GEMM_EFFICIENCY == 0.85
    for name in ("ascend910b3", "ascend910b4"):
        p = get_profile(name)
        assert p.matmul_efficiency == 0.85
        assert p.flops_per_s("bfloat16") == pytest.approx(0.85 * p.matmul_flops["bfloat16"])
    for name in ("a100", "h100", "h200"):
        p = get_profile(name)
        assert p.flops_per_s("bfloat16") == p.matmul_flops["bfloat16"]


@pytest.mark.parametrize("name", ["ascend910b3", "ascend910b4"])
def test_ascend_matmul_slower_than_h100(name: str) -> None:
    n = 4096  # a compute-bound bf16 GEMM: 2 n^3 FLOPs, three n x n operands moved
    flops, moved = 2 * n**3, 3 * n * n * 2
    h100, ascend = get_profile("h100"), get_profile(name)
    assert ascend.op_time(flops, moved, "bfloat16") > h100.op_time(flops, moved, "bfloat16")
    # e.g. the 910B3 at 0.85 x 313 TFLOPS against 989 TFLOPS: 3.7x the compute time.
    expect = (flops / (0.85 * ascend.matmul_flops["bfloat16"])) / (flops / 989e12)
    compute = ascend.op_time(flops, 0, "bfloat16") - ascend.op_overhead_s
    assert compute / (h100.op_time(flops, 0, "bfloat16") - h100.op_overhead_s) == pytest.approx(
        expect
    )


def test_unknown_profile_lists_the_ascend_names() -> None:
    with pytest.raises(ValueError, match="ascend910b3, ascend910b4"):
        get_profile("tpu")


def test_matmul_efficiency_is_checked() -> None:
    with pytest.raises(ValueError, match="matmul_efficiency"):
        DeviceProfile("bad", {"float32": 1e12}, 1e11, matmul_efficiency=1.5)


def test_the_cpu_profile_is_pinned_not_measured_per_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Plans must not move with the machine's load: ``cpu`` is one reference core, whatever
    this machine measures now; :func:`calibrate_cpu` is the measured one, on request."""
    from remat.measure import profiles

    monkeypatch.setattr(profiles, "calibrate_cpu", lambda: pytest.fail("measured"))
    assert profiles.get_profile("cpu") is profiles.CPU
    assert profiles.CPU.matmul_flops["float32"] > 0 and profiles.CPU.op_overhead_s > 0
