"""Device profiles: what an op costs on a device, as a roofline.

A profile is a peak matmul throughput per dtype, a memory bandwidth and a fixed per-op launch
overhead; an op's time is ``max(flops / peak, bytes moved / bandwidth) + overhead``. Only
relative times matter to the solvers (recompute time vs step time), which a roofline gets right
to first order. GPU figures are the vendors' dense spec-sheet peaks (each profile names its
source); Ascend NPUs add a GEMM efficiency below NVIDIA's. ``cpu`` is one reference core
(:data:`CPU`), pinned so that a plan never moves with the machine's load;
:func:`calibrate_cpu` measures this machine's instead (single-threaded, as per-node timings
are only stable that way on small machines), to pass as ``device_profile=``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from remat.problem import DispatchCosts, Link


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
    matmul_efficiency: float = 1.0
    """Fraction of the ``matmul_flops`` peak a GEMM reaches, relative to the NVIDIA profiles
    (which take the spec-sheet peak as reached: 1.0)."""
    sac_dispatch: DispatchCosts = DispatchCosts()
    """Selective checkpointing's own cost per op (the ``sac`` executor's time model)."""
    link: Link | None = None
    """The copy link to host memory, for offload (``None``: a host budget is refused)."""

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or not self.matmul_flops or min(self.matmul_flops.values()) <= 0:
            raise ValueError(f"profile {self.name}: throughputs must be positive")
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"profile {self.name}: matmul_efficiency must be in (0, 1]")

    def flops_per_s(self, dtype: str) -> float:
        peak = self.matmul_flops.get(dtype, self.matmul_flops.get("float32", 0.0)) or min(
            self.matmul_flops.values()
        )
        return peak * self.matmul_efficiency

    def op_time(self, flops: int, bytes_moved: int, dtype: str) -> float:
        return (
            max(flops / self.flops_per_s(dtype), bytes_moved / self.bandwidth) + self.op_overhead_s
        )


_GIB = 1024**3

CPU_SAC_DISPATCH = DispatchCosts(
    forward_saved_s=19.4e-6,
    forward_recomputed_s=12.7e-6,
    replay_hit_s=20.2e-6,
    replay_recomputed_s=17.9e-6,
    region_s=190e-6,
    source=(
        "experiments/sac_dispatch.py on the reference core (2-core AMD EPYC, 1 thread, "
        "PyTorch 2.13, remat's policy): medians of three runs"
    ),
)
"""SAC's per-op cost on the ``cpu`` profile's reference core, pinned (as :data:`CPU` is)."""

GPU_SAC_DISPATCH = replace(
    CPU_SAC_DISPATCH,
    overlapped=True,
    source=(
        "estimate, not measured on a GPU: the policy is host-side Python, so the reference "
        "core's figures, counted only where a region's dispatch outlasts its kernels"
    ),
)
"""SAC's per-op cost on the GPU and NPU profiles: a labelled estimate (see ``source``)."""

# Copy links to pinned host memory (public measurements, none made here). Alone on the link
# each direction runs at its figure; both at once share it.
A100_LINK = Link(
    d2h=25e9,
    h2d=25e9,
    shared_d2h=25e9,
    shared_h2d=11e9,
    source=(
        "PCIe Gen4 x16 with pinned memory: ~25 GB/s each way; both at once, host-to-device "
        "fell to ~11 GB/s while device-to-host held 25 (public bandwidth-test reports)"
    ),
)
H100_LINK = Link(
    d2h=53e9,
    h2d=53e9,
    shared_d2h=53e9,
    shared_h2d=53e9 * 11 / 25,
    source=(
        "PCIe Gen5 x16 with pinned memory and the copy engines: 52-55 GB/s each way (public "
        "bandwidth-test reports); both at once: no figure found, A100's share assumed"
    ),
)
GH200_LINK = Link(
    d2h=170e9,
    h2d=380e9,
    source=(
        "NVLink-C2C: host-to-device 346-421 GB/s, device-to-host ~170 GB/s (public "
        "bandwidth-test reports); both at once: no figure found, each alone's assumed"
    ),
)
ASCEND_LINK = Link(
    d2h=23e9,
    h2d=23e9,
    source=(
        "Ascend 910B4 with registered host memory: ~23 GB/s host-to-device (a public "
        "report); device-to-host and both at once: no figure found, the same assumed"
    ),
)

ASCEND_GEMM_EFFICIENCY = 0.85
"""Ascend GEMMs reach about 15% less of their peak than NVIDIA's do of theirs: a
practitioners' report (CANN matmul kernels against cuBLAS at LLM shapes), not a vendor
figure nor measured here."""

GPU_PROFILES: Mapping[str, DeviceProfile] = {
    # Source: NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM column).
    "a100": DeviceProfile(
        "a100",
        {"float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12},
        2.039e12,
        op_overhead_s=4e-6,
        sac_dispatch=GPU_SAC_DISPATCH,
        link=A100_LINK,
        memory_bytes=80 * _GIB,
        notes="A100 SXM 80GB, dense, TF32 off (PyTorch's default for matmul)",
    ),
    # Source: NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column; dense, without sparsity).
    "h100": DeviceProfile(
        "h100",
        {"float32": 67e12, "bfloat16": 989e12, "float16": 989e12},
        3.35e12,
        op_overhead_s=4e-6,
        sac_dispatch=GPU_SAC_DISPATCH,
        link=H100_LINK,
        memory_bytes=80 * _GIB,
        notes="H100 SXM 80GB, dense",
    ),
    # Source: NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column; dense, without sparsity).
    "h200": DeviceProfile(
        "h200",
        {"float32": 67e12, "bfloat16": 989e12, "float16": 989e12},
        4.8e12,
        op_overhead_s=4e-6,
        sac_dispatch=GPU_SAC_DISPATCH,
        link=H100_LINK,
        memory_bytes=141 * _GIB,
        notes="H200 SXM 141GB, dense",
    ),
    # Source: NVIDIA GH200 Grace Hopper Superchip datasheet (GH200 with 96GB HBM3: the H100's
    # compute at 4 TB/s); its host link is NVLink-C2C.
    "gh200": DeviceProfile(
        "gh200",
        {"float32": 67e12, "bfloat16": 989e12, "float16": 989e12},
        4.0e12,
        op_overhead_s=4e-6,
        sac_dispatch=GPU_SAC_DISPATCH,
        link=GH200_LINK,
        memory_bytes=96 * _GIB,
        notes="GH200 96GB HBM3, dense; NVLink-C2C to the Grace CPU's memory",
    ),
    # Huawei publishes no per-chip datasheet for the 910B SKUs: the figures below are the
    # widely circulated third-party spec tables (not checked against a Huawei document;
    # other third-party pages disagree on bandwidth). fp16 and bf16 share the cube unit's
    # rate. No float32 matmul figure was found: 1/4 of fp16 is assumed. Launch overhead as
    # NVIDIA's (no figure found).
    # Source: third-party 910B spec tables: Ascend 910B3, 313 TFLOPS fp16/bf16 dense,
    # 64 GB HBM2e at 1.6 TB/s (the chip of Atlas 800T A2 training servers).
    "ascend910b3": DeviceProfile(
        "ascend910b3",
        {"float32": 313e12 / 4, "bfloat16": 313e12, "float16": 313e12},
        1.6e12,
        op_overhead_s=4e-6,
        sac_dispatch=GPU_SAC_DISPATCH,
        link=ASCEND_LINK,
        memory_bytes=64 * _GIB,
        notes="Ascend 910B3 64GB HBM2e, dense; GEMM efficiency 0.85 (practitioners' report)",
        matmul_efficiency=ASCEND_GEMM_EFFICIENCY,
    ),
    # Source: third-party 910B spec tables: Ascend 910B4, 32 GB HBM2e at 0.8 TB/s; its
    # fp16/bf16 peak, 280 TFLOPS dense, is the figure those tables quote, unverified.
    "ascend910b4": DeviceProfile(
        "ascend910b4",
        {"float32": 280e12 / 4, "bfloat16": 280e12, "float16": 280e12},
        0.8e12,
        op_overhead_s=4e-6,
        sac_dispatch=GPU_SAC_DISPATCH,
        link=ASCEND_LINK,
        memory_bytes=32 * _GIB,
        notes="Ascend 910B4 32GB HBM2e, dense; GEMM efficiency 0.85 (practitioners' report)",
        matmul_efficiency=ASCEND_GEMM_EFFICIENCY,
    ),
}
"""Accelerator profiles (NVIDIA GPUs and Ascend NPUs); a plan for one is traced with CUDA's
autocast lists (``remat/measure/autocast.py``), which torch_npu's autocast follows."""

PROFILE_NAMES = ("cpu", *GPU_PROFILES)


def auto_profile_name(device: torch.device) -> str:
    """The profile for the device a model lives on: ``cpu``, the GPU model's name, or the
    Ascend SKU's (torch_npu's ``npu`` device, named e.g. ``Ascend910B3``)."""
    if device.type not in ("cuda", "npu"):
        return "cpu"
    backend: Any = getattr(torch, device.type)
    name = str(backend.get_device_name(device)).lower()
    for key in GPU_PROFILES:
        if key in name:
            return key
    raise ValueError(
        f"no device profile for {backend.get_device_name(device)!r}; pass device_profile= "
        f"one of {', '.join(PROFILE_NAMES)} or a remat.DeviceProfile"
    )


CPU_HOST_STORE = Link(
    d2h=47e9 / 2,
    h2d=47e9 / 2,
    synchronous=True,
    source=(
        "a CPU device offloads to a host store in the same memory: each copy is a memcpy "
        "that blocks the step, at half the reference core's copy bandwidth (47 GB/s counts "
        "the bytes read and written)"
    ),
)
"""The ``cpu`` profile's offload: copies into a host store beside PyTorch's allocator, run
inline (nothing hides them), saving no real memory on a CPU device: it lets tests measure
device bytes as a GPU would."""

CPU = DeviceProfile(
    "cpu",
    {"float32": 103e9, "bfloat16": 103e9 / 4, "float16": 103e9 / 4},
    47e9,
    op_overhead_s=3.3e-6,
    sac_dispatch=CPU_SAC_DISPATCH,
    link=CPU_HOST_STORE,
    notes=(
        "one reference core (an AMD EPYC), pinned: calibrate_cpu() on an idle 2-core "
        "machine, 1 thread, measured 102.7-102.9 GFLOP/s fp32, 45-50 GB/s and 3.2-3.3 us per op"
    ),
)
"""The ``cpu`` profile. Pinned, not measured per process: calibration under load gave other
costs (its bandwidth moved by 10% between idle runs), and so other plans, on ranks of one job."""


def get_profile(name: str | DeviceProfile) -> DeviceProfile:
    """A profile by name (``cpu``: :data:`CPU`), or a custom one passed through."""
    if isinstance(name, DeviceProfile):
        return name
    if name == "cpu":
        return CPU
    try:
        return GPU_PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown device profile {name!r}; valid: {', '.join(PROFILE_NAMES)} "
            "(or pass a remat.DeviceProfile)"
        ) from None


@functools.cache
def calibrate_cpu() -> DeviceProfile:
    """This machine's single-threaded matmul throughput, copy bandwidth and per-op overhead
    (~0.3 s, once a process): a profile to pass as ``device_profile=`` where costs should be
    this CPU's; it moves with the machine's load, so plans made with it may too."""
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
        sac_dispatch=CPU_SAC_DISPATCH,
        link=replace(CPU_HOST_STORE, d2h=bandwidth / 2, h2d=bandwidth / 2, source="measured"),
        notes="measured on this machine, 1 thread (SAC dispatch: the reference core's)",
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
