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
