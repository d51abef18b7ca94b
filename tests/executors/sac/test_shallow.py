"""The chain DP's uniform plans of a deep stack costed on two shallow copies
(:mod:`remat.executors.sac.shallow`): the costs and peaks are those of the model's own traces, to
the byte; the chain DP's answer is the one tracing every uniform plan on the model gives;
and a model the copies cannot stand for is traced itself."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from remat.executors.sac import planner, shallow, traced_chain
from remat.executors.sac.hf import kv_cache_off
from remat.executors.sac.passes import _worth_a_region, analyze, uniform_costs
from remat.executors.sac.regions import find_blocks, outside_blocks
from remat.executors.sac.shallow import MIN_REGIONS, truncated
from remat.fit.workers import Mapped
from remat.measure.profiles import get_profile
from remat.models import TinyGPT
from remat.request import Request
from remat.solver.config import SolverConfig
from remat.solver.formula import FitError
from tests.zoo import llama

LAYERS = 7  # deeper than the copies (6 blocks); traced_chain.MIN_REGIONS is patched to it


def _model(layers: int = LAYERS) -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    return llama(layers, 64).train(), (tokens,)


def test_uniform_plans_costed_on_copies_are_the_models_and_so_is_the_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ZeRO-3 over 4 fake ranks (FSDP2 prefetches the next block and reduces the previous
    one's gradients: the blocks at the ends differ from the middle ones): every uniform
    plan's chain costs and peak from the copies equal those of its trace on the model. Then
    the chain DP at a budget between the least and the eager peak returns the same plan
    either way. (7 blocks: the chain DP costs on copies from 12, where they cost less than
    one trace of the model; the arithmetic is the same at any depth.)"""
    monkeypatch.setattr(traced_chain, "MIN_REGIONS", LAYERS)
    torch.manual_seed(0)
    model = TinyGPT(vocab=128, dim=64, heads=4, layers=LAYERS, seq=32).train()
    args = (torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)),)
    req = Request.of(zero_stage=3, world_size=4, device_profile="h100")
    traced, problem, uniform = _analyzed(model, args, req)
    plans = planner.uniform_plans(problem)
    rows = list(uniform(list(plans)))
    seen: dict[tuple[Any, ...], Any] = {}

    def tracer(policies, schedule=True):  # type: ignore[no-untyped-def]
        key = tuple(policies)  # each plan traced once: the two chain DPs share traces
        if key not in seen:
            seen[key] = traced.trace(args, {}, policies)
        return seen[key]

    traces = [tracer(policies) for policies in plans.values()]
    assert rows == [(planner.costs(t), t.peak_bytes) for t in traces]
    assert len({peak for _, peak in rows}) > 2  # the options differ

    budget = (min(t.peak_bytes for t in traces) + problem.baseline.peak_bytes) // 2

    def costed(names: list[str]) -> Mapped:  # the copies' rows checked above, not again
        assert names == list(plans)
        return Mapped(list(rows), iter(()))

    config = SolverConfig()
    whole, copies = (
        traced_chain.chain_solution(problem, tracer, budget, config, c)[0]
        for c in (None, traced_chain.shallow_copies(problem, costed, print))
    )
    assert isinstance(whole, planner.Solution) and isinstance(copies, planner.Solution)
    assert copies.options == whole.options and copies.policies == whole.policies
    assert copies.trace.peak_bytes == whole.trace.peak_bytes <= budget
    assert copies.trace.recompute_time_s == whole.trace.recompute_time_s  # estimated, not timed
    assert "costed on copies with 5 and 6 regions" in copies.reason


def _analyzed(model: nn.Module, args: tuple[torch.Tensor], req: Request) -> tuple[Any, ...]:
    """The step analyzed as ``remat.apply`` does (the KV cache must be off: the caller's
    ``kv_cache_off``), and its uniform plans' costs on the copies."""
    blocks = find_blocks(model)
    profile = get_profile(req.device_profile)
    traced, problem = analyze(model, blocks, args, {}, req, profile, fsdp_units=blocks)
    return traced, problem, uniform_costs(model, blocks, blocks, args, {}, req, profile)


def test_a_peak_between_ops_is_no_copy_s_and_the_model_is_traced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the CPU profile (this CPU model's own allocator: RNG states and FSDP2's resized
    parameters are host memory) the ZeRO-3 step's peak falls between ops, a moment the
    copies do not extrapolate: the eager plan's check sees it and the model is traced."""
    monkeypatch.setattr(traced_chain, "MIN_REGIONS", LAYERS)
    model, args = _model()
    req = Request.of(zero_stage=3, world_size=4, device_profile="cpu")
    seen: list[str] = []
    with kv_cache_off(model):
        _, problem, uniform = _analyzed(model, args, req)
        copies = traced_chain.shallow_copies(problem, uniform, seen.append)
        assert traced_chain._shallow_costs(problem, copies, seen.append) is None
    assert "the copies' eager step is not the model's" in seen[-1], seen


class _Counted(nn.Module):
    """A stack whose forward needs all its blocks: no copy of it runs."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(layers)
        )
        self.count = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.layers) != self.count:
            raise ValueError(f"built with {self.count} layers, has {len(self.layers)}")
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_stack_its_copies_cannot_stand_for_is_traced_itself() -> None:
    model = _Counted(MIN_REGIONS)
    args = (torch.randn(4, 8),)
    req = Request.of(device_profile="cpu")
    profile = get_profile("cpu")
    blocks = find_blocks(model)
    _, problem = analyze(model, blocks, args, {}, req, profile)
    seen: list[str] = []
    uniform = uniform_costs(model, blocks, blocks, args, {}, req, profile)
    assert traced_chain.shallow_copies(problem, uniform, seen.append) is None
    assert "the copies do not stand for the model" in seen[-1]
    assert f"built with {MIN_REGIONS} layers, has 5" in seen[-1]


def test_a_copy_shares_the_model_s_modules_and_leaves_it_whole() -> None:
    model, _ = _model()
    blocks = find_blocks(model)
    copy, kept = truncated(model, blocks, 3)
    assert kept == blocks[:3]
    assert len(copy.model.layers) == 3 and len(model.model.layers) == LAYERS  # type: ignore[union-attr,arg-type]
    assert copy.model.layers[1] is model.model.layers[1]  # type: ignore[union-attr,index]
    assert copy.lm_head is model.lm_head
    # Regions that are not the stack's children (its blocks' sub-modules): no copies.
    subs = tuple(f"{b}.{m}" for b in blocks for m in ("self_attn", "mlp"))
    assert shallow.uniform_costs(model, subs, blocks, _never) is None


def test_blocks_outside_any_module_list_get_no_copies() -> None:
    """Blocks in an ``nn.Sequential`` beside an unrelated ModuleList: no stack to cut."""
    model = nn.Sequential(nn.Sequential(*(nn.Linear(4, 4) for _ in range(MIN_REGIONS))))
    model.add_module("heads", nn.ModuleList([nn.Linear(4, 4)]))
    blocks = tuple(f"0.{k}" for k in range(MIN_REGIONS))
    assert shallow.uniform_costs(model, blocks, blocks, _never) is None
    with pytest.raises(FitError, match="no ModuleList holds the regions"):
        truncated(model, blocks, 5)


def _never(*args: Any) -> Any:
    raise AssertionError("no copy is analyzed")


def test_what_the_modules_outside_a_deep_stack_hold_is_measured_on_a_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Which modules outside the blocks are worth a region (what they hold from forward to
    backward, recomputed against eager) does not depend on the depth: a copy with 5 blocks
    decides as the 12-block model does, and leaves the model's analysis to the caller."""
    model, args = _model(MIN_REGIONS)
    req = Request.of(device_profile="h100")
    profile = get_profile("h100")
    blocks = find_blocks(model)
    outside = outside_blocks(model, blocks)
    analyzed: list[tuple[str, ...]] = []

    def on(regions: tuple[str, ...], of: nn.Module = model, units: Any = blocks) -> Any:
        traced, problem = analyze(of, regions, args, {}, req, profile, fsdp_units=units)
        analyzed.append(regions)
        return problem, lambda policies, schedule=True: traced.trace(args, {}, policies), None

    with kv_cache_off(model):
        on_copy = _worth_a_region(on, model, blocks, outside, lambda _: None)
        assert analyzed == [blocks[:5] + outside]  # the copy alone
        monkeypatch.setattr(shallow, "MIN_REGIONS", 10**9)
        on_model = _worth_a_region(on, model, blocks, outside, lambda _: None)
        assert analyzed[1:] == [blocks + outside]  # the model
    assert on_copy[0] == on_model[0] != outside  # the embedding gains nothing
    assert on_copy[1] is None and on_model[1] is None
