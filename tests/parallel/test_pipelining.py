"""``remat.apply`` on one stage of a ``torch.distributed.pipelining`` pipeline.

Planned per stage, the peak of a whole ``schedule.step()`` (every microbatch in flight):
traced through PyTorch's own schedule on a fake process group, in one process. Checked
against 2 gloo processes under 1F1B (one stage each, every block recomputed) and
Interleaved1F1B (2 stages each, 4 in all, ``auto`` under a budget): parameters after 3 AdamW
steps (dropout on) bitwise those of the same pipeline without remat; the traced action order
the one the ranks ran; the first step's live-storage peak equal to the prediction, and the
allocator's within max(1%, 64 KiB) and below the budget. And PP x TP, 4 processes on a 2x2
mesh, each stage tensor-parallel over 2 ranks and planned with ``exact`` in the job; and
PP x FSDP2, 4 processes, each stage sharded over 2 data-parallel ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import remat
from remat.executors.sac.state import Applied, applied
from tests.checks import assert_peak_close, gloo_late
from tests.executors.sac.ranks import spawn
from tests.executors.sac.test_distributed import _free_port, assert_trained_alike
from tests.parallel import pp_fsdp_worker, pp_tp_worker, pp_worker
from tests.zoo import PIPELINE_SEQ, GPTStage, pipeline_loss, stage_inputs

WORLD = 2


@pytest.mark.slow
def test_each_stage_bitwise_and_predicted(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    spawn(pp_worker.main, (WORLD, str(tmp_path)), WORLD)
    for rank in range(WORLD):
        results = torch.load(tmp_path / f"pp_{rank}.pt")
        for name, got in results.items():
            what = f"{name} stage {rank}"
            assert_trained_alike(got, rank)
            (tensors, allocator), *later = got["remat"]["peaks"]
            assert tensors == got["predicted_tensors"], (what, tensors, got["predicted_tensors"])
            assert_peak_close(got["predicted"], allocator, f"{what}, allocator")
            assert allocator <= got["budget"] <= got["eager"], (what, allocator, got["budget"])
            assert all(t <= tensors for t, _ in later), (what, later)
            plain_tensors = got["plain"]["peaks"][0][0]
            assert tensors < plain_tensors, (what, tensors, plain_tensors)
            assert got["order"] == got["remat"]["order"] == got["plain"]["order"], what
            if name == "1F1B":
                assert got["in_flight"] == WORLD - rank, (what, got["order"])


@pytest.mark.slow
def test_pipeline_stages_under_tensor_parallelism(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """PP x TP, 4 ranks on a 2x2 ``("pp", "tp")`` mesh: each stage of the zoo's Llama
    parallelized over its row, planned in the job under 90% of its eager peak over a 1F1B
    step. Per rank: bitwise, the planned peak under the budget, and measured as predicted up
    to gloo's late release of an all-reduced activation (``test_tensor_parallel.py``: the
    live meter at one of its two outcomes, the allocator from one below to two above). The
    job's plan, re-applied ahead of it to the stage on FakeTensors parallelized on a fake
    ``(pp, tp)`` mesh, predicts the same live-tensor peak. Each wait lets gloo's thread let
    go first (:func:`tests.executors.sac.gloo_settle.settle_functional_waits`)."""
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    spawn(pp_tp_worker.main, (4, str(tmp_path)), 4)
    buffer = pp_tp_worker.MICROBATCH * PIPELINE_SEQ * 64 * 4  # one all-reduced activation
    for rank in range(4):
        got = torch.load(tmp_path / f"pp_tp_{rank}.pt")
        stage = rank // 2
        assert got["solver"] == "native:exact", got["reason"]
        assert_trained_alike(got, rank)
        assert got["in_flight"] == pp_tp_worker.STAGES - stage
        assert got["predicted"] <= got["budget"] < got["eager"], got
        (tensors, allocator), *later = got["remat"]["peaks"]
        assert gloo_late(got["predicted_tensors"], tensors, buffer), (rank, tensors, got)
        assert gloo_late(got["predicted"], allocator, buffer, more=2), (rank, allocator, got)
        assert all(t <= tensors + buffer for t, _ in later), (rank, later)
        assert tensors < got["plain"]["peaks"][0][0], (rank, got["plain"]["peaks"])
        assert got["ahead"] == got["predicted_tensors"], (rank, got["ahead"])


@pytest.mark.slow
def test_pipeline_stages_under_fsdp2(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """PP x FSDP2, 4 ranks on a 2x2 ``("pp", "dp")`` mesh, 1F1B, every block recomputed:
    each stage traced with FSDP2 inside it on a fake mesh of the same shape (its unsharded
    parameters kept across microbatches, gradients reduced after the last, as
    ``PipelineStage`` drives FSDP2). Per rank: bitwise; the first step's live-meter peak the
    predicted one to the byte, the allocator's within max(1%, 64 KiB), both below eager;
    and the job's plan re-applied ahead of it, on FakeTensors, predicts the same. The
    ranks yield their core after each collective wait (:func:`tests.executors.sac.gloo_settle.
    settle_work_waits`: else gloo's worker thread, 4 ranks on 2 cores, can hold an
    all-gathered block past its release)."""
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    spawn(pp_fsdp_worker.main, (4, str(tmp_path)), 4)
    for rank in range(4):
        got = torch.load(tmp_path / f"pp_fsdp_{rank}.pt")
        stage = rank // 2
        assert_trained_alike(got, rank)
        assert got["in_flight"] == pp_fsdp_worker.STAGES - stage
        (tensors, allocator), *later = got["remat"]["peaks"]
        assert tensors == got["predicted_tensors"] == got["ahead"], (rank, tensors, got)
        assert_peak_close(got["predicted"], allocator, f"PP x FSDP2 rank {rank}, allocator")
        assert all(t <= tensors for t, _ in later), (rank, later)
        assert tensors < got["eager_tensors"] == got["plain"]["peaks"][0][0], (rank, got)
        assert allocator < got["eager"], (rank, got)


def _plan_stage(stage: int, n_stages: int, schedule: str, budget: int | None) -> Applied:
    x, target = stage_inputs(stage)
    pipe = remat.Pipeline(schedule, stage, n_stages, 4, loss_fn=pipeline_loss)
    model = GPTStage(stage, n_stages, layers=1)
    remat.apply(
        model,
        x,
        pipeline=pipe,
        target=target if pipe.last else None,
        activation_budget_bytes=budget,
        time_limit_s=10,
        block_types=("blocks.*",),
    )
    return applied(model)


def test_gpipe_holds_every_microbatch_on_every_stage() -> None:
    for stage in (0, 3):
        state = _plan_stage(stage, 4, "GPipe", None)
        assert state.schedule is not None and state.schedule.max_in_flight == 4
        assert state.schedule.order.split()[:5] == [f"F{m}" for m in range(4)] + ["B0"]


def test_looped_bfs_runs_each_stage_of_a_rank_breadth_first() -> None:
    """A rank of a multi-stage schedule plans its stages as one module list: LoopedBFS
    runs every microbatch's forward on the rank's first stage, then on its second."""
    from torch import nn

    pipe = remat.Pipeline("LoopedBFS", 0, 4, 4, loss_fn=pipeline_loss, stages_per_rank=2)
    chunks = nn.ModuleList(GPTStage(i, 4, layers=1) for i in pipe.indices)
    xs = tuple(stage_inputs(i)[0] for i in pipe.indices)
    with pytest.raises(remat.PipelineError, match="one nn.ModuleList"):
        remat.apply(chunks[0], xs[0], pipeline=pipe)
    remat.apply(chunks, xs, pipeline=pipe, plan="keep_all", block_types=("*.blocks.*",))
    state = applied(chunks)
    assert state.blocks == ("0.blocks.0", "1.blocks.0")
    assert state.schedule is not None
    order = state.schedule.order.split()
    assert order[:8] == [f"{s}F{m}" for s in (0, 2) for m in range(4)], order
    assert state.schedule.max_in_flight == 8


def test_exact_sizes_a_stage_by_the_microbatches_it_holds() -> None:
    """exact solves one microbatch's dataflow; stage 0 of 1F1B holds 2 at its peak, so a
    traced plan over the budget is solved again for half the excess per microbatch (it took
    6 plans over the budget when the whole excess came off one microbatch's target)."""
    x, _ = stage_inputs(0)
    pipe = remat.Pipeline("1F1B", 0, 2, 4, loss_fn=pipeline_loss)
    probe = remat.apply(GPTStage(0, 2), x, pipeline=pipe, plan="keep_all")
    eager = remat.plan_of(probe).predicted_peak_bytes
    model = GPTStage(0, 2)
    over: list[str] = []
    budget = int(0.9 * eager)
    remat.apply(
        model, x, pipeline=pipe, activation_budget_bytes=budget, solver="exact",
        progress=lambda line: over.extend([line] if "over the budget" in line else []),
    )  # fmt: skip
    plan = remat.plan_of(model)
    assert plan.solver == "native:exact" and plan.reason.endswith("traced"), plan.reason
    assert plan.predicted_peak_bytes <= budget
    assert len(over) <= 2, over


def test_split_backward_schedules_are_refused_naming_those_that_run() -> None:
    with pytest.raises(remat.PipelineError, match=r"backwarded once.*GPipe, 1F1B"):
        remat.Pipeline("ZBVZeroBubble", 0, 2, 4)
    with pytest.raises(remat.PipelineError, match="several stages per rank: give stages_per"):
        remat.Pipeline("Interleaved1F1B", 0, 2, 4)
    with pytest.raises(remat.PipelineError, match="5 stages do not split into 2 stages"):
        remat.Pipeline("LoopedBFS", 0, 5, 4, stages_per_rank=2)
    with pytest.raises(remat.PipelineError, match="runs one stage per rank, not 2"):
        remat.Pipeline("1F1B", 0, 4, 4, stages_per_rank=2)
    assert remat.Pipeline("loopedbfs", 1, 6, 4, stages_per_rank=3, loss_fn=len).indices == (
        1,
        3,
        5,
    )
    with pytest.raises(remat.PipelineError, match="unknown pipeline schedule 'zigzag'"):
        remat.Pipeline("zigzag", 0, 2, 4)
    with pytest.raises(remat.PipelineError, match="stage 2 is not one of the 2 stages"):
        remat.Pipeline("1F1B", 2, 2, 4)
    with pytest.raises(remat.PipelineError, match="give the schedule's loss_fn"):
        remat.Pipeline("1F1B", 1, 2, 4)
    assert remat.Pipeline("gpipe", 0, 2, 4).schedule == "GPipe"


def test_a_budget_below_the_stage_least_peak_names_the_stage() -> None:
    x, target = stage_inputs(1)
    pipe = remat.Pipeline("1F1B", 1, 2, 2, loss_fn=pipeline_loss)
    model = GPTStage(1, 2, layers=1)
    with pytest.raises(ValueError, match="pass one microbatch's target"):
        remat.apply(model, x, pipeline=pipe)
    with pytest.raises(remat.BudgetError, match=r"stage 1 of 2, 1F1B, 2 microbatches"):
        remat.apply(
            model,
            x,
            pipeline=pipe,
            target=target,
            activation_budget_bytes=1000,
            block_types=("blocks.*",),
        )
    assert not list(remat.executors.sac.regions.iter_regions(model))  # left as it was


def test_a_fake_world_leaves_the_process_excepthook_alone() -> None:
    """``init_process_group`` wraps ``sys.excepthook`` to prefix ``[rank<r>]:``; each stage
    planned would otherwise stack one more prefix on the user's tracebacks."""
    import sys

    from remat import _torch_compat as tc

    hook = sys.excepthook
    tc.FakeWorld(4, rank=3)
    assert sys.excepthook is hook


def _stages(n: int) -> tuple[list[GPTStage], list[torch.Tensor], torch.Tensor]:
    inputs = [stage_inputs(i) for i in range(n)]
    return [GPTStage(i, n, layers=1) for i in range(n)], [x for x, _ in inputs], inputs[-1][1]


def _plan_all(
    budgets: list[int | None] | None = None, stages: list[GPTStage] | None = None, **kw: object
) -> remat.PipelinePlan:
    made, xs, target = _stages(4)
    return remat.plan_pipeline(
        stages or made,
        xs,
        schedule="1F1B",
        microbatches=4,
        loss_fn=pipeline_loss,
        target=target,
        stage_budgets=budgets,
        time_limit_s=10,
        block_types=("blocks.*",),
        device_profile="a100",  # a roofline: step times estimated, never measured here
        **kw,  # type: ignore[arg-type]
    )


def test_a_pipeline_planned_at_once_beats_every_uniform_plan_that_fits(tmp_path: Path) -> None:
    """4 stages of 1F1B under one budget per stage: the stages holding more microbatches
    recompute more, and the simulated step is no longer than that of any one fixed plan on
    every stage that fits them all (each stage's least recompute is the least step). Planned
    ahead in one process, a stage's plan re-applies from its file (as each rank would)."""
    eager = _plan_all()
    assert [s.in_flight for s in eager.stages] == [4, 3, 2, 1]
    assert all(s.recompute_s == 0 and s.peak_bytes == s.eager_peak_bytes for s in eager.stages)
    budget = eager.stages[2].eager_peak_bytes
    stages = _stages(4)[0]
    ours = _plan_all([budget] * 4, stages)
    recompute = [s.recompute_s for s in ours.stages]
    assert all(s.peak_bytes <= budget == s.budget_bytes for s in ours.stages)
    assert recompute[0] >= recompute[1] > 0 and recompute[2] == recompute[3] == 0, recompute
    assert ours.step_s > ours.eager_timing.step_s == eager.step_s
    uniform = {name: _plan_all(plan=name) for name in ("keep_matmuls", "block")}
    fitting = {
        name: p.step_s
        for name, p in uniform.items()
        if all(s.peak_bytes <= budget for s in p.stages)
    }
    assert "block" in fitting, {n: [s.peak_bytes for s in p.stages] for n, p in uniform.items()}
    assert ours.step_s <= min(fitting.values()), (ours.step_s, fitting)
    text = ours.summary()
    assert "1F1B, 4 stages, 4 microbatches" in text and "bubble share" in text
    remat.save_plan(stages[0], tmp_path / "stage0.json")
    fresh = GPTStage(0, 4, layers=1)
    pipe = remat.Pipeline("1F1B", 0, 4, 4, loss_fn=pipeline_loss)
    path = str(tmp_path / "stage0.json")
    remat.apply(
        fresh,
        stage_inputs(0)[0],
        pipeline=pipe,
        plan=path,
        block_types=("blocks.*",),
        device_profile="a100",
    )
    assert applied(fresh).policies == applied(stages[0]).policies
    assert applied(fresh).plan.predicted_peak_bytes == ours.stages[0].peak_bytes


def test_a_stage_that_cannot_fit_unwraps_those_planned_before_it() -> None:
    stages, xs, target = _stages(2)
    plan = dict(schedule="1F1B", microbatches=2, loss_fn=pipeline_loss, target=target)
    with pytest.raises(remat.BudgetError, match=r"stage 1 of 2, 1F1B, 2 microbatches"):
        remat.plan_pipeline(
            stages, xs, stage_budgets=[None, 1000], block_types=("blocks.*",), **plan
        )  # type: ignore[arg-type]
    for stage in stages:
        assert not list(remat.executors.sac.regions.iter_regions(stage))
    with pytest.raises(ValueError, match="1 stage budgets for 2 stages"):
        remat.plan_pipeline(stages, xs, stage_budgets=[None], **plan)  # type: ignore[arg-type]


def test_a_multi_stage_schedule_is_planned_rank_by_rank(tmp_path: Path) -> None:
    """Interleaved1F1B, 4 stages on 2 ranks: each rank's two stages planned together under
    its budget; the step simulated with each rank running one action at a time, from the
    actions' traced times; a rank's plan re-applies from its file."""
    made, xs, target = _stages(4)
    plan = dict(
        schedule="Interleaved1F1B",
        microbatches=2,
        loss_fn=pipeline_loss,
        target=target,
        stages_per_rank=2,
        block_types=("*blocks.*",),
        device_profile="a100",
        time_limit_s=10,
    )
    eager = remat.plan_pipeline(made, xs, **plan)  # type: ignore[arg-type]
    assert [s.stages for s in eager.stages] == [(0, 2), (1, 3)]
    assert all(isinstance(m, torch.nn.ModuleList) for m in eager.modules)
    assert eager.timing == eager.eager_timing and eager.bubble_share > 0
    busy = [sum(a.time_s for a in applied(m).schedule.actions) for m in eager.modules]  # type: ignore[union-attr]
    assert eager.timing.busy_s == pytest.approx(busy)
    budget = min(s.eager_peak_bytes for s in eager.stages) - 1
    stages = _stages(4)[0]
    ours = remat.plan_pipeline(stages, xs, stage_budgets=[budget] * 2, **plan)  # type: ignore[arg-type]
    assert all(s.peak_bytes <= budget for s in ours.stages)
    assert sum(s.recompute_s for s in ours.stages) > 0
    assert ours.step_s > ours.eager_timing.step_s == eager.step_s
    assert "rank (stages)" in ours.summary() and "0 (0, 2)" in ours.summary()
    remat.save_plan(ours.modules[1], tmp_path / "rank1.json")
    fresh = torch.nn.ModuleList([GPTStage(1, 4, layers=1), GPTStage(3, 4, layers=1)])
    pipe = remat.Pipeline("Interleaved1F1B", 1, 4, 2, loss_fn=pipeline_loss, stages_per_rank=2)
    remat.apply(
        fresh,
        (xs[1], xs[3]),
        pipeline=pipe,
        target=target,
        plan=str(tmp_path / "rank1.json"),
        block_types=("*blocks.*",),
        device_profile="a100",
    )
    assert applied(fresh).policies == applied(ours.modules[1]).policies
    assert applied(fresh).plan.predicted_peak_bytes == ours.stages[1].peak_bytes


def test_a_stage_menu_is_costed_on_one_microbatch_and_its_plan_beats_every_uniform_one() -> None:
    """A stage's menu costs come from one microbatch's step (a whole schedule step costs
    as many microbatches more), so only the two ends of the menu, the DP's choices and the
    plans it may have misjudged are traced through the schedule: on stage 0 of 4 under
    1F1B (4 microbatches held), at a budget between its least and eager peaks, the chosen
    plan recomputes no more than any one option on every block, or any Megatron first-N
    plan, that fits (each traced here through the schedule)."""
    from remat.executors.sac import planner
    from remat.executors.sac.passes import Stage
    from remat.executors.sac.passes import analyze as native_analyze
    from remat.measure.profiles import get_profile
    from remat.request import Request
    from remat.solver.config import SolverConfig

    x, _ = stage_inputs(0)
    pipe = remat.Pipeline("1F1B", 0, 4, 4, loss_fn=pipeline_loss)
    blocks = ("blocks.0", "blocks.1")
    # A roofline: op times estimated, never measured (the cpu profile is calibrated by timing).
    profile = get_profile("a100")
    traced, problem = native_analyze(
        GPTStage(0, 4), blocks, (x,), {}, Request.of(), profile, stage=Stage(pipe)
    )
    calls = {True: 0, False: 0}

    def tracer(policies, schedule=True):  # type: ignore[no-untyped-def]
        calls[schedule] += 1
        trace = traced.trace((x,), {}, policies, schedule)
        assert (trace.schedule is not None) == schedule
        return trace

    every = planner.fixed(problem, "block", tracer).trace.peak_bytes
    budget = (every + problem.baseline.peak_bytes) // 2
    calls.update({True: 0, False: 0})
    chosen = planner.solve(problem, tracer, budget_bytes=budget, config=SolverConfig())
    n_opts = len(planner.menu(problem.streams[0]))
    # Every option but the eager one (the baseline) on one microbatch; through the
    # schedule: every block recomputed, the DP's choices, the MILP's rounds (9 here, where
    # the menu alone took 10 before).
    assert calls[False] == n_opts - 1, calls
    assert chosen.trace.peak_bytes <= budget and chosen.trace.schedule is not None
    whole = planner.fixed_policies(problem, "block")
    others = [*planner.uniform_plans(problem).values(), (whole[0], None)]
    for policies in others:
        trace = traced.trace((x,), {}, policies)
        if trace.peak_bytes <= budget:
            assert chosen.trace.added_time_s <= trace.added_time_s, policies
