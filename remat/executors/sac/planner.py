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
   :class:`remat.solver.chain_dp.ChainCosts`, and the chain solver's DP
   (:func:`remat.solver.chain_dp.chain_dp`) picks one option per block under the budget. On a
   pipeline stage these per-block quantities are one microbatch's, so each option is traced
   as one microbatch's step, without the schedule step (:func:`~remat.executors.sac.traced_chain.in_flight` counts the
   microbatches held, calibrated on every block eager and every block recomputed traced
   through the schedule); the plans a user would try by hand that this model may misjudge
   are traced too (``traced_chain._misjudged``).
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
   or a second opinion where shallow copies cost its options (:func:`solve`). ``solver=``
   picks one of remat's solvers alone (:func:`planned`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from remat.executors.sac.offloading import with_or_without
from remat.executors.sac.policies import (
    FITTED_PLANS,
    NATIVE_PLANS,
    fixed_policies,
    matmul_keys,
    menu,
    required_keys,
    torchtitan_op_keys,
    uniform_plans,
)
from remat.executors.sac.regions import Policy
from remat.executors.sac.shallow import UniformCosts
from remat.executors.sac.solution import (
    NativeProblem,
    Option,
    Solution,
    Tracer,
    added_ms,
    cost_of,
)
from remat.executors.sac.trace import FakeModel, OpEvent, StepTrace
from remat.executors.sac.traced_chain import (
    DP_ROUNDS,
    MISS_MARGIN,
    chain_solution,
    costs,
    in_flight,
    in_flight_at_peak,
    per_block,
    shallow_copies,
)
from remat.measure.profiles import DeviceProfile
from remat.solver import clock, registry
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.executor import executor_of
from remat.solver.offload import Offload
from remat.solver.plan import Plan, Proof, fmt_bytes
from remat.solver.schedule import Schedule
from remat.solver.simulate import SecondCopyError, Simulation, TimelineStep


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
    host_budget_bytes: int = 0,
    headroom_bytes: int = 0,
) -> Solution:
    """The cheapest traced plan whose peak fits ``budget_bytes`` (module docstring).
    ``solver``: ``auto``, or one of remat's solvers, which plan on the step's dataflow for
    the ``sac`` executor (:func:`planned`). ``uniform``: the chain DP's uniform plans costed
    on shallow copies of a deep stack (:mod:`remat.executors.sac.shallow`), where it has one.

    ``milp_first``: the exact MILP first; the chain DP is then its fallback, and a second
    opinion where shallow copies cost its options (a deep stack: then it traces a few plans
    on the model); elsewhere the per-block family, bisected in one to three traces. Why
    not the chain DP on the model itself: it traces every option on it (ten or so traces),
    which only a toy model's step affords (the 16,000 events that once allowed it reached
    3-4-block models alone). On the test zoo's six models it took 1.5x ``remat.apply``'s
    planning time and found a plan with less added time at 10 of 72 budgets: by 0.2-5.8%,
    and by 34% on a 3-block ResNet at its least peak (``experiments/second_opinion.py``).
    Why the MILP first: on a 7B Llama at 40 GB the chain DP's traces took 13 s (blocks) and
    27 s (sub-modules) to find 7.79 and 6.95 ms of recompute, against the MILPs' 5.35 and
    1.68 ms found in 6 s each; at 70B the MILP's fixed lifetimes gave a plan recomputing
    every layer (17% of the step) where the chain DP's fit the budget's room
    (``traced_chain._per_block_contenders``). Which solvers run depends on the model, never
    on the clock.

    ``second_opinions``: False where a plan that the chain DP or the per-block family
    already checked stands (the blocks' plan, when ``auto`` plans again on their
    sub-modules): the MILP's plan is then returned alone, the chain DP only its fallback.
    Why: on the zoo (six models, three budgets each) the finer pass's second opinions never
    gave a cheaper plan, and they took a sixth to a third of ``auto``'s time (a 7B Llama's
    per-block family on its sub-modules: 6 of 36 s; hf_llama_gqa's chain DP: 2.6 of 7 s).

    ``host_budget_bytes``: where the step does not fit as it is, plan again with region
    inputs offloaded, and return the cheaper (:mod:`remat.executors.sac.offloading`);
    ``headroom_bytes``: what offload frees at most, which the MILP's budget adds."""
    progress = config.progress or (lambda _: None)
    if (
        host_budget_bytes
        and budget_bytes is not None
        and problem.baseline.peak_bytes > budget_bytes
    ):

        def again(traced_by: Tracer, headroom: int) -> Solution:
            return solve(problem, traced_by, budget_bytes=budget_bytes, config=config,
                         solver=solver, uniform=uniform, milp_first=milp_first,
                         second_opinions=second_opinions, headroom_bytes=headroom)  # fmt: skip

        return with_or_without(problem, tracer, host_budget_bytes, again, progress)
    if solver != "auto":
        return planned(
            problem, tracer, solver, budget_bytes=budget_bytes, config=config,
            headroom_bytes=headroom_bytes,
        )  # fmt: skip
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
    # Started first: on forked workers where they pay, the copies trace while the MILP solves.
    copies = (
        shallow_copies(problem, uniform, progress) if problem.baseline.schedule is None else None
    )
    try:
        if not milp_first:
            chain, traced = chain_solution(problem, tracer, budget_bytes, config, copies)
        milp = _milp(problem, tracer, budget_bytes, config, headroom_bytes)
        if milp_first:
            if milp is not None and not second_opinions:
                why = "no second opinion: the blocks' plan, which had them, stands against it"
                progress(f"native: {why}")
                return dataclasses.replace(milp, solver="auto", reason=f"{milp.reason}; {why}")
            if milp is None or copies is not None:
                chain, traced = chain_solution(problem, tracer, budget_bytes, config, copies, milp)
            else:
                progress(
                    "native: the per-block family by bisection as a second opinion (the "
                    "chain DP traces its options on shallow copies of a deep stack, or as "
                    "the fallback)"
                )
                chain, traced = per_block(problem, tracer, budget_bytes, milp)
                other = "the per-block family"
    finally:
        if copies is not None:  # read, or not needed: its workers stop
            copies.close()
    return _cheaper(chain, milp, traced, f"{time.perf_counter() - t0:.1f} s", other)


def _milp(
    problem: NativeProblem,
    tracer: Tracer,
    budget_bytes: int,
    config: SolverConfig,
    headroom_bytes: int = 0,
) -> Solution | None:
    """The exact MILP's traced plan (its time limit the request's, whatever ran before), or
    None (none fits, or a dataflow beyond its model)."""
    progress = config.progress or (lambda _: None)
    progress("native: the exact MILP on the step's dataflow (sac executor)")
    try:
        return planned(
            problem, tracer, "exact", budget_bytes=budget_bytes, config=config,
            headroom_bytes=headroom_bytes,
        )  # fmt: skip
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
    if milp is None or cost_of(milp) >= cost_of(chain):
        also = (
            f"; the exact MILP's plan was not cheaper ({added_ms(milp)} against {added_ms(chain)} of "
            "recompute)"
            if milp is not None
            else ""
        )
        return dataclasses.replace(chain, reason=f"{chain.reason}{also}; {took}")
    why = (
        f"{added_ms(milp)} of recompute against {other}'s best, {added_ms(chain)} ({traced} traced)"
    )
    return dataclasses.replace(milp, solver="auto", reason=f"{milp.reason}; {why}; {took}")


def planned(
    problem: NativeProblem,
    tracer: Tracer,
    solver: str,
    *,
    budget_bytes: int | None,
    config: SolverConfig,
    headroom_bytes: int = 0,
) -> Solution:
    """``solver``'s plan for the step's dataflow under the ``sac`` executor, traced; while
    the trace is over the budget (the dataflow's simulation is an approximation of the
    executor, within a few percent), solved again for a budget smaller by the excess. On a
    pipeline stage the dataflow is one microbatch's while the stage holds several at its
    peak (:func:`in_flight_at_peak`): a byte less saved per microbatch is that many less at
    the peak, so the excess is divided by it. Where no round fits, the solver's least-peak
    plan is traced: returned if it fits, else :class:`BudgetError` states its traced peak (a
    budget this function then meets); a solver never returns another's plan under its name.
    The names of :data:`NATIVE_PLANS` are those plans (``keep_all`` keeps all or fails).
    ``headroom_bytes``: solved first for the budget plus that much (what the tracer's
    offload frees, which the dataflow does not model; the traces decide)."""
    if solver in NATIVE_PLANS:
        chosen = fixed(problem, solver, tracer)
        if budget_bytes is not None and chosen.trace.peak_bytes > budget_bytes:
            raise BudgetError(
                budget_bytes, chosen.trace.peak_bytes, f"native SAC, fixed plan {solver}"
            )
        return chosen
    sac = problem.dataflow
    candidates = executor_of(sac).candidates(sac)
    target = None if budget_bytes is None else budget_bytes + headroom_bytes
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
        TimelineStep(e.phase, name, e.allocated_bytes, e.tensor_bytes, e.recompute, e.late_bytes)
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
        offloaded_bytes=trace.offloaded_bytes,
        host_peak_bytes=trace.host_peak_bytes,
        copy_exposed_s=trace.copy_exposed_s,
    )
    offloads = _offloads(trace, names)
    for o in offloads:
        decisions[o.value] = (
            f"offloaded: in host memory from the forward's end, the device copy let go after "
            f"{o.wait}, back before {o.prefetch}"
        )
    schedule = Schedule(
        forward=tuple(names[k] for k in fwd),
        saved=tuple(saved),
        external_reads=(),
        backward=tuple(names[k] for k in bwd),
        recomputed=tuple(n for n, e in zip(names, trace.events, strict=True) if e.recompute),
        offloaded=offloads,
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


def _offloads(trace: StepTrace, names: Sequence[str]) -> tuple[Offload, ...]:
    """Each offloaded region input (``path:inputs``) and the ops its copies are tied to:
    ``wait``, the op after which its device copy is let go (the next region's forward's
    last); ``prefetch``, the backward op its copy back precedes."""
    marks = {(m.copy, m.kind): m for m in trace.copies}
    last = len(names) - 1
    return tuple(
        Offload(
            f"{m.region}:inputs",
            wait=names[min(max(marks[(m.copy, "release")].event - 1, 0), last)],
            prefetch=names[min(marks[(m.copy, "prefetch")].event, last)],
        )
        for m in trace.copies
        if m.kind == "out"
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
    "in_flight",
    "matmul_keys",
    "menu",
    "policies_from_saved",
    "required_keys",
    "solve",
    "to_plan",
    "torchtitan_op_keys",
    "uniform_plans",
]
