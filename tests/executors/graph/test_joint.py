"""The joint graph's dropout rewrite: split into a saved mask and a recomputable product only
where that draws eager's random numbers (float32 on the CPU), in eager's order whatever the
input's layout; and a model whose output is the dropout itself."""

from __future__ import annotations

import operator
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from remat.executors.graph.joint import _dropout_backward_vectorised, _split_dropout
from tests.checks import assert_trains_like_eager

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


VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "permute": lambda h: h.permute(0, 2, 1),  # Whisper's encoder: conv1d, permute, dropout
    "transpose_slice": lambda h: h.transpose(1, 2)[:, 2:9],
    "strided_slice": lambda h: h[:, :, ::2].transpose(1, 2),  # not dense
    "contiguous": lambda h: h.transpose(1, 2).contiguous(),
}


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_split_mask_draws_in_the_memory_order_of_eager_noise(view: str) -> None:
    """CPU ``bernoulli_`` fills its tensor in memory order and eager draws into
    ``empty_like(input)`` (the input's layout), while the functional ``bernoulli.p`` returns a
    contiguous tensor: drawn in that, a permuted input's mask got other elements' draws
    (outputs off by up to 2.19). Drawn contiguous in the input's memory order and permuted
    back, the split is eager's dropout bit for bit."""
    x = VIEWS[view](torch.randn(2, 8, 16))
    graph = _dropout_graph(x)
    _split_dropout(graph)
    graph.lint()
    assert aten.native_dropout.default not in {n.target for n in graph.nodes}
    torch.manual_seed(3)
    out, mask = torch.fx.GraphModule(nn.Module(), graph)(x)
    torch.manual_seed(3)
    want = F.dropout(x, 0.1, True)
    assert torch.equal(out, want) and torch.equal(mask, want != 0)


class ConvDropout(nn.Module):
    def __init__(self, view: str) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.lin = nn.Linear(8, 8)
        self.view = view

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(F.dropout(VIEWS[self.view](self.conv(x)), p=0.1, training=True))


class ChannelsLastDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).contiguous(memory_format=torch.channels_last)
        return F.dropout(h, 0.2, True).sum(dim=(2, 3))


@pytest.mark.parametrize("view", ["permute", "strided_slice", "channels_last"])
def test_dropout_on_a_non_contiguous_input_trains_bitwise(view: str) -> None:
    """Three AdamW steps with the mask saved and the product recomputed (``keep_inputs``)."""
    torch.manual_seed(0)
    if view == "channels_last":
        model: nn.Module = ChannelsLastDropout()
        x = torch.randn(2, 3, 8, 8)
    else:
        model, x = ConvDropout(view), torch.randn(2, 4, 16)
    assert_trains_like_eager(model, (x,), {}, plan="keep_inputs")


def test_whisper_encoder_trains_bitwise() -> None:
    """Whisper's encoder drops out ``conv2(...).permute(0, 2, 1)``."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    cfg = transformers.WhisperConfig(
        num_mel_bins=8, encoder_layers=1, d_model=32, encoder_attention_heads=2,
        encoder_ffn_dim=32, max_source_positions=16, dropout=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    encoder = WhisperEncoder(cfg)
    assert_trains_like_eager(encoder, (torch.randn(2, 8, 32),), {}, plan="keep_inputs")


class DropoutOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.lin(x), 0.1, True)


@pytest.mark.parametrize("plan", ["keep_all", "keep_inputs"])
def test_output_that_is_a_dropout_plans_and_trains_bitwise(plan: str) -> None:
    """The split replaces the fused op's output node, here a user output (it raised
    ``KeyError: 'getitem'`` when the outputs were looked up by their old names)."""
    torch.manual_seed(0)
    assert_trains_like_eager(DropoutOut(), (torch.randn(4, 8),), {}, plan=plan)
