"""``remat.apply``'s executor at every shape: its formula against traces and measured steps
at shapes it was not built from, and ``remat fit --executor sac`` checked one size up."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch

import remat
from remat.budget import Options
from remat.cli import main
from remat.executors import SAC
from remat.executors.sac.apply import NATIVE_SOLVERS
from remat.executors.sac.hf import kv_cache_off
from remat.executors.sac.passes import analyze
from remat.executors.sac.planner import NATIVE_PLANS
from remat.executors.sac.regions import find_blocks
from remat.fit.graph_shapes import Dims, inputs_at
from remat.fit.sac_formula import native_dynamic
from remat.fit.search import FIXED_SAC, FitReport
from remat.fit.table import fit
from remat.measure.meter import measure_step
from remat.measure.profiles import get_profile
from remat.request import Request, model_static_memory
from remat.solver.formula import FitError
from tests.checks import assert_peak_close
from tests.zoo import llama


def _tokens(b: int, s: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(seed))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return llama(2, 64).train()


def test_formula_is_the_trace_and_the_measured_step_at_other_shapes() -> None:
    """Every block recomputed (keep_all and keep_matmuls: the tests below)."""
    plan = "block"
    model = _model()
    before = copy.deepcopy(model.state_dict())
    formula = remat.memory_formula(model, (_tokens(2, 16),), executor="sac", plan=plan)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert model.config.use_cache  # restored after the traces
    assert formula.plan == f"native:{plan}"
    for b, s in ((1, 9), (5, 23), (3, 64)):  # fitted at b in 1..3, s in 12..16
        x = (_tokens(b, s, seed=b * s),)
        applied = remat.plan_of(remat.apply(model, x, plan=plan))
        assert formula.step_peak_bytes(b, s) == applied.predicted_peak_bytes, (b, s)
        assert formula.tensor_peak_bytes(b, s) == applied.predicted_tensor_peak_bytes, (b, s)
        measured = measure_step(model, x)
        model.zero_grad(set_to_none=True)  # the next step allocates its gradients again
        assert measured.peak_bytes == formula.tensor_peak_bytes(b, s), (b, s)
        remat.unapply(model)
    static = model_static_memory(model, Options())
    assert formula.peak_bytes(3, 64) == static.total + formula.step_peak_bytes(3, 64)


def test_formula_at_the_allocator_is_a_measured_run() -> None:
    model = _model()
    formula = remat.memory_formula(model, (_tokens(2, 16),), executor="sac", plan="keep_matmuls")
    x = (_tokens(4, 40),)
    remat.apply(model, x, plan="keep_matmuls")
    assert formula.step_peak_bytes(4, 40) == remat.plan_of(model).predicted_peak_bytes
    measured = measure_step(model, x, allocator=True)
    assert measured.allocator_peak_bytes is not None
    assert_peak_close(formula.step_peak_bytes(4, 40), measured.allocator_peak_bytes, "allocator")


def test_formula_bad_input() -> None:
    model = _model()
    with pytest.raises(ValueError, match="valid: graph, sac"):
        remat.memory_formula(model, (_tokens(2, 16),), executor="fsdp")
    with pytest.raises(ValueError, match="keep_all, keep_matmuls, torchtitan_op, block"):
        remat.memory_formula(model, (_tokens(2, 16),), executor="sac", plan="megatron")


class _Branches(torch.nn.Module):
    """Runs another op above a length: no formula covers both sides."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return h.exp().sum() if ids.shape[1] > 14 else h.sum()


def test_formula_of_a_model_that_branches_on_a_size_says_so() -> None:
    with pytest.raises(FitError, match="branches on a size"):
        remat.memory_formula(_Branches(), (_tokens(2, 16) % 16,), executor="sac")


def _report() -> tuple[Any, tuple[Any, ...], FitReport]:
    torch.manual_seed(0)
    model = llama(2, 64)
    args = (_tokens(2, 16),)
    static = model_static_memory(model, Options()).total
    # Room for no checkpointing up to about length 32 at batch 2.
    report = fit(model, args, budget_bytes=static + 1_500_000, reserve_fraction=0.0,
                 device_profile="h100", executor="sac")  # fmt: skip
    return model, args, report


def _fits(model: Any, args: Any, report: FitReport, name: str, b: int, s: int) -> bool:
    """Trace each of the row's plans at (b, s) as remat.apply would, and apply its rule."""
    x, kw = inputs_at(args, {}, Dims.of(args, {}), b, s)
    profile = get_profile("h100")
    assert report.planner is not None
    policies = report.planner.dynamic.policies  # type: ignore[attr-defined]
    if name in FIXED_SAC:
        policies = {FIXED_SAC[name]: policies[FIXED_SAC[name]]}
    with kv_cache_off(model):
        traced, _ = analyze(model, find_blocks(model), x, kw, Request.of(), profile)
        options = []
        for p in policies.values():
            t = traced.trace(x, kw, p)
            step = sum(e.time_s for e in t.events)  # the cost model's estimate, not a clock
            options.append((t.peak_bytes, 100 * t.recompute_time_s / step))
    cap = 100.0 if not name.startswith("remat <= ") else float(name[9:-1])
    peaks = [p for p, pct in options if pct <= cap + 1e-9]
    return bool(peaks) and min(peaks) <= report.budget.step_budget_bytes


def test_native_fit_answers_fit_and_the_next_size_does_not(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    """One fit (about 25 s) and everything checked on it, in one test so that the xdist
    workers do not each compute it: each row's answer against traces at it and one size up,
    the rows against each other, and the CLI's table and ``compare`` for the sac executor."""
    model, args, report = _report()
    for name in ("no checkpointing", "every block", "remat <= 20%"):
        row = report.plans[name]
        assert row.max_seq is not None and row.max_batch is not None
        assert row.max_seq < 64, "the budget should bind below the model's positions"
        assert _fits(model, args, report, name, report.batch, row.max_seq), name
        assert not _fits(model, args, report, name, report.batch, row.max_seq + 1), name
        if name != "remat <= 20%":  # the batch search: checked on the fixed plans
            assert _fits(model, args, report, name, row.max_batch, 16), name
            assert not _fits(model, args, report, name, row.max_batch + 1, 16), name

    rows = report.plans
    assert rows["every block"].max_seq > rows["no checkpointing"].max_seq  # type: ignore[operator]
    assert rows["least peak"].max_seq >= rows["every block"].max_seq  # type: ignore[operator]
    assert report.formula.plan == "native:keep_all"
    assert set(FIXED_SAC) < set(rows)
    _check_hints(report)
    _check_cli_fit_and_compare(report, monkeypatch, capsys, tmp_path)


def _check_hints(report: FitReport) -> None:
    """Where a row fits nothing under autocast with ZeRO-3, the fit suggests FSDP2's own
    mixed precision; not where everything fits, nor without ZeRO-3, nor for fp32 or the
    graph executor (the report's options and rows replaced: a fit that fits nothing under
    bf16-mixed would take a deep model's traces)."""
    assert report.hints() == [] and report.to_json()["hints"] == []
    nothing = {n: dataclasses.replace(r, max_seq=None) for n, r in report.plans.items()}

    def under(precision: str, zero_stage: int, plans: Any = nothing, plan: str = "") -> FitReport:
        options = Options(precision=precision, zero_stage=zero_stage, world_size=8)
        budget = dataclasses.replace(report.budget, options=options)
        formula = dataclasses.replace(report.formula, plan=plan or report.formula.plan)
        return dataclasses.replace(report, budget=budget, plans=plans, formula=formula)

    (hint,) = under("bf16-mixed", 3).hints()
    assert "--precision bf16-fsdp" in hint and "autocast" in hint
    assert under("bf16-mixed", 3).to_json()["hints"] == [hint]
    assert under("fp16-mixed", 3).hints()
    assert under("bf16-mixed", 3, report.plans).hints() == []  # every row fits
    assert under("bf16-mixed", 2).hints() == []
    assert under("fp32", 3).hints() == []
    assert under("bf16-mixed", 3, plan="keep_all").hints() == []  # the graph executor


def _check_cli_fit_and_compare(
    report: FitReport,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Any,
) -> None:
    """``remat fit`` and ``remat compare`` plan the sac executor (the fit itself is
    ``report``: the table's wiring is what is checked)."""
    import csv

    seen: dict[str, Any] = {}

    def fake_fit(*args: Any, **kwargs: Any) -> FitReport:
        seen.update(kwargs)
        return report

    monkeypatch.setattr("remat.cli.fit.fit", fake_fit)
    factory = "tests.zoo:tiny_llama_factory"
    assert main(["fit", factory, "--budget-gb", "0.02", "--executor", "sac"]) == 0
    assert seen["executor"] is SAC and seen["shallow"] is None
    captured = capsys.readouterr()
    assert "keep matmuls" in captured.out and "native:keep_all" in captured.out
    assert "selective checkpointing" in captured.err

    out = tmp_path / "cmp.csv"
    # The sweep's least budget alone: how a sweep spreads its budgets does not depend on the
    # executor (tests/test_cli.py sweeps two on the graph executor).
    assert main(["compare", factory, "--executor", "sac", "--sweep", "1", "--optimizer", "none",
                 "--time-limit", "2", "--csv", str(out)]) == 0  # fmt: skip
    rows = list(csv.DictReader(out.open()))
    names = {f"plan:{n}" for n in NATIVE_PLANS} | {"auto", *NATIVE_SOLVERS}
    assert {r["solver"] for r in rows} == names
    assert len({r["budget_bytes"] for r in rows}) == 1
    fitting = [r for r in rows if not r["error"]]
    assert any(r["solver"] == "auto" for r in fitting)
    for r in fitting:
        assert int(r["total_bytes"]) <= int(r["budget_bytes"]), r
        # What a sac plan adds is its recomputation and SAC's dispatch, which auto weighs.
        assert float(r["added_pct"]) > float(r["recompute_pct"]), r
    assert any(r["solver"] == "plan:keep_all" and r["error"] for r in rows)  # least budget


def test_a_deep_stack_from_two_shallow_copies_is_its_own_trace() -> None:
    """12 blocks fitted from copies with 4 and 5, checked at shapes none was traced at."""

    def build(n: int) -> torch.nn.Module:
        torch.manual_seed(0)
        return llama(n, 64).train()

    model, args = build(12), (_tokens(2, 16),)
    seen: list[str] = []
    # The CPU profile: kernel scratch and RNG states measured, at the allocator.
    req = Request.of(progress=seen.append, device_profile="cpu")
    plans = ("keep_all", "block")
    # batch=2: the range b >= 2 alone (7 shapes of 11), enough for what is checked here.
    dynamic, _ = native_dynamic(model, args, {}, req, plans=plans, copies=build, batch=2)
    assert any("on the 12-block model" in m for m in seen)  # checked against the model
    assert not any("do not match" in m for m in seen)
    # The 5-block copy traced at two shapes, the other 5 synthesized (remat.fit.deep.larger).
    assert "10 of 14 5-block steps synthesized from the 4-block copy's" in seen
    assert not any("instead" in m for m in seen)  # the narrower edges (deep.EDGES) match
    profile = get_profile("cpu")
    with kv_cache_off(model):
        traced, _ = analyze(model, find_blocks(model), args, {}, req, profile)
        for b, s in ((5, 23), (2, 64)):
            x, kw = inputs_at(args, {}, Dims.of(args, {}), b, s)
            r = dynamic.range_of(b, s)
            assert r is not None
            for name in plans:
                t = traced.trace(x, kw, dynamic.policies[name])
                step = r.steps[name]
                assert step.peak.peak(b, s)[0] == t.peak_bytes, (name, b, s)
                assert step.peak.peak(b, s, tensors=True)[0] == t.tensor_peak_bytes
                total = sum(e.time_s for e in t.events)  # estimated (roofline), not timed
                assert step.recompute_pct(profile, b, s) == pytest.approx(
                    100 * t.recompute_time_s / total, rel=1e-9
                )

    # A builder whose copies are not what was asked for: the model itself is traced.
    def other(n: int) -> torch.nn.Module:
        return build(n + 1)

    seen.clear()
    again, _ = native_dynamic(model, args, {}, req, plans=("block",), copies=other, batch=2)
    assert any("do not match" in m for m in seen)
    step = again.range_of(5, 23).steps["block"]  # type: ignore[union-attr]
    deep = dynamic.range_of(5, 23).steps["block"]  # type: ignore[union-attr]
    assert step.peak.peak(5, 23)[0] == deep.peak.peak(5, 23)[0]


def test_copies_whose_second_block_from_the_end_differs_are_taken_wider() -> None:
    """Where the block before the last differs from the middle ones, the narrower copies
    (remat.fit.deep.EDGES) do not match; the fit takes the wider ones (deep.WIDE) instead
    of tracing the model itself, and its peaks are still the model's own."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    def build(n: int) -> torch.nn.Module:
        torch.manual_seed(0)
        model = llama(n, 64).train()
        wider = copy.copy(model.config)
        wider.intermediate_size *= 2  # saves more for the backward than the others
        model.model.layers[n - 2].mlp = LlamaMLP(wider)
        return model

    model, args = build(12), (_tokens(2, 16),)
    seen: list[str] = []
    req = Request.of(progress=seen.append, device_profile="cpu")
    dynamic, _ = native_dynamic(model, args, {}, req, plans=("block",), copies=build, batch=2)
    assert any("copies with (5, 6) blocks instead" in m for m in seen), seen
    assert not any("do not match" in m for m in seen)
    with kv_cache_off(model):
        traced, _ = analyze(model, find_blocks(model), args, {}, req, get_profile("cpu"))
        b, s = 5, 23
        x, kw = inputs_at(args, {}, Dims.of(args, {}), b, s)
        t = traced.trace(x, kw, dynamic.policies["block"])
    step = dynamic.range_of(b, s).steps["block"]  # type: ignore[union-attr]
    assert step.peak.peak(b, s)[0] == t.peak_bytes
    assert step.peak.peak(b, s, tensors=True)[0] == t.tensor_peak_bytes
