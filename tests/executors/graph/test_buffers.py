"""Buffers eager does not allocate: clones that copy nothing are dropped, gradient sums run in
place on their first operand where eager autograd's would (``remat.executors.graph.buffers``)."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from remat import _torch_compat as tc
from remat.executors.graph.analyze import analyze
from remat.executors.graph.buffers import drop_copies, sum_in_place
from remat.problem import Role
from tests.checks import assert_trains_like_eager

aten = torch.ops.aten


class _Shared(nn.Module):
    """``h`` feeds two layers, so its gradient is a sum; dropout at p = 0 is a clone once
    decomposed (eager returns its input itself)."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(width, width) for _ in range(3))
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.a(x)))
        return self.b(h) * self.c(h)


def _inputs() -> tuple[torch.Tensor]:
    return (torch.randn(512, 256),)


def test_the_step_has_no_dropout_copy_and_sums_gradients_in_place() -> None:
    torch.manual_seed(0)
    analysis = analyze(_Shared(), _inputs())
    problem = analysis.problem
    assert not any(v.op == str(aten.clone.default) for v in problem.values)
    sums = [v for v in problem.values if v.op == str(aten.add_.Tensor)]
    assert sums, "the gradient of h should be summed in place"
    by_name = problem.by_name
    for v in sums:
        assert v.role is Role.BACKWARD
        assert v.allocates == ()  # it holds its first operand's buffer
        assert v.storages == by_name[v.inputs[0]].storages
        assert v.time_s > 0  # a kernel, not a view
    assert not any(v.op == str(aten.add.Tensor) and v.role is Role.BACKWARD
                   for v in problem.values)  # fmt: skip


@pytest.mark.parametrize("plan", ["keep_all", "keep_inputs", "keep_matmuls"])
def test_in_place_sums_train_like_eager_at_the_predicted_peak(plan: str) -> None:
    """Bitwise over optimizer steps, and the measured peaks (allocator and live storages)
    equal the prediction exactly: the problem holds the buffers the in-place run holds."""
    torch.manual_seed(0)
    result = assert_trains_like_eager(_Shared(), _inputs(), {}, plan=plan)
    for s in result.steps:
        assert s.measured_peak_bytes == s.predicted_peak_bytes
        assert s.measured_tensor_peak_bytes == s.predicted_tensor_peak_bytes


def _node(graph: fx.Graph, op: object, args: tuple[object, ...], val: torch.Tensor) -> fx.Node:
    node = graph.call_function(op, args)  # type: ignore[arg-type]
    node.meta["val"] = val
    return node


def _graph() -> tuple[fx.Graph, fx.Node]:
    """A graph with one (4, 8) input."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 8)
    return graph, x


def test_only_copies_of_the_steps_own_dense_values_that_are_not_outputs_are_dropped() -> None:
    graph, x = _graph()
    y = _node(graph, aten.relu.default, (x,), torch.empty(4, 8))
    copy = _node(graph, aten.clone.default, (y,), torch.empty(4, 8))
    of_input = _node(graph, aten.clone.default, (x,), torch.empty(4, 8))
    transposed = _node(graph, aten.t.default, (y,), y.meta["val"].t())
    relaid = _node(graph, aten.clone.default, (transposed,), torch.empty(8, 4))
    returned = _node(graph, aten.clone.default, (y,), torch.empty(4, 8))
    total = _node(graph, aten.add.Tensor, (copy, of_input), torch.empty(4, 8))
    graph.output((total, relaid, returned))
    assert drop_copies(graph) == 1
    graph.lint()
    assert copy not in graph.nodes and total.args[0] is y
    assert {of_input, relaid, returned} <= set(graph.nodes)


def test_a_sum_is_in_place_only_where_nothing_reads_its_first_operand_later() -> None:
    graph, x = _graph()
    g1 = _node(graph, aten.relu.default, (x,), torch.empty(4, 8))
    g2 = _node(graph, aten.sigmoid.default, (x,), torch.empty(4, 8))
    read_later = _node(graph, aten.add.Tensor, (g1, g2), torch.empty(4, 8))
    again = _node(graph, aten.mul.Tensor, (g1, 2.0), torch.empty(4, 8))
    last = _node(graph, aten.add.Tensor, (again, read_later), torch.empty(4, 8))
    from_input = _node(graph, aten.add.Tensor, (x, last), torch.empty(4, 8))
    graph.output((from_input,))
    backward = {n.name for n in graph.nodes if n.op == "call_function"}
    assert sum_in_place(graph, backward) == 1
    graph.lint()
    assert read_later.target is aten.add.Tensor  # g1 is read after it
    assert last.target is aten.add_.Tensor
    assert from_input.target is aten.add.Tensor  # x is an input's buffer
    # The in-place sum holds its first operand's storage.
    assert tc.storage_key(last.meta["val"]) == tc.storage_key(again.meta["val"])
