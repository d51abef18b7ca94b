"""Choosing a SAC policy per block under a byte budget, every candidate measured exactly.

1. **Streams.** One traced step with every block eager gives each block's forward op stream
   as its policy will see it (:mod:`remat.executors.sac.trace`); blocks with the same stream form a
   class and share their menu, by ``(op, k)`` key.
2. **Menus.** Per class, policies from keeping everything (the block runs eagerly: no
   checkpoint) to keeping nothing (the whole block recomputed, as Hugging Face's
   ``gradient_checkpointing_enable()``): in between, SAC policies that keep the ops with the
   most recompute time per byte first, cut where they cover a share of the block's recompute
   time, plus the outputs of the ops with FLOPs alone (matmuls, convolutions, attention).
3. **Costs in context.** Each option is applied to every block and the step traced; per block:
   the bytes it holds from its forward to its backward, its forward and backward peaks above
   what the earlier blocks hold, and its recompute time. These are
   :class:`remat.solver.chain.ChainCosts`, and the chain solver's DP
   (:func:`remat.solver.chain.chain_dp`) picks one option per block under the budget. On a
   pipeline stage these per-block quantities are one microbatch's, so each option is traced
   as one microbatch's step, without the schedule step (:func:`in_flight` counts the
   microbatches held, calibrated on every block eager and every block recomputed traced
   through the schedule); the plans a user would try by hand that this model may misjudge
   are traced too (:func:`_misjudged`).
4. **The trace has the last word.** The stitched choice is traced; when its peak is over the
   budget (the additive model is an approximation where blocks meet), the DP runs again for a
   budget smaller by the excess. The DP also runs for the budgets of a fixed grid between the
   least and the keep-all peaks below the budget, and the cheapest traced plan that fits
   wins: a larger budget sees every grid plan a smaller one saw (only the plan solved for the
   smaller budget itself may be missing), which keeps the cost non-increasing in practice
   (the tests check it on the zoo), not by proof.
5. **The solvers, for this executor.** The baseline step's dataflow is a
   :class:`remat.Problem` for the ``sac`` executor (:mod:`remat.executors.sac.dataflow`,
   :mod:`remat.solver.executor`), finer than the menus: any op of any block may be kept, and
   any block left without checkpoint. The MILP over its fixed lifetimes
   (:mod:`remat.solver.spans`) plans on it; its plan is traced too, and re-solved for less
   while the trace is over. ``auto`` returns the cheaper of the two traced plans; with
   ``milp_first`` (``remat.apply``) the MILP runs first and the chain DP is its fallback,
   or a second opinion where its traces are cheap (:func:`solve`). ``solver=`` picks one of
   remat's solvers alone (:func:`planned`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from remat import _torch_compat as tc
from remat.executors.sac.dataflow import problem_of
from remat.executors.sac.regions import FullReplay, OpKey, Policy
from remat.executors.sac.shallow import MIN_REGIONS, SHALLOW, UniformCosts
from remat.executors.sac.trace import FakeModel, OpEvent, StepTrace
from remat.fit.workers import Mapped, mapped
from remat.measure.profiles import DeviceProfile
from remat.parallel.pipelining import ScheduleTrace
from remat.problem import DispatchCosts, Problem
from remat.solver import clock, registry
from remat.solver.chain_dp import ChainCosts, ChainCostsBuilder, chain_dp, chain_peak, chain_time
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.executor import executor_of
from remat.solver.plan import Plan, Proof, fmt_bytes
from remat.solver.schedule import Schedule
from remat.solver.simulate import SecondCopyError, Simulation, TimelineStep

COVERAGE = (0.99, 0.95, 0.9, 0.8, 0.65, 0.5, 0.35, 0.2)
"""Shares of a block's recompute time the intermediate menu options keep. On an 8-layer Llama
(hidden 512, seq 512) at three budgets, these eight levels cut the estimated recompute time
by 16-28% against four (0.99, 0.95, 0.8, 0.5) in about the same planning time (11-14 s), and
by more than thirteen levels did (the chain DP's grid lands elsewhere with other menus)."""
GRID_POINTS = 6
"""Budgets between the least and the keep-all peaks the DP is also solved at..."""
GRID_EVENTS = 100_000
"""...where their traces are short: the grid's budgets times the events of one step at most
this (here about 30 s of traces). Beyond, the DP is solved at the budget alone (and the
per-block family traced, :func:`_per_block_contenders`): a count, so that the plan does not
depend on how fast the machine traces."""
DP_ROUNDS = 12
"""DP solves per budget, each for a smaller budget, until the traced plan fits."""
MISS_MARGIN = 1 / 64
"""Share of the dataflow simulation's miss (traced peak less simulated) that a solver's
plan is solved again for below the excess: the next plan misses by about as much, but not
exactly (Llama-70B at 80 GB: 127.0 MiB, then 128.0 MiB, which took a third round; each
round is a trace, 8 s there)."""
SECOND_OPINION_EVENTS = 16_000
"""Events the chain DP may trace on the model (options x events of one step) after the
MILP found a plan (with ``milp_first``): a count, not seconds, so that whether it runs
depends on the model and never on the machine's load (here about 5 s of traces, the
torchtitan debug model's 10 options of 1,081 events taking 3.7 s). Where shallow copies
cost the options, it always runs: its traces on the model are then a few."""

NATIVE_PLANS = ("keep_all", "keep_matmuls", "torchtitan_op", "block")
"""Fixed native plans: every block eager; every block keeping the outputs of its ops with
FLOPs (matmuls, convolutions, attention); torchtitan's op-SAC policy
(:func:`torchtitan_op_keys`); every block recomputed whole."""

FITTED_PLANS = ("keep_all", "keep_matmuls", "block")
"""The fixed plans ``remat fit`` and :func:`remat.memory_formula` fit over shapes on the
``sac`` executor (each costs a trace per shape)."""

TORCHTITAN_SAVE_OPS = (
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_attention_math.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "aten.max.default",
    "aten.linear.default",
    "aten.topk.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_to_all_single.default",
)
"""What torchtitan 0.3.0's op-SAC policy saves besides PyTorch's compute-intensive ops
(``torchtitan/distributed/activation_checkpoint.py``, ``_get_default_save_ops``; its flex
attention, compiled-code and expert-parallel entries are not ATen ops a CPU step runs)."""

TABLE_FORK_WORK_S = 1.0
"""The DP's table is traced on forked workers where its traces would take this long or more
here (a fork of the analysed process costs a tenth of that: the zoo's 3-block Llama, ten
traces of a third of a second each, 3.2 s on one core, 1.8 s on two)."""

TORCHTITAN_MM_OPS = ("aten.mm.default", "aten.linear.default")
"""The ops of which torchtitan's policy recomputes every second call in a region."""


@dataclass(frozen=True)
class NativeProblem:
    """A model's blocks, their classes and the op streams their policies see."""

    blocks: tuple[str, ...]
    classes: tuple[tuple[int, ...], ...]
    """Indices of blocks with identical forward streams."""
    streams: Mapping[int, tuple[OpEvent, ...]]
    """Per class (by its first block), that block's keyed forward ops."""
    baseline: StepTrace
    """The step with every block eager."""
    device_profile: str = "cpu"
    dispatch: DispatchCosts = DispatchCosts()
    """The profile's cost of SAC's own dispatch (what the solvers' view counts)."""

    @functools.cached_property
    def dataflow(self) -> Problem:
        """The baseline step as a problem for the ``sac`` executor (the solvers' view)."""
        return problem_of(self.baseline, self.device_profile, self.dispatch)

    def class_of(self, block: int) -> int:
        return next(c[0] for c in self.classes if block in c)


@dataclass(frozen=True)
class Option:
    name: str
    policy: Policy


def analyze(
    fake: FakeModel,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    profile: DeviceProfile,
    autocast: torch.dtype | None,
) -> NativeProblem:
    """The step with every region eager, its regions put in the order their forwards run
    (:meth:`FakeModel.in_call_order`: a chain's order, which the per-region costs read)."""
    baseline = fake.trace(
        args, kwargs, [None] * len(fake.blocks), profile=profile, autocast=autocast
    )
    order = fake.in_call_order(baseline)
    if order != tuple(range(len(order))):
        baseline = baseline.renumbered(order)
    groups: dict[tuple[object, ...], list[int]] = {}
    streams: dict[int, tuple[OpEvent, ...]] = {}
    for k in range(len(fake.blocks)):
        stream = baseline.forward_stream(k)
        sig = tuple((e.key, e.new_bytes, e.savable) for e in stream)
        groups.setdefault(sig, []).append(k)
        streams.setdefault(groups[sig][0], stream)
    return NativeProblem(
        fake.blocks,
        tuple(tuple(g) for g in groups.values()),
        streams,
        baseline,
        profile.name,
        profile.sac_dispatch,
    )


def menu(stream: Sequence[OpEvent]) -> list[Option]:
    """Options of one class, from keeping everything to keeping nothing (see the docstring)."""
    forced = required_keys(stream)
    savable = [e for e in stream if e.savable and e.key is not None and e.key not in forced]
    total = sum(e.time_s for e in savable)
    ranked = sorted(savable, key=lambda e: (-e.time_s / max(e.new_bytes, 1), e.new_bytes))
    options = [Option("eager", None)]
    seen: set[frozenset[OpKey]] = set()

    def add(name: str, keys: frozenset[OpKey]) -> None:
        keys |= forced
        if keys not in seen:
            seen.add(keys)
            options.append(Option(name, keys))

    add("keep all savable", frozenset(e.key for e in savable if e.key is not None))
    for share in COVERAGE:
        kept: list[OpKey] = []
        covered = 0.0
        for e in ranked:
            if covered >= share * total:
                break
            assert e.key is not None
            kept.append(e.key)
            covered += e.time_s
        add(f"keep {share:.1%} of recompute time", frozenset(kept))
    add("keep matmuls", matmul_keys(stream))
    add("recompute all", frozenset())
    return options


def matmul_keys(stream: Sequence[OpEvent]) -> frozenset[OpKey]:
    """Savable ops with FLOPs in PyTorch's registry (matmuls, convolutions, attention), and
    the ops every policy keeps."""
    keys = frozenset(e.key for e in stream if e.savable and e.flops > 0 and e.key is not None)
    return keys | required_keys(stream)


def torchtitan_op_keys(stream: Sequence[OpEvent]) -> frozenset[OpKey]:
    """torchtitan 0.3.0's op-SAC policy on one region: the outputs of PyTorch's
    compute-intensive ops and of :data:`TORCHTITAN_SAVE_OPS` are kept, except every second
    ``mm``/``linear`` call of the region's forward (its count runs over both), and the ops
    every policy keeps. Its policy also recomputes the MoE router's matmuls
    (``force_recompute_mm_shapes_by_fqns``), which a dense model does not have. The fixed
    plan runs it without early stop, as torchtitan does (:class:`FullReplay`)."""
    save = tc.compute_intensive_ops() | frozenset(TORCHTITAN_SAVE_OPS)
    keys = set(required_keys(stream))
    mm_calls = 0
    for e in stream:
        if e.key is None:
            continue
        if e.op in TORCHTITAN_MM_OPS:
            mm_calls += 1
            if mm_calls % 2 == 0:
                continue
        if e.op in save and e.savable:
            keys.add(e.key)
    return frozenset(keys)


def required_keys(stream: Sequence[OpEvent]) -> frozenset[OpKey]:
    """Ops every policy keeps: in-place writes to state the block does not own (BatchNorm's
    running statistics), which a recomputation would apply twice."""
    return frozenset(e.key for e in stream if e.writes_outside and e.key is not None)


def costs(trace: StepTrace) -> ChainCosts:
    """Per-block quantities of a traced step (see :class:`remat.solver.chain.ChainCosts`)."""
    built = ChainCostsBuilder([end - start for start, end in trace.forward_live])
    seen_block = False
    for e in trace.events:
        seen_block = seen_block or (e.phase == "forward" and e.block >= 0)
        built.add(e.phase, e.block, e.allocated_bytes, before_regions=not seen_block)
        if e.recompute:
            built.recompute(e.block, e.time_s)
    for block, dispatch in enumerate(trace.dispatch_s):
        built.recompute(block, dispatch)  # what a policy adds is the block's too
    return built.costs()


def in_flight_at_peak(schedule: ScheduleTrace) -> int:
    """Microbatches whose saved activations a pipeline stage holds at its peak action (the
    running one included)."""
    top = max(schedule.actions, key=lambda a: a.peak_bytes)
    return top.in_flight + (top.kind == "F")


def in_flight(
    table: Sequence[ChainCosts], traced_peaks: Mapping[int, int], eager: ScheduleTrace
) -> list[ChainCosts]:
    """One microbatch's per-block costs of each uniform option (``table``) for a pipeline
    stage, which holds several microbatches at its peak (``eager``'s, the stage with every
    region eager): each block's kept bytes count once per microbatch held, and every base
    moves by what the schedule adds besides (receive buffers, gradients, outputs kept). That
    addition is the same for every plan: the least over the options traced through the
    schedule (``traced_peaks``: option -> peak) of their traced peak less the model's. The
    model stays approximate (the DP's choices are traced, and the traces decide); taking the
    least keeps it from refusing plans that fit."""
    copies = in_flight_at_peak(eager)

    def modelled(c: ChainCosts) -> int:
        prefix = [0]
        for k in c.keep:
            prefix.append(prefix[-1] + k * copies)
        return max(
            [prefix[-1] + c.tail_base, c.head]
            + [prefix[k] + max(c.fw_base[k], c.bw_base[k]) for k in range(len(c.keep))]
        )

    shift = min(t - modelled(table[o]) for o, t in traced_peaks.items())
    return [
        ChainCosts(
            keep=[k * copies for k in c.keep],
            fw_base=[b + shift for b in c.fw_base],
            bw_base=[b + shift for b in c.bw_base],
            tail_base=c.tail_base + shift,
            head=c.head,
            time_s=c.time_s,
        )
        for c in table
    ]


@dataclass(frozen=True)
class Solution:
    policies: tuple[Policy, ...]
    trace: StepTrace
    solver: str
    reason: str
    proof: Proof
    """What is proven about the plan (:class:`remat.solver.plan.Proof`)."""
    options: tuple[str, ...] = ()
    """Per block, the name of the menu option chosen (for reports)."""


class Tracer(Protocol):
    """The step traced under one policy per block
    (:meth:`remat.executors.sac.trace.FakeModel.trace`);
    ``schedule=False`` skips a pipeline stage's schedule step (one microbatch's step only)."""

    def __call__(self, policies: Sequence[Policy], schedule: bool = True) -> StepTrace: ...


def fixed_policies(problem: NativeProblem, name: str) -> tuple[Policy, ...]:
    """Every block's policy under one of :data:`NATIVE_PLANS`."""
    if name not in NATIVE_PLANS:
        raise ValueError(f"unknown native plan {name!r}; valid: {', '.join(NATIVE_PLANS)}")
    policies: list[Policy] = []
    for k in range(len(problem.blocks)):
        stream = problem.streams[problem.class_of(k)]
        if name == "keep_all":
            policies.append(None)
        elif name == "block":
            policies.append(required_keys(stream))
        elif name == "torchtitan_op":  # replayed whole, as torchtitan's wrapper runs it
            policies.append(FullReplay(torchtitan_op_keys(stream)))
        else:
            policies.append(matmul_keys(stream))
    return tuple(policies)


FIXED_REASONS = {
    "keep_all": "every block runs eagerly (no checkpoint)",
    "keep_matmuls": "every block keeps the outputs of its ops with FLOPs (matmuls, "
    "convolutions, attention)",
    "torchtitan_op": "torchtitan's op-SAC policy: every block keeps its compute-intensive ops' "
    "outputs but every second matmul",
    "block": "every block recomputed whole (gradient_checkpointing_enable())",
}


def fixed(problem: NativeProblem, name: str, tracer: Tracer) -> Solution:
    """One of :data:`NATIVE_PLANS`."""
    policies = fixed_policies(problem, name)
    names = (name,) * len(policies)
    return Solution(policies, tracer(policies), name, FIXED_REASONS[name], Proof.HEURISTIC, names)


def menus_of(problem: NativeProblem) -> tuple[list[list[Option]], int, int]:
    """Each block's menu (its class's), the number of classes, and the longest menu's
    length."""
    menus = {c[0]: menu(problem.streams[c[0]]) for c in problem.classes}
    options_of = [menus[problem.class_of(k)] for k in range(len(problem.blocks))]
    return options_of, len(menus), max(len(m) for m in menus.values())


def uniform_plans(problem: NativeProblem) -> dict[str, tuple[Policy, ...]]:
    """The chain DP's menu applied alike to every block: option ``k`` of each class's menu
    (its last where a class has fewer), from every block eager to every block recomputed."""
    options_of, _, n_opts = menus_of(problem)
    out: dict[str, tuple[Policy, ...]] = {}
    for o in range(n_opts):
        picked = [opts[min(o, len(opts) - 1)] for opts in options_of]
        names = dict.fromkeys(p.name for p in picked)
        out[f"menu {o}: {' / '.join(names)}"] = tuple(p.policy for p in picked)
    return out


@clock.counted
def solve(
    problem: NativeProblem,
    tracer: Tracer,
    *,
    budget_bytes: int | None,
    config: SolverConfig,
    solver: str = "auto",
    uniform: UniformCosts | None = None,
    milp_first: bool = False,
    second_opinions: bool = True,
) -> Solution:
    """The cheapest traced plan whose peak fits ``budget_bytes`` (module docstring).
    ``solver``: ``auto``, or one of remat's solvers, which plan on the step's dataflow for
    the ``sac`` executor (:func:`planned`). ``uniform``: the chain DP's uniform plans costed
    on shallow copies of a deep stack (:mod:`remat.executors.sac.shallow`), where it has one.

    ``milp_first``: the exact MILP first; the chain DP is then its fallback, and a second
    opinion where cheap: where shallow copies cost its options, or where its traces on the
    model are few and short (:data:`SECOND_OPINION_EVENTS`). Why: on a 7B Llama at 40 GB the
    chain DP's traces took 13 s (blocks) and 27 s (sub-modules) to find 7.79 and 6.95 ms of
    recompute, against the MILPs' 5.35 and 1.68 ms found in 6 s each; at 70B the MILP's
    fixed lifetimes gave a plan recomputing every layer (17% of the step) where the chain
    DP's fit the budget's room (:func:`_per_block_contenders`). Which solvers run depends on
    the model, never on the clock.

    ``second_opinions``: False where a plan that the chain DP or the per-block family
    already checked stands (the blocks' plan, when ``auto`` plans again on their
    sub-modules): the MILP's plan is then returned alone, the chain DP only its fallback.
    Why: on the zoo (six models, three budgets each) the finer pass's second opinions never
    gave a cheaper plan, and they took a sixth to a third of ``auto``'s time (a 7B Llama's
    per-block family on its sub-modules: 6 of 36 s; hf_llama_gqa's chain DP: 2.6 of 7 s)."""
    if solver != "auto":
        return planned(problem, tracer, solver, budget_bytes=budget_bytes, config=config)
    # Every decision below is the model's and the budget's; the time limit counts work, not
    # seconds (the same request gives the same plan on every rank, under any load).
    if budget_bytes is None:
        return fixed(problem, "keep_all", tracer)
    if problem.baseline.peak_bytes <= budget_bytes:  # nothing to recompute: nothing is cheaper
        n = len(problem.blocks)
        reason = "every block runs eagerly (no checkpoint): the step fits the budget as it is"
        return Solution(
            (None,) * n, problem.baseline, "auto", reason, Proof.OPTIMAL, ("eager",) * n
        )
    t0 = time.perf_counter()
    chain: Solution | BudgetError | None = None
    traced, other = 0, "the chain DP"
    progress = config.progress or (lambda _: None)
    # Started first: on forked workers where they pay, the copies trace while the MILP solves.
    copies = _copies(problem, uniform, progress) if problem.baseline.schedule is None else None
    try:
        if not milp_first:
            chain, traced = _chain(problem, tracer, budget_bytes, config, copies)
        milp = _milp(problem, tracer, budget_bytes, config)
        if milp_first:
            n_opts = menus_of(problem)[2]
            work = n_opts * len(problem.baseline.events)
            if milp is not None and not second_opinions:
                why = "no second opinion: the blocks' plan, which had them, stands against it"
                progress(f"native: {why}")
                return dataclasses.replace(milp, solver="auto", reason=f"{milp.reason}; {why}")
            if milp is None or copies is not None or work <= SECOND_OPINION_EVENTS:
                chain, traced = _chain(problem, tracer, budget_bytes, config, copies, milp)
            else:
                progress(
                    f"native: the chain DP's {n_opts} traces of "
                    f"{len(problem.baseline.events):,} events each (more than "
                    f"{SECOND_OPINION_EVENTS:,} in all): not run; the per-block family "
                    "instead, by bisection"
                )
                chain, traced = _per_block(problem, tracer, budget_bytes, milp)
                other = "the per-block family"
    finally:
        if copies is not None:  # read, or not needed: its workers stop
            copies.close()
    return _cheaper(chain, milp, traced, f"{time.perf_counter() - t0:.1f} s", other)


def _milp(
    problem: NativeProblem, tracer: Tracer, budget_bytes: int, config: SolverConfig
) -> Solution | None:
    """The exact MILP's traced plan (its time limit the request's, whatever ran before), or
    None (none fits, or a dataflow beyond its model)."""
    progress = config.progress or (lambda _: None)
    progress("native: the exact MILP on the step's dataflow (sac executor)")
    try:
        return planned(problem, tracer, "exact", budget_bytes=budget_bytes, config=config)
    except BudgetError:
        return None
    except SecondCopyError as e:
        progress(f"native: the step's dataflow is beyond the MILP's model ({e}): chain DP only")
        return None


def _cheaper(
    chain: Solution | BudgetError | None,
    milp: Solution | None,
    traced: int,
    took: str,
    other: str = "the chain DP",
) -> Solution:
    """The cheaper of ``other``'s (the chain DP's, or the per-block family's) and the MILP's
    traced plans (``other``'s on a tie), its reason saying what the other gave."""
    if not isinstance(chain, Solution):
        if milp is None:
            assert chain is not None, "the chain DP runs wherever the MILP found no plan"
            raise chain from None  # one least peak per error, not a chain of them
        none = (
            f"no plan of {other} fits"
            if isinstance(chain, BudgetError)
            else f"{other}: no plan that fits and adds less time ({traced} traced)"
        )
        return dataclasses.replace(milp, solver="auto", reason=f"{milp.reason}; {none}; {took}")
    if milp is None or _cost(milp) >= _cost(chain):
        also = (
            f"; the exact MILP's plan was not cheaper ({_ms(milp)} against {_ms(chain)} of "
            "recompute)"
            if milp is not None
            else ""
        )
        return dataclasses.replace(chain, reason=f"{chain.reason}{also}; {took}")
    why = f"{_ms(milp)} of recompute against {other}'s best, {_ms(chain)} ({traced} traced)"
    return dataclasses.replace(milp, solver="auto", reason=f"{milp.reason}; {why}; {took}")


def _cost(solution: Solution | StepTrace | None) -> tuple[float, float]:
    """What ``auto`` minimises: added time (recompute and SAC's dispatch), then peak (None:
    no plan, infinite)."""
    if solution is None:
        return math.inf, math.inf
    trace = solution.trace if isinstance(solution, Solution) else solution
    return trace.added_time_s, trace.peak_bytes


def _ms(solution: Solution) -> str:
    return f"{solution.trace.added_time_s * 1e3:.3f} ms"


def _chain(
    problem: NativeProblem,
    tracer: Tracer,
    budget_bytes: int,
    config: SolverConfig,
    copies: Mapped | None = None,
    beat: Solution | None = None,
) -> tuple[Solution | BudgetError | None, int]:
    """The chain DP's cheapest traced plan that fits (or the error saying none does), and
    how many plans it traced. Its time limit counts the events it traces: where it cuts the
    DP's budgets short, the reason says so. ``copies``: the uniform plans' costs on
    shallow copies (:func:`_copies`), where it has them. ``beat``: a traced plan that fits
    (the MILP's); only plans that add less time are traced (a plan's added time is its
    blocks', known before its trace), and None is returned where none does."""
    t0 = time.perf_counter()
    deadline = clock.now() + config.time_limit_s
    n = len(problem.blocks)
    options_of, n_classes, n_opts = menus_of(problem)
    progress = config.progress or (lambda _: None)
    # Option 0 is every class's "eager": the baseline is that plan, traced already.
    found: dict[tuple[int, ...], StepTrace] = {(0,) * n: problem.baseline}

    def record(key: tuple[int, ...], trace: StepTrace) -> None:
        found[key] = trace
        clock.charge(clock.TRACED_EVENT_S * len(trace.events))
        progress(f"native: {len(found) - 1} plans traced, {time.perf_counter() - t0:.0f} s")

    def run(choice: Sequence[int]) -> StepTrace:
        key = _choice_key(options_of, choice)
        if key not in found:
            record(key, tracer(_policies(options_of, key)))
        return found[key]

    schedule = problem.baseline.schedule
    shallow: list[tuple[ChainCosts, int]] | None = None
    if schedule is None:
        shallow = _shallow_costs(problem, copies, progress)
    if shallow is not None:
        table = [c for c, _ in shallow]
        least = min(peak for _, peak in shallow)
    elif schedule is None:
        progress(f"native: {n} regions, {n_classes} class(es), {n_opts} options; tracing each")
        _trace_uniform(tracer, options_of, n_opts, found, record)
        traces = [run([o] * n) for o in range(n_opts)]
        table = [costs(t) for t in traces]
        least = min(t.peak_bytes for t in traces)
    else:
        progress(
            f"native: {n} regions, {n_classes} class(es), {n_opts} options; one microbatch's "
            "step each"
        )
        table = _stage_table(problem, tracer, run, options_of, n_opts)
        least = run([n_opts - 1] * n).peak_bytes
    most = problem.baseline.peak_bytes
    grid = [least + (most - least) * i // GRID_POINTS for i in range(GRID_POINTS)]
    # The budget's own plan first: the one that matters when the time limit cuts the rest.
    floor = beat.trace.added_time_s if beat is not None else math.inf
    best = functools.partial(_least_fitting, found, budget_bytes, floor)
    targets = [budget_bytes] + [g for g in grid if g < budget_bytes]
    events = len(problem.baseline.events)
    if events * GRID_POINTS > GRID_EVENTS:
        progress(f"native: {events:,} events a step: the DP at the budget alone, no grid")
        targets = targets[:1]
    cut = ""
    for i, target in enumerate(targets):
        if i and clock.now() > deadline:
            cut = (
                f"; the time limit (counted work) cut the DP after {i} of {len(targets)} "
                "budgets: a longer time_limit_s plans the rest"
            )
            progress(f"native: time limit reached{cut}")
            break
        _fit(table, target, n, run, best)
    _per_block_contenders(table, n, n_opts, budget_bytes, run, best)
    if schedule is not None:
        _misjudged(table, n, n_opts, budget_bytes, run, best)
    if shallow is not None:
        _uniform_contenders(shallow, n, budget_bytes, found, run, best)
    fitting = [
        (c, t) for c, t in found.items() if t.peak_bytes <= budget_bytes and _cost(t) < _cost(beat)
    ]
    traced = len(found) - 1
    if not fitting and beat is not None:
        return None, traced
    if not fitting:
        least_found = min(t.peak_bytes for t in found.values())
        return BudgetError(budget_bytes, least_found, "native SAC"), traced
    choice, trace = min(fitting, key=lambda ct: (ct[1].added_time_s, ct[1].peak_bytes))
    names = [options_of[k][o].name for k, o in enumerate(choice)]
    summary = ", ".join(f"{names.count(x)}x {x}" for x in dict.fromkeys(names))
    on_copies = (
        f"; the uniform plans costed on copies with {SHALLOW[0]} and {SHALLOW[1]} regions"
        if shallow is not None
        else ""
    )
    reason = (
        f"chain DP over {n} regions ({n_opts} options per class, {traced} plans traced "
        f"on FakeTensors{on_copies}): {summary}{cut}"
    )
    chosen = Solution(
        tuple(_policies(options_of, choice)),
        trace,
        "auto",
        reason,
        Proof.NEIGHBOURHOOD,
        tuple(names),
    )
    return chosen, traced


def _copies(
    problem: NativeProblem, uniform: UniformCosts | None, progress: Callable[[str], object]
) -> Mapped | None:
    """The uniform plans' chain costs and peaks from shallow copies, started (on forked
    workers where they pay: the MILP solves meanwhile); None where the model's own traces
    cost them (a stack too shallow for copies to pay, or copies that do not run)."""
    n = len(problem.blocks)
    if uniform is None or n < MIN_REGIONS:
        return None
    _, n_classes, n_opts = menus_of(problem)
    progress(
        f"native: {n} regions, {n_classes} class(es), {n_opts} options; each traced on "
        f"copies with {SHALLOW[0]} and {SHALLOW[1]} regions"
    )
    try:
        return uniform(list(uniform_plans(problem)))
    except Exception as e:  # any failure of the copies: the model's own traces are exact
        progress(f"native: the copies do not stand for the model ({e}); tracing it instead")
        return None


def _shallow_costs(
    problem: NativeProblem, copies: Mapped | None, progress: Callable[[str], object]
) -> list[tuple[ChainCosts, int]] | None:
    """:func:`_copies`' costs and peaks (None: trace them on the model), checked on the
    eager plan against the model's own trace."""
    if copies is None:
        return None
    baseline = problem.baseline
    with copies:
        try:
            eager = next(copies)
            if eager != (costs(baseline), baseline.peak_bytes):
                # E.g. a peak between ops (RNG states, FSDP2's resized parameters on the
                # host), which is no op's moment and does not extrapolate.
                progress(
                    f"native: the copies' eager step is not the model's (peak {eager[1]:,} B "
                    f"against {baseline.peak_bytes:,} B); tracing it instead"
                )
                return None
            return [eager, *copies]
        except Exception as e:  # any failure of the copies: the model's own traces are exact
            progress(f"native: the copies do not stand for the model ({e}); tracing it instead")
            return None


def _uniform_contenders(
    rows: Sequence[tuple[ChainCosts, int]],
    n: int,
    budget_bytes: int,
    found: dict[tuple[int, ...], StepTrace],
    run: Callable[[Sequence[int]], StepTrace],
    best: Callable[[], float],
) -> None:
    """Trace on the model each uniform plan costed on the copies that could be the answer:
    one that fits and adds no more time than ``best()``, the best traced plan that fits (so
    the answer is the one tracing every uniform plan would give); where no traced plan of
    its own fits, the one of least peak if it adds less than ``best()`` (the copies
    may misjudge its peak; without another plan, the error reports it)."""
    least = best()
    for o, (c, peak) in enumerate(rows):
        if peak <= budget_bytes and sum(c.time_s) <= least * (1 + 1e-9) + 1e-15:
            run([o] * n)
    if not any(t.peak_bytes <= budget_bytes for t in found.values()):
        lowest = min(range(len(rows)), key=lambda o: rows[o][1])
        if sum(rows[lowest][0].time_s) < best():
            run([lowest] * n)


def _per_block(
    problem: NativeProblem, tracer: Tracer, budget_bytes: int, beat: Solution | None = None
) -> tuple[Solution | None, int]:
    """The cheapest plan that fits of Megatron's per-block family (the first ``N`` blocks
    recomputed whole, the rest eager; ``recompute_num_layers``), ``N`` found by bisection
    (a peak that falls as blocks are recomputed): where the chain DP does not run, ``auto``
    is still never worse than it. None where no ``N`` fits, or (``beat``: a traced plan that
    fits) where none that adds less time than ``beat`` does: each block's added time is
    read off the plan recomputing every block, traced first, and the family's members that
    add as much as ``beat`` or more are not traced."""
    every = fixed_policies(problem, "block")
    n = len(every)
    traces: dict[int, StepTrace] = {0: problem.baseline}

    def trace(k: int) -> StepTrace:
        if k not in traces:
            traces[k] = tracer(tuple(every[:k]) + (None,) * (n - k))
        return traces[k]

    if trace(n).peak_bytes > budget_bytes:
        return None, len(traces) - 1
    hi = n  # the first members adding less than ``beat``: up to ``hi`` blocks
    if beat is not None:
        spent = itertools.accumulate(costs(trace(n)).time_s, initial=0.0)
        # (0 where ``beat`` recomputes nothing: the baseline, which does not fit.)
        hi = max((k for k, t in enumerate(spent) if t < beat.trace.added_time_s), default=0)
        if hi < n and trace(hi).peak_bytes > budget_bytes:
            return None, len(traces) - 1
    lo = 0  # lo does not fit, hi does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if trace(mid).peak_bytes <= budget_bytes else (mid, hi)
    names = ("recompute all",) * hi + ("eager",) * (n - hi)
    reason = (
        f"Megatron's per-block family: the first {hi} of {n} blocks recomputed whole, the "
        f"rest eager ({len(traces) - 1} plans traced by bisection)"
    )
    policies = tuple(every[:hi]) + (None,) * (n - hi)
    return Solution(policies, trace(hi), "auto", reason, Proof.HEURISTIC, names), len(traces) - 1


PER_BLOCK_TRACES = 4
"""Traces of the per-block family past the one the chain model picks (each one more block
recomputed), where the model's peak was low."""


def _per_block_contenders(
    table: list[ChainCosts],
    n: int,
    n_opts: int,
    budget_bytes: int,
    run: Callable[[Sequence[int]], StepTrace],
    best: Callable[[], float],
) -> None:
    """Trace the cheapest of Megatron's per-block family that fits: the first ``N`` blocks
    recomputed whole, the others eager (``recompute_num_layers``). The DP's search holds
    this family, but its budgets may step over the one plan of it that fits; traced here,
    ``auto`` is never worse than it (up to :data:`PER_BLOCK_TRACES` blocks misjudged). A
    member recomputing more than ``best()`` (a traced plan that fits) is not traced, nor
    are those after it, which recompute more."""
    every = n_opts - 1  # each class's last option: recompute all

    def family(k: int) -> list[int]:
        return [every] * k + [0] * (n - k)

    modelled = next((k for k in range(n + 1) if chain_peak(table, family(k)) <= budget_bytes), n)
    for k in range(modelled, min(n, modelled + PER_BLOCK_TRACES) + 1):
        if chain_time(table, family(k)) > best() * (1 + 1e-9):
            return
        if run(family(k)).peak_bytes <= budget_bytes:
            return


def _least_fitting(
    found: Mapping[tuple[int, ...], StepTrace], budget_bytes: int, floor: float = math.inf
) -> float:
    """The least added time of a traced plan that fits, or ``floor`` (another traced plan's
    that fits) if less (inf: none fits yet)."""
    fits = (t.added_time_s for t in found.values() if t.peak_bytes <= budget_bytes)
    return min([*fits, floor])


def _choice_key(options_of: Sequence[Sequence[Option]], choice: Sequence[int]) -> tuple[int, ...]:
    """A choice with each option past a shorter menu's end read as its last (its policies')."""
    return tuple(min(o, len(options_of[k]) - 1) for k, o in enumerate(choice))


def _policies(options_of: Sequence[Sequence[Option]], choice: Sequence[int]) -> list[Policy]:
    return [options_of[k][o].policy for k, o in enumerate(_choice_key(options_of, choice))]


def _trace_uniform(
    tracer: Tracer,
    options_of: Sequence[Sequence[Option]],
    n_opts: int,
    found: Mapping[tuple[int, ...], StepTrace],
    record: Callable[[tuple[int, ...], StepTrace], None],
) -> None:
    """Trace each option on every block (the DP's table) and ``record`` the traces, on
    forked workers where they add up to seconds (:func:`remat.fit.workers.mapped`): they
    are independent and the same wherever they run, so the plan does not depend on it."""
    keys = [_choice_key(options_of, [o] * len(options_of)) for o in range(n_opts)]
    todo = [k for k in dict.fromkeys(keys) if k not in found]

    def one(key: tuple[int, ...]) -> StepTrace:
        return tracer(_policies(options_of, key))

    with mapped(one, [(k,) for k in todo], None, min_work_s=TABLE_FORK_WORK_S) as traced:
        for key, trace in zip(todo, traced, strict=True):
            record(key, trace)


def _stage_table(
    problem: NativeProblem,
    tracer: Tracer,
    run: Callable[[Sequence[int]], StepTrace],
    options_of: Sequence[Sequence[Option]],
    n_opts: int,
) -> list[ChainCosts]:
    """A pipeline stage's chain costs. Each option's per-block quantities are one
    microbatch's (:func:`costs` reads the step, not the schedule), so they come from one
    microbatch's step each, without the schedule step (a 70B stage of 20 layers: 23 s a
    trace with 8 microbatches); :func:`in_flight` puts them in the schedule's context,
    calibrated on the two traced ends, every block eager and every block recomputed."""
    n = len(problem.blocks)
    steps = [problem.baseline] + [
        tracer(_policies(options_of, [o] * n), schedule=False) for o in range(1, n_opts)
    ]
    ends = {0: problem.baseline.peak_bytes, n_opts - 1: run([n_opts - 1] * n).peak_bytes}
    assert problem.baseline.schedule is not None
    return in_flight([costs(t) for t in steps], ends, problem.baseline.schedule)


def _misjudged(
    table: Sequence[ChainCosts],
    n: int,
    n_opts: int,
    budget_bytes: int,
    run: Callable[[Sequence[int]], StepTrace],
    best: Callable[[], float],
) -> None:
    """Trace the plans a user would try by hand that the DP's model of a pipeline stage may
    have misjudged: one option on every block, and Megatron's ``recompute_num_layers`` (the
    first N blocks recomputed whole, the rest eager). Those with less recompute than
    ``best()``, the best traced plan that fits, and that the model does not put over the
    budget, are traced, least recompute first, until one fits: so none of them that the
    model puts within the budget is cheaper than the chosen plan and fits (one the model
    puts over it, wrongly, can be missed)."""
    least = best()
    last = n_opts - 1
    candidates = [[o] * n for o in range(n_opts)]
    candidates += [[last] * first + [0] * (n - first) for first in range(1, n)]

    for choice in sorted(candidates, key=lambda choice: chain_time(table, choice)):
        if chain_time(table, choice) >= least:
            return
        if chain_peak(table, choice) <= budget_bytes and run(choice).peak_bytes <= budget_bytes:
            return


def planned(
    problem: NativeProblem,
    tracer: Tracer,
    solver: str,
    *,
    budget_bytes: int | None,
    config: SolverConfig,
) -> Solution:
    """``solver``'s plan for the step's dataflow under the ``sac`` executor, traced; while
    the trace is over the budget (the dataflow's simulation is an approximation of the
    executor, within a few percent), solved again for a budget smaller by the excess. On a
    pipeline stage the dataflow is one microbatch's while the stage holds several at its
    peak (:func:`in_flight_at_peak`): a byte less saved per microbatch is that many less at
    the peak, so the excess is divided by it. Where no round fits, the solver's least-peak
    plan is traced: returned if it fits, else :class:`BudgetError` states its traced peak (a
    budget this function then meets); a solver never returns another's plan under its name.
    The names of :data:`NATIVE_PLANS` are those plans (``keep_all`` keeps all or fails)."""
    if solver in NATIVE_PLANS:
        chosen = fixed(problem, solver, tracer)
        if budget_bytes is not None and chosen.trace.peak_bytes > budget_bytes:
            raise BudgetError(
                budget_bytes, chosen.trace.peak_bytes, f"native SAC, fixed plan {solver}"
            )
        return chosen
    sac = problem.dataflow
    candidates = executor_of(sac).candidates(sac)
    target = budget_bytes
    schedule = problem.baseline.schedule
    copies = in_flight_at_peak(schedule) if schedule is not None else 1
    peaks: list[int] = []
    for _ in range(DP_ROUNDS):
        try:
            plan = registry.solve(sac, solver=solver, budget_bytes=target, config=config)
        except BudgetError:
            break
        policies = policies_from_saved(problem, plan.saved & candidates)
        trace = tracer(policies)
        if budget_bytes is None or trace.peak_bytes <= budget_bytes:
            names = (f"{solver} policy",) * len(policies)
            # Solved again for less than the budget: the proof was for another budget.
            proof = plan.proof if target == budget_bytes else Proof.HEURISTIC
            return Solution(policies, trace, solver, f"{plan.reason}; traced", proof, names)
        peaks.append(trace.peak_bytes)
        if config.progress:
            config.progress(
                f"native {solver}: traced peak {fmt_bytes(trace.peak_bytes)} over the "
                f"budget, {fmt_bytes(budget_bytes)} (simulated "
                f"{fmt_bytes(plan.predicted_peak_bytes)}): solving for less"
            )
        assert target is not None
        # From the plan's simulated peak, which can be well below the target asked for,
        # less the excess and a share of the simulation's miss (:data:`MISS_MARGIN`).
        target = min(target, plan.predicted_peak_bytes)
        # On a pipeline stage the trace is the schedule's and the simulation one
        # microbatch's: their difference is no miss.
        miss = max(0, trace.peak_bytes - plan.predicted_peak_bytes) if schedule is None else 0
        target -= -(-(trace.peak_bytes - budget_bytes + int(miss * MISS_MARGIN)) // copies)
        if target < 0:  # the dataflow's peaks are far below the traced ones: give up
            break
    assert budget_bytes is not None
    # The solver's own least-peak plan, traced: it fits, or its peak is the least this
    # solver reaches, a budget at which this function returns that plan.
    least = registry.solve(
        sac, solver=solver, budget_bytes=registry.least_peak(sac, solver, config), config=config
    )
    policies = policies_from_saved(problem, least.saved & candidates)
    trace = tracer(policies)
    if trace.peak_bytes <= budget_bytes:
        names = (f"{solver} policy",) * len(policies)
        reason = (
            f"{least.reason}; its least-peak plan (plans solved for the budget traced over it "
            f"in {len(peaks)} rounds); traced"
        )
        return Solution(policies, trace, solver, reason, Proof.HEURISTIC, names)
    raise BudgetError(budget_bytes, trace.peak_bytes, f"native SAC, solver {solver}")


def _fit(
    table: list[ChainCosts],
    target: int,
    n: int,
    run: Callable[[Sequence[int]], StepTrace],
    best: Callable[[], float] = lambda: math.inf,
) -> None:
    """DP for ``target``, tracing each choice and asking for less until one fits. A choice
    that recomputes more than ``best()`` (the least recompute of a traced plan that fits)
    ends the search untraced: its trace would recompute exactly that much (a block's
    recompute is its own ops', whatever the others run: the tests check it), and the later
    choices, solved for less, as much or more (up to the DP's byte rounding)."""
    dp_budget = target
    step = max(1, target // 4000)
    tried: set[tuple[int, ...]] = set()
    for _ in range(DP_ROUNDS):
        choice = chain_dp(table, dp_budget, n)
        if choice is None:
            return
        if chain_time(table, choice) > best() * (1 + 1e-9):
            return
        key = tuple(choice)
        if key in tried:
            dp_budget -= step
            step *= 2
            continue
        tried.add(key)
        over = run(choice).peak_bytes - target
        if over <= 0:
            return
        dp_budget -= over


def to_plan(problem: NativeProblem, solution: Solution) -> Plan:
    """The solution as a :class:`remat.Plan` (the type the whole-graph path returns): saved
    values are ``path:op#k`` keys (``path:eager`` for a block without checkpoint), the
    schedule and timeline are the traced step's."""
    trace = solution.trace
    saved: list[str] = []
    decisions: dict[str, str] = {"(outside the blocks)": "eager: no checkpoint"}
    for k, (path, policy) in enumerate(zip(problem.blocks, solution.policies, strict=True)):
        if policy is None:
            saved.append(f"{path}:eager")
            decisions[f"{path}:eager"] = "no checkpoint: autograd keeps what it saves"
            continue
        for e in problem.streams[problem.class_of(k)]:
            if not e.savable or e.key is None:
                continue
            name = f"{path}:{e.key[0]}#{e.key[1]}"
            if e.key in policy:
                saved.append(name)
                decisions[name] = f"saved (MUST_SAVE): {_fmt(e.new_bytes)} kept"
            else:
                decisions[name] = "recomputed in the backward (PREFER_RECOMPUTE)"
    names = [_event_name(problem, e) for e in trace.events]
    timeline = tuple(
        TimelineStep(e.phase, name, e.allocated_bytes, e.tensor_bytes, e.recompute)
        for e, name in zip(trace.events, names, strict=True)
    )
    fwd = [k for k, e in enumerate(trace.events) if e.phase == "forward"]
    bwd = [k for k, e in enumerate(trace.events) if e.phase != "forward"]
    held = sum(end - start for start, end in trace.forward_live)
    simulation = Simulation(
        timeline=timeline,
        peak_bytes=trace.peak_bytes,
        tensor_peak_bytes=trace.tensor_peak_bytes,
        peak_step=_peak_step(trace, names),
        saved_bytes=held,
        recompute_flops=trace.recompute_flops,
        recompute_time_s=trace.recompute_time_s,
        forward_time_s=sum(trace.events[k].time_s for k in fwd),
        backward_time_s=sum(trace.events[k].time_s for k in bwd),
        dispatch_time_s=trace.dispatch_time_s,
    )
    schedule = Schedule(
        forward=tuple(names[k] for k in fwd),
        saved=tuple(saved),
        external_reads=(),
        backward=tuple(names[k] for k in bwd),
        recomputed=tuple(n for n, e in zip(names, trace.events, strict=True) if e.recompute),
    )
    return Plan(
        saved=frozenset(saved),
        solver=f"native:{solution.solver}",
        reason=solution.reason,
        proof=solution.proof,
        decisions=decisions,
        schedule=schedule,
        simulation=simulation,
    )


def _peak_step(trace: StepTrace, names: Sequence[str]) -> str:
    """Where the step peaks: an op; for a pipeline stage, the schedule's action."""
    if trace.schedule is not None:
        top = max(trace.schedule.actions, key=lambda a: a.peak_bytes)
        return f"pipeline action {top.kind}{top.microbatch}, {top.in_flight} in flight before"
    peak = trace.peak_event
    return f"{trace.events[peak].phase}:{names[peak]}"


def fingerprint(problem: NativeProblem) -> str:
    """A hash of the blocks and the op streams their policies see (with sizes; not costs)."""
    body = [
        [path, [[e.key, e.new_bytes, e.savable] for e in problem.streams[problem.class_of(k)]]]
        for k, path in enumerate(problem.blocks)
    ]
    return hashlib.sha256(json.dumps(body).encode()).hexdigest()


def policies_from_saved(problem: NativeProblem, saved: frozenset[str]) -> tuple[Policy, ...]:
    """Each block's policy from a plan's saved names (``path:op#k``, ``path:eager``)."""
    policies: list[Policy] = []
    for path in problem.blocks:
        if f"{path}:eager" in saved:
            policies.append(None)
            continue
        keys = []
        for name in saved:
            block, _, key = name.rpartition(":")
            if block == path:
                op, _, k = key.rpartition("#")
                keys.append((op, int(k)))
        policies.append(frozenset(keys))
    known = {f"{p}:" for p in problem.blocks}
    stray = sorted(n for n in saved if not any(n.startswith(b) for b in known))
    if stray:
        raise ValueError(f"the plan names blocks this model does not have: {stray[:3]}")
    return tuple(policies)


def _event_name(problem: NativeProblem, e: OpEvent) -> str:
    where = problem.blocks[e.block] if e.block >= 0 else "outside"
    return f"{where}:{e.op}" + (f"#{e.key[1]}" if e.key else "")


def _fmt(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


__all__ = [
    "FITTED_PLANS",
    "NATIVE_PLANS",
    "NativeProblem",
    "Option",
    "Solution",
    "analyze",
    "costs",
    "fingerprint",
    "fixed",
    "fixed_policies",
    "menu",
    "policies_from_saved",
    "solve",
    "to_plan",
    "uniform_plans",
]
