"""The deep step's larger copy synthesized from the smaller one (:mod:`remat.fit.deep`):
where two shapes give every moment's increment, the synthesized step at a third shape is the
traced one, to the byte; where they do not, there is no increment and the copy is traced."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from remat.executors.sac.hf import kv_cache_off
from remat.executors.sac.passes import Traced, analyze
from remat.executors.sac.planner import fixed_policies
from remat.executors.sac.regions import find_blocks
from remat.fit.deep import EDGES, CopyStep, deep_sample, increments, larger
from remat.fit.graph_shapes import Dims, inputs_at
from remat.measure.profiles import get_profile
from remat.request import Request
from tests.zoo import llama

ANCHORS = ((2, 16), (4, 20))
THIRD = (3, 24)


@pytest.fixture(scope="module")
def steps() -> dict[tuple[int, int, str, int], CopyStep]:
    """Both copies' steps under two plans at the anchors and a third shape (FSDP2's ZeRO-3
    over 8 fake ranks, bf16-mixed, h100 profile: the blocks at the ends differ from the
    middle ones)."""
    req = Request.of(zero_stage=3, world_size=8, precision="bf16-mixed", device_profile="h100")
    profile = get_profile("h100")
    args = (torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1)),)
    dims = Dims.of(args, {})
    out = {}
    for which, n in enumerate(EDGES.copies):
        torch.manual_seed(0)
        model = llama(n, 64).train()
        with kv_cache_off(model):
            traced, problem = analyze(model, find_blocks(model), args, {}, req, profile)
            for name in ("keep_all", "block"):
                policies = fixed_policies(problem, name)
                for b, s in (*ANCHORS, THIRD):
                    x, kw = inputs_at(args, {}, dims, b, s)
                    out[(b, s, name, which)] = _step(traced, x, kw, policies, n)
    return out


def _step(traced: Traced, x: Any, kw: Any, policies: Any, blocks: int) -> CopyStep:
    return CopyStep.of(traced.trace(x, kw, policies), blocks, EDGES)


def _bytes(step: CopyStep) -> dict[object, list[tuple[object, int, int]]]:
    return {
        pos: [(k, e.allocated_bytes, e.tensor_bytes) for k, e in events]
        for pos, events in step.keyed.items()
    }


@pytest.mark.parametrize("name", ["keep_all", "block"])
def test_the_larger_copy_is_the_smaller_plus_the_increments_at_another_shape(
    steps: dict[tuple[int, int, str, int], CopyStep], name: str
) -> None:
    inc = increments([(steps[(b, s, name, 0)], steps[(b, s, name, 1)]) for b, s in ANCHORS])
    assert inc is not None
    assert {d for *_, d in inc.values()} | {d for _, d, *_ in inc.values()} == {0, 1}
    small, real = steps[(*THIRD, name, 0)], steps[(*THIRD, name, 1)]
    synth = larger(small, inc)
    assert synth is not None
    assert _bytes(synth) == _bytes(real)
    assert synth.held == real.held and (synth.unseen, synth.live) == (real.unseen, real.live)
    assert deep_sample(small, synth, 80, EDGES) == deep_sample(small, real, 80, EDGES)


def test_no_increments_where_the_copies_do_not_grow_by_a_block(
    steps: dict[tuple[int, int, str, int], CopyStep],
) -> None:
    pairs = [(steps[(b, s, "block", 0)], steps[(b, s, "block", 1)]) for b, s in ANCHORS]
    assert increments(pairs) is not None
    # The same shape twice: the middle block saves the same bytes at both.
    assert increments([pairs[0], pairs[0]]) is None
    # One moment of the larger copy grows by other than 0 or a block's saved bytes.
    small, big = pairs[1]
    (key, e), *rest = big.keyed[EDGES.head]
    bent = dataclasses.replace(e, allocated_bytes=e.allocated_bytes + 512)
    odd = dataclasses.replace(big, keyed={**big.keyed, EDGES.head: [(key, bent), *rest]})
    assert increments([pairs[0], (small, odd)]) is None
    # A moment between ops above every op's: not carried by the increments.
    assert increments([pairs[0], (dataclasses.replace(small, live=1), big)]) is None
    inc = increments(pairs)
    assert inc is not None
    assert larger(dataclasses.replace(pairs[0][0], unseen=1), inc) is None
