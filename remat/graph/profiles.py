"""Device profiles: what an op costs on a device, as a roofline.

A profile is a peak matmul throughput per dtype, a memory bandwidth and a fixed per-op launch
overhead; an op's time is ``max(flops / peak, bytes moved / bandwidth) + overhead``. Only
relative times matter to the solvers (recompute time vs step time), which a roofline gets right
to first order. GPU figures are the vendors' dense spec-sheet peaks. ``cpu`` is calibrated on
this machine by a short micro-benchmark (single-threaded, as per-node timings are only stable
that way on small machines).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    matmul_flops: Mapping[str, float]
    """Peak matmul FLOP/s by dtype name (``float32``, ``bfloat16``, ``float16``)."""
    bandwidth: float
    """Memory bandwidth, bytes/s."""
    op_overhead_s: float = 0.0
    memory_bytes: int = 0
    """Device memory, for reports; 0 when unknown."""
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or not self.matmul_flops or min(self.matmul_flops.values()) <= 0:
            raise ValueError(f"profile {self.name}: throughputs must be positive")

    def flops_per_s(self, dtype: str) -> float:
        return self.matmul_flops.get(dtype, self.matmul_flops.get("float32", 0.0)) or min(
            self.matmul_flops.values()
        )

    def op_time(self, flops: int, bytes_moved: int, dtype: str) -> float:
        return (
            max(flops / self.flops_per_s(dtype), bytes_moved / self.bandwidth) + self.op_overhead_s
        )


_GIB = 1024**3

GPU_PROFILES: Mapping[str, DeviceProfile] = {
    "a100": DeviceProfile(
        "a100",
        {"float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12},
        2.039e12,
        op_overhead_s=4e-6,
        memory_bytes=80 * _GIB,
        notes="A100 SXM 80GB, dense, TF32 off (PyTorch's default for matmul)",
    ),
    "h100": DeviceProfile(
        "h100",
        {"float32": 67e12, "bfloat16": 989e12, "float16": 989e12},
        3.35e12,
        op_overhead_s=4e-6,
        memory_bytes=80 * _GIB,
        notes="H100 SXM 80GB, dense",
    ),
    "h200": DeviceProfile(
        "h200",
        {"float32": 67e12, "bfloat16": 989e12, "float16": 989e12},
        4.8e12,
        op_overhead_s=4e-6,
        memory_bytes=141 * _GIB,
        notes="H200 SXM 141GB, dense",
    ),
}

PROFILE_NAMES = ("cpu", *GPU_PROFILES)


def auto_profile_name(device: torch.device) -> str:
    """The profile for the device a model lives on: ``cpu``, or the GPU model's name."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    for key in GPU_PROFILES:
        if key in name:
            return key
    raise ValueError(
        f"no device profile for {torch.cuda.get_device_name(device)!r}; pass device_profile= "
        f"one of {', '.join(PROFILE_NAMES)} or a remat.DeviceProfile"
    )


def get_profile(name: str | DeviceProfile) -> DeviceProfile:
    """A profile by name (``cpu`` is measured on first use), or a custom one passed through."""
    if isinstance(name, DeviceProfile):
        return name
    if name == "cpu":
        return calibrate_cpu()
    try:
        return GPU_PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown device profile {name!r}; valid: {', '.join(PROFILE_NAMES)} "
            "(or pass a remat.DeviceProfile)"
        ) from None


@functools.cache
def calibrate_cpu() -> DeviceProfile:
    """Measure single-threaded matmul throughput and copy bandwidth (~0.3 s, once a process)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = 256
        a, b = torch.randn(n, n, device="cpu"), torch.randn(n, n, device="cpu")
        flops = _best_rate(lambda: torch.mm(a, b), 2 * n**3)
        src = torch.randn(4 * 1024 * 1024, device="cpu")
        dst = torch.empty_like(src)
        bandwidth = _best_rate(lambda: dst.copy_(src), 2 * src.nbytes)
        small = torch.randn(8, device="cpu")
        overhead = 1.0 / _best_rate(lambda: small.add(1.0), 1)
    finally:
        torch.set_num_threads(threads)
    return DeviceProfile(
        "cpu",
        {"float32": flops, "bfloat16": flops / 4, "float16": flops / 4},
        bandwidth,
        op_overhead_s=overhead,
        notes="measured on this machine, 1 thread",
    )


def _best_rate(fn, work: float, repeats: int = 5, inner: int = 10) -> float:  # type: ignore[no-untyped-def]
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return work / best
