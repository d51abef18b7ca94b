"""The joint graph's dropout rewrite: split into a saved mask and a recomputable product only
where that draws eager's random numbers (float32 on the CPU)."""

from __future__ import annotations

import operator

import pytest
import torch

from remat.graph.joint import _split_dropout

aten = torch.ops.aten


def _dropout_graph(x: torch.Tensor) -> torch.fx.Graph:
    graph = torch.fx.Graph()
    inp = graph.placeholder("x")
    inp.meta["val"] = x
    node = graph.call_function(aten.native_dropout.default, (inp, 0.1, True))
    out = graph.call_function(operator.getitem, (node, 0))
    mask = graph.call_function(operator.getitem, (node, 1))
    out.meta["val"] = torch.empty_like(x)
    mask.meta["val"] = torch.empty_like(x, dtype=torch.bool)
    graph.output((out, mask))
    return graph


@pytest.mark.parametrize(
    ("device", "dtype", "split"),
    [("cpu", torch.float32, True), ("cpu", torch.bfloat16, False), ("meta", torch.float32, False)],
)
def test_dropout_is_split_only_where_eager_draws_the_same_numbers(
    device: str, dtype: torch.dtype, split: bool
) -> None:
    """On the CPU eager float32 dropout draws ``bernoulli`` as the split does (bitwise in the
    zoo tests); 16-bit inputs, and any other device (eager CUDA runs the fused Philox kernel:
    the split was off by up to 29 on an H200), keep the fused op."""
    graph = _dropout_graph(torch.empty(4, 8, dtype=dtype, device=device))
    _split_dropout(graph)
    graph.lint()
    ops = {n.target for n in graph.nodes if n.op == "call_function"}
    assert (aten.bernoulli.p in ops) is split
    assert (aten.native_dropout.default in ops) is not split


def test_split_dropout_backward_reads_the_forward_noise_bitwise() -> None:
    """The backward ``native_dropout_backward(g, mask, scale)`` becomes eager's ``g * noise``
    with the forward's ``noise`` (no bool-to-float conversion per call: 3-5% of a GPT-2 step),
    and forward and backward equal the fused ops bit for bit, signed zeros and NaNs included."""
    x = torch.tensor([1.5, -2.0, 0.0, -0.0, float("inf"), float("nan"), 3e38, -1e-30] * 32)
    graph = torch.fx.Graph()
    inp, grad = graph.placeholder("x"), graph.placeholder("g")
    inp.meta["val"], grad.meta["val"] = x, x
    node = graph.call_function(aten.native_dropout.default, (inp, 0.1, True))
    out = graph.call_function(operator.getitem, (node, 0))
    mask = graph.call_function(operator.getitem, (node, 1))
    out.meta["val"], mask.meta["val"] = torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)
    back = graph.call_function(aten.native_dropout_backward.default, (grad, mask, 1 / 0.9))
    back.meta["val"] = torch.empty_like(x)
    graph.output((out, mask, back))
    _split_dropout(graph)
    graph.lint()
    ops = [n.target for n in graph.nodes if n.op == "call_function"]
    assert aten.native_dropout_backward.default not in ops
    noise = next(n for n in graph.nodes if n.target is aten.mul.Tensor and n.args[1] == 1 / 0.9)
    assert {u.args[1] for u in noise.users} == {noise}  # x * noise and g * noise
    torch.manual_seed(0)
    got_out, got_mask, got_back = torch.fx.GraphModule({}, graph)(x, x)
    dropped = x[~got_mask]  # negative, infinite and NaN inputs among the dropped ones
    assert (dropped == -2.0).any() and dropped.isinf().any() and dropped.isnan().any()
    want_out = x * got_mask * (1 / 0.9)
    want_back = aten.native_dropout_backward.default(x, got_mask, 1 / 0.9)
    for got, want in ((got_out, want_out), (got_back, want_back)):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
