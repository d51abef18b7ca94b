"""CUDA's autocast lists on a CPU trace (plans for GPU profiles): float32-listed functions run
in float32, matmuls in 16 bits, and only inside the autocast region."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import remat
from remat.measure.autocast import CudaFloat32Ops, autocast_for, policy_of
from remat.models import TinyGPT


def test_float32_listed_functions_run_in_float32_only_under_autocast() -> None:
    x = torch.randn(4, 8)
    w = torch.randn(8, 8)
    with autocast_for("cpu", torch.bfloat16, "cuda"):
        h = x @ w  # lower-precision list (both devices): bfloat16
        assert h.dtype == torch.bfloat16
        assert F.softmax(h, dim=-1).dtype == torch.float32
        assert h.softmax(-1).dtype == torch.float32
        assert torch.exp(h).dtype == torch.float32
        assert F.layer_norm(h, (8,)).dtype == torch.float32
        assert h.sum().dtype == torch.float32
        assert F.softmax(h, dim=-1, dtype=torch.bfloat16).dtype == torch.bfloat16  # explicit
        assert (h + 1).dtype == torch.bfloat16  # not listed
    with autocast_for("cpu", torch.bfloat16, "native"):
        assert F.softmax(x @ w, dim=-1).dtype == torch.bfloat16  # CPU's own list
    with CudaFloat32Ops("cpu"):  # autocast off: nothing is cast
        assert F.softmax(h, dim=-1).dtype == torch.bfloat16
    assert policy_of("h100") == "cuda" and policy_of("cpu") == "native"


def test_a_gpu_profile_plans_the_float32_softmax_cuda_would_make() -> None:
    """TinyGPT's attention softmax reads a bfloat16 matmul: CPU autocast keeps it in
    bfloat16, CUDA's runs it in float32, so the h100 plan holds more (tensor peaks: kernel
    scratch is measured for the cpu profile only)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, heads=2, layers=2, seq=32)
    tokens = torch.randint(0, 64, (2, 32))
    dtypes, peaks = {}, {}
    for profile in ("cpu", "h100"):
        analysis = remat.analyze(model, (tokens,), precision="bf16-mixed", device_profile=profile)
        graph = analysis.joint.graph_module.graph
        dtypes[profile] = {
            n.meta["val"].dtype
            for n in graph.nodes
            if n.op == "call_function" and str(n.target) == "aten._softmax.default"
        }
        fast = remat.optimize(
            model, (tokens,), plan="keep_all", precision="bf16-mixed", device_profile=profile
        )
        peaks[profile] = fast.plan.predicted_tensor_peak_bytes
    assert dtypes == {"cpu": {torch.bfloat16}, "h100": {torch.float32}}
    assert peaks["h100"] > peaks["cpu"]
