"""The returned module: same parameters, same state_dict, modes, shapes, and the user's model
left alone."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat
from remat.models import TinyGPT
from remat.verify import verify
from tests.checks import assert_peak_close, assert_trains_like_eager
from tests.zoo import ConvBN, TiedAutoencoder


def test_state_dict_keys_and_parameter_objects_are_the_models() -> None:
    model = TinyGPT(vocab=64, dim=32, layers=1, seq=16)
    fast = remat.optimize(model, torch.randint(0, 64, (2, 16)))
    assert list(fast.state_dict()) == list(model.state_dict())
    for (n1, p1), (n2, p2) in zip(
        fast.named_parameters(remove_duplicate=False),
        model.named_parameters(remove_duplicate=False),
        strict=True,
    ):
        assert n1 == n2 and p1 is p2
    assert fast.get_parameter("head.weight") is fast.get_parameter("tok.weight")  # still tied
    bn = ConvBN()
    fast_bn = remat.optimize(bn, torch.randn(2, 3, 8, 8))
    assert list(fast_bn.state_dict()) == list(bn.state_dict())
    assert fast_bn.get_buffer("features.1.running_mean") is bn.features[1].running_mean


def test_the_users_model_is_untouched() -> None:
    torch.manual_seed(0)
    model = ConvBN()
    x = torch.randn(2, 3, 8, 8)
    before = copy.deepcopy(model.state_dict())
    flags = [m.training for m in model.modules()]
    model.eval()
    ref = model(x)
    model.train()
    fast = remat.optimize(model, x)
    fast.eval()
    assert [m.training for m in model.modules()] == flags
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert type(model) is ConvBN and not model._forward_hooks and not model._forward_pre_hooks
    model.eval()
    assert torch.equal(model(x), ref)


def test_eval_mode_with_and_without_grad() -> None:
    torch.manual_seed(0)
    model = ConvBN()
    x = torch.randn(4, 3, 8, 8)
    twin = copy.deepcopy(model)
    fast = remat.optimize(model, x, plan="keep_inputs")
    fast.eval()
    twin.eval()
    with pytest.warns(UserWarning, match="planning again for eval mode"):
        out = fast(x)
    ref = twin(x)
    assert torch.equal(out, ref)
    out.sum().backward()
    ref.sum().backward()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    with torch.no_grad():
        assert torch.equal(fast(x), twin(x))
    assert len(fast.plans) == 2


def test_inference_under_no_grad_updates_buffers_like_eager() -> None:
    torch.manual_seed(0)
    model = ConvBN()
    x = torch.randn(4, 3, 8, 8)
    twin = copy.deepcopy(model)
    fast = remat.optimize(model, x)
    with torch.no_grad():
        torch.manual_seed(3)
        out = fast(x)
        torch.manual_seed(3)
        ref = twin(x)
    assert torch.equal(out, ref)
    for b, c in zip(model.buffers(), twin.buffers(), strict=True):
        assert torch.equal(b, c)


def test_new_input_shapes_plan_again() -> None:
    torch.manual_seed(0)
    model = TiedAutoencoder()
    twin = copy.deepcopy(model)
    fast = remat.optimize(model, torch.randn(8, 48))
    x = torch.randn(3, 48)
    with pytest.warns(UserWarning, match="new input shapes"):
        out = fast(x)
    assert torch.equal(out, twin(x))


def test_backward_twice_is_a_clear_error() -> None:
    model = TiedAutoencoder()
    fast = remat.optimize(model, torch.randn(2, 48))
    out = fast(torch.randn(2, 48)).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        out.backward()


def test_keep_inputs_measures_well_below_keep_all_on_the_gpt_stack() -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=64, heads=4, layers=4, seq=128)
    tokens = torch.randint(0, 64, (2, 128))
    peaks = {}
    for plan in ("keep_all", "keep_inputs"):
        result = verify(model, tokens, plan=plan, steps=1)
        assert result.equal, result.mismatches
        step = result.steps[0]
        assert_peak_close(step.predicted_peak_bytes, step.measured_peak_bytes, plan)
        peaks[plan] = step.measured_peak_bytes
    # The saved dropout outputs act as checkpoints on the residual stream: the backward only
    # recomputes one block's internals at a time.
    assert peaks["keep_inputs"] < 0.6 * peaks["keep_all"], peaks


def test_planning_under_fake_mode() -> None:
    with remat.fake_mode():
        model = TinyGPT(vocab=1000, dim=256, heads=8, layers=4, seq=512)
        tokens = torch.randint(0, 1000, (8, 512))
    fast = remat.optimize(model, tokens, plan="keep_matmuls", device_profile="a100")
    assert fast.plan.predicted_peak_bytes > 0 and fast.plan.recomputed
    with pytest.raises(RuntimeError, match="fake tensors"):
        fast(tokens)


def test_budget_picks_the_cheapest_fitting_plan() -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=64, heads=4, layers=2, seq=64)
    tokens = torch.randint(0, 64, (2, 64))
    analysis = remat.analyze(model, (tokens,))
    from remat.pipeline import fixed_plan

    peaks = {
        n: fixed_plan(analysis.problem, n).predicted_peak_bytes for n in ("keep_all", "keep_inputs")
    }
    assert peaks["keep_inputs"] < peaks["keep_all"]
    roomy = remat.optimize(model, tokens, activation_budget_bytes=peaks["keep_all"])
    assert roomy.plan.solver == "fixed:keep_all"
    tight = remat.optimize(model, tokens, activation_budget_bytes=peaks["keep_all"] - 1)
    assert tight.plan.predicted_peak_bytes <= peaks["keep_all"] - 1
    assert tight.plan.solver != "fixed:keep_all"
    least = min(
        fixed_plan(analysis.problem, n).predicted_peak_bytes
        for n in ("keep_all", "keep_inputs", "keep_matmuls")
    )
    with pytest.raises(remat.BudgetError, match=f"{least:,} B"):
        remat.optimize(model, tokens, activation_budget_bytes=least - 1)
    assert_trains_like_eager(
        model, (tokens,), {}, steps=2, activation_budget_bytes=peaks["keep_all"] - 1
    )


def test_option_errors() -> None:
    model = TiedAutoencoder()
    x = torch.randn(2, 48)
    with pytest.raises(ValueError, match="valid plans: keep_all, keep_inputs, keep_matmuls"):
        remat.optimize(model, x, plan="keep_some")
    with pytest.raises(ValueError, match="not both"):
        remat.optimize(model, x, plan="keep_all", activation_budget_bytes=10**9)
    with pytest.raises(ValueError, match="unknown solver"):
        remat.optimize(model, x, solver="gurobi", activation_budget_bytes=10**9)
    with pytest.raises(ValueError, match="valid: cpu, a100"):
        remat.optimize(model, x, device_profile="tpu")


def test_repr_mentions_the_plan() -> None:
    fast = remat.optimize(nn.Linear(4, 4), torch.randn(2, 4))
    assert "plan=keep_all" in repr(fast)
