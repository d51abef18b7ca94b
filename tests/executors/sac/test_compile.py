"""A model prepared with ``remat.apply`` compiles with Inductor (CPU).

The compiled backward graph recomputes exactly the matmuls the plan recomputes (AOTAutograd's
partitioner reads the SAC policy's tags), and gradients are bitwise those of the compiled
model without remat (random ops through ATen, ``fallback_random``; deterministic algorithms,
or Inductor's scatter for the tied embedding's gradient sums in another order). The compiled
step's allocator peak is below the compiled model's without remat.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

import remat
from remat import _torch_compat as tc
from remat.measure.meter import allocator_peak_bytes, training_step
from remat.models import TinyGPT

MATMULS = ("aten.addmm.default", "aten.bmm.default")


@pytest.fixture
def deterministic() -> Iterator[None]:
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with tc.inductor_config(fallback_random=True), tc.compile_caches_off():
            yield
    finally:
        torch.use_deterministic_algorithms(before)
        tc.dynamo_reset()


@pytest.mark.slow
def test_compiled_backward_recomputes_the_plan_bitwise(deterministic: None) -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab=128, dim=64, heads=4, layers=2, seq=64)
    tokens = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(1))
    with pytest.raises(remat.BudgetError) as info:  # the least peak: matmuls recomputed
        remat.apply(copy.deepcopy(model), tokens, activation_budget_bytes=1)
    work = remat.apply(
        copy.deepcopy(model), tokens, activation_budget_bytes=info.value.least_peak_bytes
    )
    plan = remat.plan_of(work)
    recomputed = Counter(name.split(":")[1].split("#")[0] for name in plan.recomputed)
    assert all(recomputed[op] > 0 for op in MATMULS), recomputed

    runs = {}
    for name, module in (("plain", copy.deepcopy(model)), ("remat", work)):
        tc.dynamo_reset()
        backward: Counter[str] = Counter()

        def record(
            gm: torch.fx.GraphModule, is_backward: bool, into: Counter[str] = backward
        ) -> None:
            if is_backward:
                into.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")

        compiled = torch.compile(module, backend=tc.inductor_recording(record))
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
        grads = []
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)
            training_step(compiled, (tokens,), seed=step)
            grads.append([p.grad.clone() for p in module.parameters()])
            opt.step()
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(200)
        peak = allocator_peak_bytes(lambda c=compiled: training_step(c, (tokens,)))
        runs[name] = (backward, grads, peak)

    (plain_bw, plain_grads, plain_peak), (remat_bw, remat_grads, remat_peak) = runs.values()
    for op in MATMULS:
        assert remat_bw[op] == plain_bw[op] + recomputed[op], op
    for a, b in zip(plain_grads, remat_grads, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert remat_peak < plain_peak, (remat_peak, plain_peak, plan.predicted_peak_bytes)
