"""Three fixed plans that exercise the executor end to end.

* ``keep_all``: save every forward value the backward reads: what eager autograd keeps.
* ``keep_inputs``: save nothing but what must be saved (dropout masks); the backward recomputes
  the rest. Under the executor's recompute-once rule the first backward op recomputes the whole
  forward and every value then stays alive until its last use, so this minimises what crosses
  from forward to backward, not the backward's peak (which is then about keep_all's).
* ``keep_matmuls``: save the outputs of matmul, convolution and attention kernels (the expensive
  ops) and recompute the cheap ops between them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from remat.problem import Problem, Role
from remat.solver.plan import Plan, Proof, make_plan

MATMUL_OPS = frozenset(
    {
        "aten.mm.default",
        "aten.addmm.default",
        "aten.bmm.default",
        "aten.baddbmm.default",
        "aten.convolution.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default",
    }
)


def must_save(problem: Problem) -> dict[str, str]:
    """Outputs of random ops (recomputing them would draw fresh random numbers) and pinned
    values (the loss's, computed once outside remat's graphs)."""
    return {
        v.name: (
            "saved: random op output (never recomputed)"
            if v.random
            else "saved: computed once for the loss (never recomputed)"
        )
        for v in problem.values
        if v.role is Role.FORWARD and v.never_recomputed
    }


def _keep_all(problem: Problem) -> dict[str, str]:
    out = {n: "saved: read by the backward (keep everything)" for n in problem.backward_reads}
    return out | must_save(problem)


def _keep_inputs(problem: Problem) -> dict[str, str]:
    return must_save(problem)


def _keep_matmuls(problem: Problem) -> dict[str, str]:
    values = problem.by_name
    out: dict[str, str] = {}
    for v in problem.values:
        if v.role is not Role.FORWARD:
            continue
        producer = values[v.inputs[0]] if v.op == "getitem" and v.inputs else v
        if producer.op in MATMUL_OPS:
            out[v.name] = f"saved: output of {producer.op.split('.')[1]}"
    return out | must_save(problem)


FIXED_PLANS: Mapping[str, Callable[[Problem], dict[str, str]]] = {
    "keep_all": _keep_all,
    "keep_inputs": _keep_inputs,
    "keep_matmuls": _keep_matmuls,
}


def fixed_saved_set(problem: Problem, name: str) -> dict[str, str]:
    """The saved set of fixed plan ``name``, each value with the reason it is saved."""
    try:
        rule = FIXED_PLANS[name]
    except KeyError:
        raise ValueError(
            f"unknown plan {name!r}; valid plans: {', '.join(sorted(FIXED_PLANS))}"
        ) from None
    return rule(problem)


def keep_all_plan(problem: Problem, solver: str) -> Plan:
    """``keep_all`` as ``solver``'s plan where it fits: nothing recomputed, which no plan
    beats (optimal, lower bound 0)."""
    return make_plan(
        problem,
        fixed_saved_set(problem, "keep_all"),
        solver=solver,
        reason=f"{solver}: keep_all fits, no recomputation needed (optimal)",
        proof=Proof.OPTIMAL,
        lower_bound_s=0.0,
    )
