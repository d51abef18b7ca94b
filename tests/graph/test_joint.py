"""The joint graph's dropout rewrite: split into a saved mask and a recomputable product only
where that draws eager's random numbers (float32 on the CPU)."""

from __future__ import annotations

import operator

import pytest
import torch

from remat.graph.joint import _dropout_backward_vectorised, _split_dropout

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


def _dropout_backward_graph(grad: torch.Tensor, mask: torch.Tensor) -> torch.fx.Graph:
    graph = torch.fx.Graph()
    g, m = graph.placeholder("g"), graph.placeholder("m")
    g.meta["val"], m.meta["val"] = grad, mask
    node = graph.call_function(aten.native_dropout_backward.default, (g, m, 1 / 0.9))
    node.meta["val"] = torch.empty_like(grad)
    graph.output((node,))
    return graph


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_backward_converts_its_mask_vectorised_to_the_same_bits(
    dtype: torch.dtype,
) -> None:
    """float32 on the CPU: the fused op's ``(g * mask) * scale`` with the mask converted
    through uint8 (vectorised), bitwise, signed zeros, infinities and NaN included; other
    dtypes keep their own rewrite (``_dropout_backward_as_eager``)."""
    torch.manual_seed(0)
    grad = torch.randn(64, 33).to(dtype)
    grad[0, :6] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3e38])
    mask = torch.rand(64, 33) > 0.1
    mask[0, :6] = torch.tensor([False, False, False, True, False, True])
    graph = _dropout_backward_graph(grad, mask)
    _dropout_backward_vectorised(graph)
    graph.lint()
    ops = {n.target for n in graph.nodes if n.op == "call_function"}
    assert (aten.native_dropout_backward.default in ops) is (dtype != torch.float32)
    (got,) = torch.fx.GraphModule(torch.nn.Module(), graph)(grad, mask)
    want = aten.native_dropout_backward.default(grad, mask, 1 / 0.9)
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))  # fmt: skip
