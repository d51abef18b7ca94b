"""The annotated problem: roles, storage deduplication, FLOPs, randomness, module paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.measure.profiles import GPU_PROFILES, DeviceProfile, get_profile
from remat.problem import Role


class MLP(nn.Module):
    """in 64 -> fc1 128 -> relu -> dropout -> fc2 32, batch 16 (fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


@pytest.fixture(scope="module")
def mlp_problem() -> remat.Problem:
    torch.manual_seed(0)
    return remat.analyze(MLP(), (torch.randn(16, 64),), device_profile="a100").problem


def test_roles_and_outputs(mlp_problem: remat.Problem) -> None:
    roles = [v.role for v in mlp_problem.values]
    assert roles.count(Role.PARAM) == 4 and roles.count(Role.INPUT) == 1
    assert roles.count(Role.TANGENT) == 1
    assert len(mlp_problem.user_outputs) == 1
    assert len(mlp_problem.grad_outputs) == 4  # no gradient for the input (no requires_grad)


def test_exact_flops_of_the_matmuls(mlp_problem: remat.Problem) -> None:
    fwd = [v for v in mlp_problem.values if v.role is Role.FORWARD and v.op == "aten.addmm.default"]
    assert [v.flops for v in fwd] == [2 * 16 * 64 * 128, 2 * 16 * 128 * 32]
    bwd = sum(v.flops for v in mlp_problem.values if v.role is Role.BACKWARD)
    # grad_input of fc2 (16x32 @ 32x128), grad_weight of fc1 and fc2; no grad_input for fc1.
    assert bwd == 2 * (16 * 32 * 128) + 2 * (16 * 64 * 128) + 2 * (16 * 128 * 32)


def test_views_cost_nothing_and_storages_are_exact(mlp_problem: remat.Problem) -> None:
    for v in mlp_problem.values:
        if v.op in ("aten.t.default", "aten.view.default"):
            assert v.allocates == ()
    addmm = next(v for v in mlp_problem.values if v.op == "aten.addmm.default")
    assert [mlp_problem.storage_bytes[s] for s in addmm.allocates] == [16 * 128 * 4]


def test_dropout_is_random_and_module_paths_are_known(mlp_problem: remat.Problem) -> None:
    random = [v for v in mlp_problem.values if v.random]
    assert random and all(v.role is Role.FORWARD for v in random)
    assert {v.module_path for v in random} == {"drop"}
    paths = {v.module_path for v in mlp_problem.values if v.op == "aten.addmm.default"}
    assert paths == {"fc1", "fc2"}
    # Backward ops inherit the path of the forward op they differentiate.
    assert {v.module_path for v in mlp_problem.values if v.role is Role.BACKWARD} >= {"fc1", "fc2"}


def test_a100_roofline_time(mlp_problem: remat.Problem) -> None:
    a100 = GPU_PROFILES["a100"]
    addmm = next(v for v in mlp_problem.values if v.op == "aten.addmm.default")
    moved = 4 * (128 + 16 * 64 + 64 * 128 + 16 * 128)  # bias, input, weight, output
    expect = max(addmm.flops / a100.matmul_flops["float32"], moved / a100.bandwidth)
    assert addmm.time_s == pytest.approx(expect + a100.op_overhead_s)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 8, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_cpu_sdpa_has_flops() -> None:
    problem = remat.analyze(Attention(), (torch.randn(2, 8, 32),)).problem
    sdpa = [v for v in problem.values if "scaled_dot_product" in v.op]
    assert sdpa, "expected a fused attention op in the graph"
    fwd = next(v for v in sdpa if v.role is Role.FORWARD)
    assert fwd.flops == 2 * (2 * 2 * 4 * 8 * 8 * 8)  # QK^T and PV: 2*b*h*s*s*d each
    bwd = next(v for v in sdpa if v.role is Role.BACKWARD)
    assert bwd.flops > fwd.flops


def test_profiles() -> None:
    assert get_profile("h100").name == "h100"
    cpu = get_profile("cpu")
    assert cpu.matmul_flops["float32"] > 1e8 and cpu.bandwidth > 1e8
    custom = DeviceProfile("mine", {"float32": 1e12}, 1e11)
    assert get_profile(custom) is custom
    with pytest.raises(ValueError, match="valid: cpu, a100, h100, h200"):
        get_profile("tpu")


def test_view_ops_never_allocate_even_after_graph_rewrites() -> None:
    """Regression: the dropout split once gave the dropout output a fresh fake storage, so
    the views downstream of it looked like allocations (a 4 KiB over-prediction)."""
    from remat.models import TinyGPT

    problem = remat.analyze(
        TinyGPT(vocab=64, dim=32, layers=1, seq=16), (torch.randint(0, 64, (2, 16)),)
    ).problem
    views = {"aten.view.default", "aten.expand.default", "aten.transpose.int", "aten.t.default",
             "aten._unsafe_view.default", "aten.permute.default", "getitem", "aten.split.Tensor"}  # fmt: skip
    assert any(v.op == "aten.bernoulli.p" for v in problem.values)
    for v in problem.values:
        if v.op in views:
            assert v.allocates == (), f"{v.name} ({v.op}) allocates"


class _Attention(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p, is_causal=True).sum(1)


def test_attention_without_dropout_is_not_random_and_recomputes_bitwise() -> None:
    """CPU flash attention is tagged as seeded whatever its dropout_p; at 0 it draws nothing, so
    it may be recomputed (keep_inputs recomputes it) and the step stays bitwise."""
    from remat.verify import verify

    torch.manual_seed(0)
    x = torch.randn(2, 8, 16)
    problem = remat.analyze(_Attention(0.0), (x,)).problem
    attn = [v for v in problem.values if "flash_attention_for_cpu.default" in v.op]
    assert attn and not any(v.random for v in attn)
    check = verify(_Attention(0.0), (x,), plan="keep_inputs", steps=2)
    assert set(check.plan.recomputed) & {v.name for v in attn}
    assert all(not s.mismatches and s.predicted_tensor_peak_bytes == s.measured_tensor_peak_bytes
               for s in check.steps)  # fmt: skip
    # With dropout the CPU kernel takes the math path: its dropout op is random.
    dropped = remat.analyze(_Attention(0.5), (x,)).problem
    assert any(v.random for v in dropped.values if "dropout" in v.op or "bernoulli" in v.op)
