"""Kernel scratch: what an op allocates and frees inside itself, measured once per signature."""

from __future__ import annotations

import torch

from remat.measure import scratch
from remat.measure.meter import allocator_peak_bytes
from remat.measure.scratch import call_of, measure_scratch, where_measured
from remat.models import TinyGPT
from remat.verify import verify

aten = torch.ops.aten


def test_scratch_is_the_in_op_peak_above_the_outputs() -> None:
    """``native_dropout_backward`` scales ``grad * mask`` in a temporary before the output:
    one temporary the size of the output, seen by the allocator, not by a tensor meter."""
    grad = torch.randn(64, 256)
    mask = torch.rand(64, 256) > 0.5
    call = call_of(aten.native_dropout_backward.default, (grad, mask, 2.0), {})
    assert call is not None
    (measured,) = measure_scratch([call])
    out_bytes = grad.nbytes
    peak = allocator_peak_bytes(lambda: aten.native_dropout_backward.default(grad, mask, 2.0))
    assert measured == peak - out_bytes > 0
    (pointwise,) = measure_scratch([call_of(aten.add.Tensor, (grad, grad), {})])
    assert pointwise == 0


def test_calls_hold_no_tensor_and_unmeasured_ops_are_left_out() -> None:
    x = torch.randn(8, 8)
    call = call_of(aten.mm.default, (x, x), {})
    assert call is not None
    assert not any(isinstance(leaf, torch.Tensor) for leaf in call.leaves)
    # Both arguments share one storage: so does the call made again.
    assert {leaf.group for leaf in call.leaves} == {0}
    assert call_of(aten.view.default, (x, [64]), {}) is None  # a view runs no kernel
    assert call_of(aten.add.Tensor, (1, 2), {}) is None  # no tensor
    before = len(scratch._CACHE)
    measure_scratch([call, call])
    measure_scratch([call])
    assert len(scratch._CACHE) <= before + 1  # once per signature


def test_where_scratch_is_measured() -> None:
    model = TinyGPT(vocab=16, dim=16, heads=2, layers=1, seq=8)
    assert where_measured(model, "cpu") is not None
    assert where_measured(model, "h100") is None  # CPU kernels say nothing of a GPU's


def test_outputs_measured_where_the_kernel_returns_a_larger_buffer() -> None:
    """CPU ``mse_loss`` returns a scalar viewing its elementwise losses: its storage is the
    input's size, not 4 B; the problem counts what the kernel holds, so a module whose
    output is that loss is predicted exactly."""

    class Regression(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(32, 32)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.lin(x), y)

    x, y = torch.randn(64, 32), torch.randn(64, 32)
    gm = torch.fx.symbolic_trace(lambda a, b: aten.mse_loss.default(a, b, 1))
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), (x, y), strict=True):
        node.meta["val"] = value
    mse = next(n for n in gm.graph.nodes if n.op == "call_function")
    held = {name: out for name, (_, out) in scratch.measure_graph(gm).items()}
    assert held == {mse.name: x.nbytes}
    result = verify(Regression(), (x, y))
    assert result.equal
    for step in result.steps:
        assert step.predicted_peak_bytes == step.measured_peak_bytes
        assert step.predicted_tensor_peak_bytes == step.measured_tensor_peak_bytes
