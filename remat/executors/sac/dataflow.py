"""A traced step as a :class:`remat.Problem` for the ``sac`` executor.

The step traced with every block eager records, per ATen op, the storages it read and made
(:class:`remat.executors.sac.trace.OpEvent`). That is a dataflow graph over the very op stream the
regions' policies see: one value per op, in dispatch order, forward values labelled with the
block they ran in (their region), backward ops with the block whose backward ran them. The
solvers plan on it through :data:`remat.solver.executor.SAC`, like any problem; the native
planner then traces their plans, which has the last word on the peak.

Keyed forward ops of a block are named as plan files name them (``path:op#k``), so a saved
set is a plan's saved set.
"""

from __future__ import annotations

from remat.executors.sac.events import StepTrace
from remat.problem import DispatchCosts, Problem, Role, Value
from remat.solver.executor import NO_CHECKPOINT


def value_names(trace: StepTrace) -> list[str]:
    names = []
    for k, e in enumerate(trace.events):
        if e.key is not None and e.phase == "forward" and e.block >= 0 and not e.recompute:
            names.append(f"{trace.blocks[e.block]}:{e.key[0]}#{e.key[1]}")
        else:
            names.append(f"{k}:{e.op}")
    return names


def problem_of(
    trace: StepTrace, device_profile: str, dispatch: DispatchCosts | None = None
) -> Problem:
    """The eager-traced step ``trace`` as a problem for the ``sac`` executor. An op with
    several outputs (``native_batch_norm``'s output and statistics) gets one projection per
    output, as the joint graph's ``getitem``: each lives as long as its own readers."""
    if any(e.recompute for e in trace.events):
        raise ValueError("build the problem from a step traced with every block eager")
    names = value_names(trace)

    def ref(event: int, storage: str) -> str:
        holds = trace.events[event].holds
        return f"{names[event]}[{holds.index(storage)}]" if len(holds) > 1 else names[event]

    held = _held_by_program(trace)
    values = []
    started: set[int] = set()
    for k, (e, name) in enumerate(zip(trace.events, names, strict=True)):
        forward = e.phase == "forward"
        role = Role.FORWARD if forward else Role.BACKWARD
        region = trace.blocks[e.block] if e.block >= 0 else ""
        if forward and e.block >= 0 and e.block not in started:
            started.add(e.block)
            # "Keeping" it leaves the block without checkpoint (see remat.solver.executor).
            values.append(Value(f"{region}:eager", role, NO_CHECKPOINT, region=region))
        reads = (*e.reads, *held.get(k, ()))
        values.append(
            Value(
                name=name,
                role=role,
                op=e.op,
                inputs=tuple(dict.fromkeys(ref(r, st) for r, st in reads)),
                storages=e.holds,
                allocates=e.creates,
                flops=e.flops,
                time_s=e.time_s,
                random=e.writes_outside,  # must never re-run (see remat.solver.executor)
                savable=e.savable,
                policy=forward and e.block >= 0 and e.key is not None,
                scratch_bytes=e.scratch_bytes,
                region=region,
            )
        )
        if len(e.holds) > 1:
            values.extend(
                Value(f"{name}[{j}]", role, "getitem", (name,), (st,), region=region)
                for j, st in enumerate(e.holds)
            )

    def maker(storage: str) -> str:
        return ref(int(storage[1:].partition(".")[0]), storage)

    outputs = tuple(dict.fromkeys(maker(s) for s in trace.outputs))
    grads = tuple(
        dict.fromkeys(
            maker(s)
            for s in sorted(trace.live_at_end)
            if trace.events[int(s[1:].partition(".")[0])].phase != "forward"
        )
    )
    return Problem(
        values=tuple(values),
        storage_bytes=dict(trace.storage_bytes),
        user_outputs=outputs,
        grad_outputs=grads,
        device_profile=device_profile,
        executor="sac",
        dispatch=dispatch or DispatchCosts(),
    )


def _held_by_program(trace: StepTrace) -> dict[int, list[tuple[int, str]]]:
    """Extra reads (event -> (creator, storage)) that keep each storage as long as the eager step kept
    it: Python variables, caches and hooks hold a value past its last use, autograd holds
    what it saved until its backward node ran. For a block's values that its own backward
    released, only the forward part is taken (their locals die when the block returns; what
    a region keeps for its backward is the executor's business), except a parameter cast
    under autocast, which autocast's cache holds to the end of the forward."""
    events = trace.events
    block_end: dict[int, int] = {}
    forward_end = 0
    for k, e in enumerate(events):
        if e.phase == "forward" and not e.recompute:
            forward_end = k
            if e.block >= 0:
                block_end[e.block] = k
    extra: dict[int, list[tuple[int, str]]] = {}
    for storage, after in trace.deaths.items():
        made = int(storage[1:].partition(".")[0])
        last = after - 1
        if last <= made:
            continue
        maker, user = events[made], events[last]
        own = user.phase != "forward" and user.block == maker.block  # its block's autograd
        if maker.phase == "forward" and maker.block >= 0 and own:
            cached_cast = maker.op == "aten._to_copy.default" and not maker.reads
            last = forward_end if cached_cast else block_end[maker.block]
        if last > made:
            extra.setdefault(last, []).append((made, storage))
    return extra


__all__ = ["problem_of", "value_names"]
