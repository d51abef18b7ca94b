"""Capture: output structures, kwargs, fallbacks, and the errors a user sees."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat
from remat.executors.graph.analyze import fixed_plan
from remat.executors.graph.capture import CaptureError, capture
from remat.executors.graph.joint import build_joint
from remat.executors.graph.module import Compiled, RematModule, signature
from remat.executors.graph.run import build_executor
from remat.executors.graph.to_problem import build_problem
from tests.zoo import StraightThrough


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> dict[str, object]:
        y = self.lin(x) * scale
        return {"y": y, "sum": y.sum(), "note": "constant", "n": 3}


def test_dict_output_with_constants_is_rebuilt() -> None:
    model = DictOut()
    x = torch.randn(2, 4)
    fast = remat.optimize(model, x, example_kwargs={"scale": 2.0})
    out = fast(x, scale=2.0)
    ref = model(x, scale=2.0)
    assert set(out) == {"y", "sum", "note", "n"}
    assert out["note"] == "constant" and out["n"] == 3
    assert torch.equal(out["y"], ref["y"]) and torch.equal(out["sum"], ref["sum"])


def test_hf_model_output_and_use_cache_default() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 64, (1, 8))
    fast = remat.optimize(model, ids)
    out = fast(ids)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    assert out.past_key_values is None  # use_cache=False was passed for training
    assert torch.equal(out.logits, model(ids, use_cache=False).logits)


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_symbolic_trace_path_gives_the_same_training() -> None:
    model = Plain()
    x = torch.randn(3, 6)
    traced = capture(model, (x,), method="symbolic_trace")
    assert traced.method == "symbolic_trace"
    assert capture(model, (x,)).method == "export"
    joint = build_joint(traced)
    problem = build_problem(joint)
    plan = fixed_plan(problem, "keep_inputs")
    ex = build_executor(joint, problem, plan)
    fast = RematModule(model, Compiled(traced, ex, problem), signature((x,), {}), planner=None)  # type: ignore[arg-type]
    twin = copy.deepcopy(model)
    out = fast(x)
    out.backward(torch.ones_like(out))
    ref = twin(x)
    ref.backward(torch.ones_like(ref))
    assert torch.equal(out, ref)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent control flow: untraceable
            return y * 2
        return y


def test_untraceable_model_names_the_source_line_and_a_fix() -> None:
    with pytest.raises(CaptureError) as err:
        remat.optimize(Branchy(), torch.randn(2, 4))
    msg = str(err.value)
    assert "Branchy" in msg
    assert "test_capture.py" in msg and "if y.sum() > 0" in msg
    assert "what to try" in msg


def test_no_trainable_parameters() -> None:
    model = Plain().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        remat.optimize(model, torch.randn(3, 6))


def test_non_tensor_example_input() -> None:
    with pytest.raises(ValueError, match="example input 1 is a int"):
        remat.optimize(Plain(), (torch.randn(3, 6), 4))
    with pytest.raises(ValueError, match="tensor or a tuple of tensors"):
        remat.optimize(Plain(), [[1.0, 2.0]][0][0])


class NoTensorOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> str:
        return "nothing"


def test_output_without_tensor() -> None:
    with pytest.raises(ValueError, match="returned no tensor"):
        remat.optimize(NoTensorOut(), torch.randn(1, 2))


def test_meta_device_points_to_fake_mode() -> None:
    with torch.device("meta"):
        model = Plain()
    with pytest.raises(ValueError, match="remat.fake_mode"):
        remat.optimize(model, torch.randn(3, 6, device="meta"))


def test_sparse_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="dense"):
        remat.optimize(Plain(), torch.randn(3, 6).to_sparse())


def test_hf_causal_mask_takes_eager_branch_so_llama_trains_bitwise() -> None:
    """Exporting, transformers materialises the causal mask where eager passes ``is_causal=True``
    to SDPA, and then repeats a GQA model's key/value heads (``repeat_kv``) where eager lets the
    kernel handle them (``enable_gqa``): the key/value gradients are summed in another order
    once the sequence spans several kernel blocks (at sequence 256, 30 of 39 gradients of a
    GQA Qwen2 under a loss wrapper differed from eager's; at 128, 67 of a Llama called directly).
    """
    transformers = pytest.importorskip("transformers")
    import transformers.masking_utils as mu

    from tests.checks import assert_trains_like_eager

    cfg = transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=128, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (2, 128))
    names = ("is_torchdynamo_exporting", "find_packed_sequence_indices", "_ignore_causal_mask_sdpa")
    originals = tuple(getattr(mu, n) for n in names)
    packed = torch.cat([torch.arange(50), torch.arange(78)]).unsqueeze(0)

    def masks(kwargs: dict[str, torch.Tensor], m: nn.Module = model) -> list[bool]:
        gm = capture(m, (ids,), kwargs).graph_module
        assert tuple(getattr(mu, n) for n in names) == originals
        sdpa = torch.ops.aten.scaled_dot_product_attention.default  # (q, k, v, attn_mask, ...)
        return [
            n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None) is not None
            for n in gm.graph.nodes  # type: ignore[union-attr]
            if n.target is sdpa
        ]

    assert masks({}) == [False]
    assert_trains_like_eager(model, (ids,), {}, steps=2, solver="keep_all")
    # A wrapper calling the model without positions: the model counts them itself.
    assert masks({}, Wrapped(model)) == [False]
    assert_trains_like_eager(Wrapped(model), (ids,), {}, steps=2, solver="keep_all")
    # Positions or a mask from the caller: the example's own branch (recorded, and a call
    # taking the other one plans again: tests/executors/graph/test_module.py).
    assert masks({"position_ids": torch.arange(128).unsqueeze(0)}) == [False]
    assert masks({"position_ids": packed}) == [True]
    assert masks({"attention_mask": torch.ones_like(ids)}) == [False]
    assert masks({"attention_mask": torch.ones_like(ids).tril(60)[:2]}) == [True]
    # Positions a wrapper computes itself may be packed: transformers' traced branch stays.
    assert masks({}, PackingWrapper(model)) == [True]


class PackingWrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        half = ids.shape[1] // 2
        positions = torch.cat([torch.arange(half), torch.arange(ids.shape[1] - half)])
        return self.inner(ids, position_ids=positions.unsqueeze(0)).logits


class Wrapped(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(ids).logits


class Quantized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(StraightThrough.apply(self.lin(x)))


@pytest.mark.parametrize("method", ["auto", "symbolic_trace"])
def test_custom_autograd_function_is_refused_naming_class_line_and_fix(method: str) -> None:
    """A traced graph holds a Function's forward ops and nothing of its own backward: the
    joint graph would differentiate ``round`` (zero gradients) without a word."""
    apply = torch.autograd.Function.__dict__["apply"]
    with pytest.raises(CaptureError) as err:
        capture(Quantized(), (torch.randn(4, 8),), method=method)
    assert torch.autograd.Function.__dict__["apply"] is apply  # the watch is removed
    msg = str(err.value)
    assert "Quantized" in msg and "StraightThrough" in msg
    assert "test_capture.py" in msg and "StraightThrough.apply(self.lin(x))" in msg
    assert "remat.apply" in msg


class InputOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(StraightThrough.apply(x))


def test_custom_function_whose_backward_never_runs_is_captured() -> None:
    """Applied to an input that needs no gradient, the Function's backward never runs."""
    assert capture(InputOnly(), (torch.randn(4, 8),)).method == "export"


def test_bloom_gelu_function_is_refused() -> None:
    """BLOOM's MLP applies ``GeLUFunction``, whose backward is a hand-written tanh
    approximation: differentiated as traced, BLOOM's gradients differed from eager's."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BloomConfig(n_layer=2, hidden_size=32, n_head=2, vocab_size=64)
    torch.manual_seed(0)
    with pytest.raises(CaptureError, match=r"GeLUFunction(.|\n)*modeling_bloom\.py:\d+"):
        remat.optimize(transformers.BloomForCausalLM(cfg), torch.randint(0, 64, (2, 8)))
