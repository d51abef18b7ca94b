"""The returned module: same parameters, same state_dict, modes, shapes, and the user's model
left alone."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import remat
from remat.models import TinyGPT
from remat.solver.registry import HEURISTICS, solve
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


def test_a_batch_taking_another_hf_mask_branch_plans_again() -> None:
    """Planned on a batch without padding (no mask: SDPA's ``is_causal`` and GQA kernel), a
    batch with padding takes transformers' masked branch (``repeat_kv``), as eager does."""
    pytest.importorskip("transformers")
    from tests.zoo import llama

    torch.manual_seed(0)
    model = llama(1, 128)
    for m in model.modules():  # no attention dropout: SDPA's flash kernel, as in eval or Qwen2
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.0
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 128))
    ones = torch.ones_like(ids)
    padded = ones.clone()
    padded[1, 90:] = 0
    fast = remat.optimize(model, (ids,), example_kwargs={"attention_mask": ones}, plan="keep_all")
    for mask, plans in ((ones, 1), (padded, 2), (ones, 2)):
        for m in (ref, fast):
            m.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        ref(ids, attention_mask=mask, use_cache=False).logits.sum().backward()
        torch.manual_seed(3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fast(ids, attention_mask=mask).logits.sum().backward()
        assert len(fast.plans) == plans
        assert bool(caught) == (mask is padded)
        grads = dict(ref.named_parameters())
        for name, p in fast.named_parameters():
            assert torch.equal(p.grad, grads[name].grad), name


def test_backward_twice_is_a_clear_error() -> None:
    model = TiedAutoencoder()
    fast = remat.optimize(model, torch.randn(2, 48))
    out = fast(torch.randn(2, 48)).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        out.backward()


def test_recomputation_measures_well_below_keep_all_on_the_gpt_stack() -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=64, heads=4, layers=4, seq=128)
    tokens = torch.randint(0, 64, (2, 128))
    measured, saved = {}, {}
    for name, opts in {
        "keep_all": {"plan": "keep_all"},
        "keep_inputs": {"plan": "keep_inputs"},
        "block": {"solver": "block"},
    }.items():
        result = verify(model, tokens, steps=1, **opts)
        assert result.equal, result.mismatches
        step = result.steps[0]
        assert_peak_close(step.predicted_peak_bytes, step.measured_peak_bytes, name)
        measured[name] = step.measured_peak_bytes
        saved[name] = result.plan.saved_bytes
    # Checkpointing each block (inputs kept, internals recomputed block by block) cuts the peak.
    assert measured["block"] < 0.6 * measured["keep_all"], measured
    # keep_inputs hands almost nothing to the backward, but the recompute-once executor then
    # rebuilds the whole forward at the first backward op and holds it: no lower peak.
    assert saved["keep_inputs"] < 0.1 * saved["keep_all"], saved
    assert measured["keep_inputs"] >= measured["keep_all"], measured


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
    problem = remat.analyze(model, (tokens,)).problem
    plans = [solve(problem, solver=name, budget_bytes=None) for name in HEURISTICS]
    keep_all = next(p for p in plans if p.solver == "keep_all").predicted_peak_bytes
    least = min(p.predicted_peak_bytes for p in plans)
    assert least < keep_all
    roomy = remat.optimize(model, tokens, activation_budget_bytes=keep_all, time_limit_s=3)
    assert roomy.plan.solver == "auto:keep_all" and roomy.plan.recompute_time_s == 0
    tight = remat.optimize(model, tokens, activation_budget_bytes=keep_all - 1, time_limit_s=3)
    assert tight.plan.predicted_peak_bytes <= keep_all - 1
    fitting = [p for p in plans if p.predicted_peak_bytes <= keep_all - 1]
    # The exact MILP (warm-started from the best heuristic) can only do better.
    assert tight.plan.recompute_time_s <= min(p.recompute_time_s for p in fitting)
    with pytest.raises(remat.BudgetError) as err:
        remat.optimize(model, tokens, activation_budget_bytes=err_budget(least), time_limit_s=3)
    assert err.value.achievable and err.value.least_peak_bytes <= least
    assert_trains_like_eager(
        model, (tokens,), {}, steps=2, activation_budget_bytes=keep_all - 1, time_limit_s=3
    )


def err_budget(least_heuristic_peak: int) -> int:
    """A budget below anything: the exact MILP may beat the heuristics' least peak."""
    return least_heuristic_peak // 4


def test_option_errors() -> None:
    model = TiedAutoencoder()
    x = torch.randn(2, 48)
    with pytest.raises(ValueError, match="valid plans: keep_all, keep_inputs, keep_matmuls"):
        remat.optimize(model, x, plan="keep_some")
    with pytest.raises(ValueError, match="not both"):
        remat.optimize(model, x, plan="keep_all", activation_budget_bytes=10**9)
    with pytest.raises(ValueError, match="valid solvers: block, chain, chen_greedy"):
        remat.optimize(model, x, solver="gurobi", activation_budget_bytes=10**9)
    with pytest.raises(ValueError, match="valid: cpu, a100"):
        remat.optimize(model, x, device_profile="tpu")


def test_repr_mentions_the_plan() -> None:
    fast = remat.optimize(nn.Linear(4, 4), torch.randn(2, 4))
    assert "plan=auto" in repr(fast) and "predicted_peak" in repr(fast)


def test_the_executor_makes_no_tensor_on_the_default_device() -> None:
    """Every tensor the step makes takes its device from its inputs. With the default device
    set to ``meta``, a factory without ``device=`` in the forward (the meter's output
    gradients) makes a meta tensor and the step fails; the backward runs without the default
    device's mode, so the missing output gradient's zeros are checked directly."""
    from remat.executors.graph.run import TensorSpec, _as_traced
    from remat.measure.meter import training_step
    from tests.zoo import TwoHeads

    zeros = _as_traced(None, TensorSpec((2, 3), (3, 1), torch.float32), torch.device("meta"))
    assert zeros.device.type == "meta" and zeros.shape == (2, 3)

    torch.manual_seed(0)
    model = TwoHeads()
    x = torch.randn(8, 32)
    fast = remat.optimize(model, (x,), plan="keep_inputs")
    ref = copy.deepcopy(model)
    torch.set_default_device("meta")
    try:
        for m in (ref, fast):
            torch.manual_seed(2)
            training_step(m, (x,))
    finally:
        torch.set_default_device(None)
    grads = dict(ref.named_parameters())
    for name, p in fast.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, grads[name].grad), name
