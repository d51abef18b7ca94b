"""Properties of the schedule and the simulator on random DAGs (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from remat.problem import Problem, Role, Value
from remat.solver import build_schedule, simulate
from remat.solver.fixed import fixed_saved_set


@st.composite
def problems(draw: st.DrawFn) -> tuple[Problem, frozenset[str]]:
    n = draw(st.integers(2, 12))
    values: list[Value] = [
        Value("x", Role.INPUT, "placeholder"),
        Value("w", Role.PARAM, "placeholder"),
    ]
    sizes: dict[str, int] = {}
    fwd: list[Value] = []
    for i in range(n):
        pool = ["x", "w", *(v.name for v in fwd)]
        k = draw(st.integers(1, min(3, len(pool))))
        inputs = tuple(dict.fromkeys(draw(st.lists(st.sampled_from(pool), min_size=k, max_size=k))))
        name = f"f{i}"
        base = next((v for v in reversed(fwd) if v.name in inputs and v.storages), None)
        if base is not None and draw(st.booleans()) and i < n - 1:
            # A view: free (as remat.measure.costs makes them), usually of its only input.
            if draw(st.booleans()):
                inputs = (base.name,)
            values.append(
                Value(name, Role.FORWARD, "aten.view.default", inputs, storages=base.storages)
            )
        else:
            s = f"{name}#0"
            sizes[s] = draw(st.integers(1, 8)) * 1024
            values.append(
                Value(
                    name,
                    Role.FORWARD,
                    "aten.op.default",
                    inputs,
                    storages=(s,),
                    allocates=(s,),
                    flops=(flops := draw(st.integers(0, 100))),
                    time_s=float(flops + 1),
                    random=draw(st.integers(0, 9)) == 0,
                )
            )
        fwd.append(values[-1])
    out = fwd[-1].name
    sizes["t#0"] = sizes.get(f"{out}#0", 1024)
    values.append(Value("t", Role.TANGENT, "placeholder", storages=("t#0",), allocates=("t#0",)))
    prev = "t"
    grads = []
    for i, f in enumerate(reversed(fwd)):
        reads = draw(st.lists(st.sampled_from([f.name, *f.inputs]), max_size=2))
        name = f"b{i}"
        s = f"{name}#0"
        sizes[s] = draw(st.integers(1, 8)) * 1024
        inputs = tuple(dict.fromkeys([prev, *reads]))
        values.append(
            Value(name, Role.BACKWARD, "aten.op.default", inputs, storages=(s,), allocates=(s,))
        )
        prev = name
    grads.append(prev)
    prob = Problem(tuple(values), sizes, user_outputs=(out,), grad_outputs=tuple(grads))
    random = {v.name for v in fwd if v.random}
    chosen = draw(st.sets(st.sampled_from([v.name for v in fwd])))
    return prob, frozenset(chosen | random)


@settings(max_examples=300, deadline=None)
@given(problems())
def test_schedule_runs_every_op_once_after_its_inputs(case: tuple[Problem, frozenset[str]]) -> None:
    prob, saved = case
    sched = build_schedule(prob, saved)
    values = prob.by_name
    external = {v.name for v in prob.values if v.role in (Role.INPUT, Role.PARAM)}
    done = set(external)
    for name in sched.forward:
        assert values[name].role is Role.FORWARD
        assert set(values[name].inputs) <= done
        done.add(name)
    assert set(sched.saved) <= set(sched.forward)
    avail = external | set(sched.saved) | {"t"}
    for name in sched.backward:
        assert set(values[name].inputs) <= avail, name
        assert name not in avail, f"{name} computed twice"
        avail.add(name)
    assert [n for n in sched.backward if values[n].role is Role.BACKWARD] == [
        v.name for v in prob.values if v.role is Role.BACKWARD
    ]
    assert [n for n in sched.backward if values[n].role is Role.FORWARD] == list(sched.recomputed)


@settings(max_examples=300, deadline=None)
@given(problems())
def test_memory_accounting_balances(case: tuple[Problem, frozenset[str]]) -> None:
    prob, saved = case
    sim = simulate(prob, build_schedule(prob, saved))
    assert all(s.live_bytes >= 0 for s in sim.timeline)
    assert sim.peak_bytes == max(s.allocated_bytes for s in sim.timeline)
    held = {
        s for n in (*prob.user_outputs, "t", *prob.grad_outputs) for s in prob.by_name[n].storages
    }
    assert sim.timeline[-1].live_bytes == sum(prob.storage_bytes[s] for s in held)
    recomputed = build_schedule(prob, saved).recomputed
    assert sim.recompute_flops == sum(prob.by_name[n].flops for n in recomputed)


@settings(max_examples=200, deadline=None)
@given(problems())
def test_keep_all_never_recomputes(case: tuple[Problem, frozenset[str]]) -> None:
    prob, _ = case
    assert build_schedule(prob, fixed_saved_set(prob, "keep_all")).recomputed == ()
