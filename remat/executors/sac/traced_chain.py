"""The chain DP on traced costs (:mod:`remat.executors.sac.planner`, steps 3-4): each menu
option traced on every block, or costed on two shallow copies of a deep stack, gives
:class:`~remat.solver.chain_dp.ChainCosts`; the DP picks one option per block; its plan is
traced, and solved again for less where the trace is over the budget."""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from remat.executors.sac.policies import fixed_policies, menus_of, uniform_plans
from remat.executors.sac.regions import Policy
from remat.executors.sac.shallow import MIN_REGIONS, SHALLOW, UniformCosts
from remat.executors.sac.solution import NativeProblem, Option, Solution, Tracer, cost_of
from remat.executors.sac.trace import StepTrace
from remat.fit.workers import Mapped, mapped
from remat.parallel.pipelining import ScheduleTrace
from remat.solver import clock
from remat.solver.chain_dp import ChainCosts, ChainCostsBuilder, chain_dp, chain_peak, chain_time
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.plan import Proof

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


TABLE_FORK_WORK_S = 1.0
"""The DP's table is traced on forked workers where its traces would take this long or more
here (a fork of the analysed process costs a tenth of that: the zoo's 3-block Llama, ten
traces of a third of a second each, 3.2 s on one core, 1.8 s on two)."""


def costs(trace: StepTrace) -> ChainCosts:
    """Per-block quantities of a traced step (see :class:`remat.solver.chain_dp.ChainCosts`)."""
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
class _TracedPlans:
    """The plans :func:`chain_solution` traced, by choice (each option read within its
    block's menu: :func:`_choice_key`): each plan traced once, charged to the counted clock
    and told to the progress as it is recorded. One record that the search's stages share,
    so that each sees what the others traced."""

    tracer: Tracer
    options_of: Sequence[Sequence[Option]]
    progress: Callable[[str], object]
    t0: float
    """When the search started (wall clock), for the progress."""
    found: dict[tuple[int, ...], StepTrace]

    def record(self, key: tuple[int, ...], trace: StepTrace) -> None:
        """Keep ``trace`` as ``key``'s, its events counted as work (the time limit counts
        traced events, not seconds)."""
        self.found[key] = trace
        clock.charge(clock.TRACED_EVENT_S * len(trace.events))
        self.progress(
            f"native: {len(self.found) - 1} plans traced, {time.perf_counter() - self.t0:.0f} s"
        )

    def run(self, choice: Sequence[int]) -> StepTrace:
        """The plan of ``choice`` traced (once)."""
        key = _choice_key(self.options_of, choice)
        if key not in self.found:
            self.record(key, self.tracer(_policies(self.options_of, key)))
        return self.found[key]


def chain_solution(
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
    shallow copies (:func:`shallow_copies`), where it has them. ``beat``: a traced plan that fits
    (the MILP's); only plans that add less time are traced (a plan's added time is its
    blocks', known before its trace), and None is returned where none does."""
    t0 = time.perf_counter()
    deadline = clock.now() + config.time_limit_s
    n = len(problem.blocks)
    options_of, n_classes, n_opts = menus_of(problem)
    progress = config.progress or (lambda _: None)
    # Option 0 is every class's "eager": the baseline is that plan, traced already.
    plans = _TracedPlans(tracer, options_of, progress, t0, {(0,) * n: problem.baseline})
    table, least, shallow = _dp_table(problem, copies, plans, n_classes, n_opts)
    targets = _targets(problem, budget_bytes, least, progress)
    floor = beat.trace.added_time_s if beat is not None else math.inf
    best = functools.partial(_least_fitting, plans.found, budget_bytes, floor)
    cut = _fit_targets(table, targets, n, plans.run, best, deadline, progress)
    _per_block_contenders(table, n, n_opts, budget_bytes, plans.run, best)
    if problem.baseline.schedule is not None:
        _misjudged(table, n, n_opts, budget_bytes, plans.run, best)
    if shallow is not None:
        _uniform_contenders(shallow, n, budget_bytes, plans.found, plans.run, best)
    return _chosen(plans, n_opts, budget_bytes, beat, shallow is not None, cut)


def _dp_table(
    problem: NativeProblem,
    copies: Mapped | None,
    plans: _TracedPlans,
    n_classes: int,
    n_opts: int,
) -> tuple[list[ChainCosts], int, list[tuple[ChainCosts, int]] | None]:
    """The DP's table (each option's per-block costs on every block), the least peak of the
    uniform plans, and their costs and peaks on the shallow copies where those stand for the
    model (None: the table is from traces of the model itself, or a pipeline stage's)."""
    n = len(problem.blocks)
    schedule = problem.baseline.schedule
    shallow: list[tuple[ChainCosts, int]] | None = None
    if schedule is None:
        shallow = _shallow_costs(problem, copies, plans.progress)
    if shallow is not None:
        table = [c for c, _ in shallow]
        least = min(peak for _, peak in shallow)
    elif schedule is None:
        plans.progress(
            f"native: {n} regions, {n_classes} class(es), {n_opts} options; tracing each"
        )
        _trace_uniform(plans.tracer, plans.options_of, n_opts, plans.found, plans.record)
        traces = [plans.run([o] * n) for o in range(n_opts)]
        table = [costs(t) for t in traces]
        least = min(t.peak_bytes for t in traces)
    else:
        plans.progress(
            f"native: {n} regions, {n_classes} class(es), {n_opts} options; one microbatch's "
            "step each"
        )
        table = _stage_table(problem, plans.tracer, plans.run, plans.options_of, n_opts)
        least = plans.run([n_opts - 1] * n).peak_bytes
    return table, least, shallow


def _targets(
    problem: NativeProblem, budget_bytes: int, least: int, progress: Callable[[str], object]
) -> list[int]:
    """The budgets the DP is solved at: ``budget_bytes``, then the grid's below it between
    the least and the eager peaks, where a step's traces are short (:data:`GRID_EVENTS`)."""
    most = problem.baseline.peak_bytes
    grid = [least + (most - least) * i // GRID_POINTS for i in range(GRID_POINTS)]
    # The budget's own plan first: the one that matters when the time limit cuts the rest.
    targets = [budget_bytes] + [g for g in grid if g < budget_bytes]
    events = len(problem.baseline.events)
    if events * GRID_POINTS > GRID_EVENTS:
        progress(f"native: {events:,} events a step: the DP at the budget alone, no grid")
        targets = targets[:1]
    return targets


def _fit_targets(
    table: list[ChainCosts],
    targets: Sequence[int],
    n: int,
    run: Callable[[Sequence[int]], StepTrace],
    best: Callable[[], float],
    deadline: float,
    progress: Callable[[str], object],
) -> str:
    """:func:`_fit` at each of ``targets`` in turn until the counted clock passes
    ``deadline`` (the first always runs); the reason's note where the time limit cut them
    short, else ''."""
    for i, target in enumerate(targets):
        if i and clock.now() > deadline:
            cut = (
                f"; the time limit (counted work) cut the DP after {i} of {len(targets)} "
                "budgets: a longer time_limit_s plans the rest"
            )
            progress(f"native: time limit reached{cut}")
            return cut
        _fit(table, target, n, run, best)
    return ""


def _chosen(
    plans: _TracedPlans,
    n_opts: int,
    budget_bytes: int,
    beat: Solution | None,
    on_copies: bool,
    cut: str,
) -> tuple[Solution | BudgetError | None, int]:
    """:func:`chain_solution`'s answer from the plans it traced: the one that fits and adds
    least time (then of least peak) if it adds less than ``beat``; else None where ``beat``
    is given, or the error with the least peak traced. ``on_copies``: the table was costed
    on shallow copies; ``cut``: the time limit's note (:func:`_fit_targets`)."""
    found, options_of = plans.found, plans.options_of
    n = len(options_of)
    fitting = [
        (c, t)
        for c, t in found.items()
        if t.peak_bytes <= budget_bytes and cost_of(t) < cost_of(beat)
    ]
    n_traced = len(found) - 1
    if not fitting and beat is not None:
        return None, n_traced
    if not fitting:
        least_found = min(t.peak_bytes for t in found.values())
        return BudgetError(budget_bytes, least_found, "native SAC"), n_traced
    choice, trace = min(fitting, key=lambda ct: (ct[1].added_time_s, ct[1].peak_bytes))
    names = [options_of[k][o].name for k, o in enumerate(choice)]
    summary = ", ".join(f"{names.count(x)}x {x}" for x in dict.fromkeys(names))
    copied = (
        f"; the uniform plans costed on copies with {SHALLOW[0]} and {SHALLOW[1]} regions"
        if on_copies
        else ""
    )
    reason = (
        f"chain DP over {n} regions ({n_opts} options per class, {n_traced} plans traced "
        f"on FakeTensors{copied}): {summary}{cut}"
    )
    chosen = Solution(
        tuple(_policies(options_of, choice)),
        trace,
        "auto",
        reason,
        Proof.NEIGHBOURHOOD,
        tuple(names),
    )
    return chosen, n_traced


def shallow_copies(
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
    """:func:`shallow_copies`' costs and peaks (None: trace them on the model), checked on the
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


def per_block(
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
