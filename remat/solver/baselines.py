"""Rule-based plans that practitioners use today, as baselines for the optimizing solvers.

* ``keep_all``, ``keep_inputs``, ``keep_matmuls``: the fixed plans of :mod:`remat.solver.fixed`.
* ``block``: every repeated block fully checkpointed, as Hugging Face's
  ``gradient_checkpointing_enable()`` does: a block keeps only its inputs, the backward
  recomputes its internals; values outside blocks are kept.
* ``megatron``: Megatron-LM's selective recompute (Korthikanti et al. 2022): keep everything
  except the attention-score tensors (``QK^T``, scaling, masking, softmax, dropout over the
  ``s x s`` scores), which the backward recomputes from Q and K.

Outputs of random ops (dropout masks) are always kept: remat never replays random numbers.
"""

from __future__ import annotations

from collections.abc import Callable

from remat.problem import Problem, Role
from remat.solver.blocks import block_of
from remat.solver.config import SolverConfig
from remat.solver.fixed import fixed_saved_set, must_save
from remat.solver.plan import Plan, Proof, make_plan

_MATMULS = frozenset({"aten.bmm.default", "aten.mm.default", "aten.baddbmm.default"})


def _fixed(name: str, reason: str) -> Callable[..., Plan]:
    def solve(problem: Problem, *, budget_bytes: int | None, config: SolverConfig) -> Plan:
        why = fixed_saved_set(problem, name)
        return make_plan(
            problem, why, solver=name, reason=reason, proof=Proof.HEURISTIC, why_saved=why
        )

    solve.__name__ = name
    solve.__doc__ = f"The fixed plan {name!r} (see remat.solver.fixed)."
    return solve


keep_all = _fixed("keep_all", "no recomputation")
keep_inputs = _fixed("keep_inputs", "only dropout masks kept: maximal recomputation")
keep_matmuls = _fixed("keep_matmuls", "matmul/conv/attention outputs kept, cheap ops recomputed")


def block_checkpoint(problem: Problem, *, budget_bytes: int | None, config: SolverConfig) -> Plan:
    blocks = block_of(problem, config.block_types)
    n_blocks = len({b for b in blocks.values() if b is not None})
    if n_blocks == 0:
        raise ValueError(
            "no repeated blocks found (no ModuleList children and no block_types given); "
            "name the block class, e.g. SolverConfig(block_types=('GPT2Block',))"
        )
    why: dict[str, str] = {}
    values = problem.by_name
    for v in problem.values:
        if v.role is not Role.BACKWARD:
            continue
        for i in v.inputs:
            if values[i].role is Role.FORWARD and blocks[v.name] is None:
                why.setdefault(i, "saved: read by the backward outside any block")
    for v in problem.values:
        if v.role is not Role.FORWARD or blocks[v.name] is None:
            continue
        for i in v.inputs:
            if values[i].role is Role.FORWARD and blocks[i] != blocks[v.name]:
                why.setdefault(i, f"saved: input of block {blocks[v.name]}")
    why |= must_save(problem)
    return make_plan(
        problem,
        why,
        solver="block",
        reason=f"{n_blocks} blocks fully checkpointed (inputs kept, internals recomputed)",
        proof=Proof.HEURISTIC,
        why_saved=why,
    )


def attention_scores(problem: Problem) -> frozenset[str]:
    """Forward values of shape (..., s, s) downstream of a batched matmul producing such a
    shape, up to (not including) the matmul that consumes them."""

    def square(shape: tuple[int, ...]) -> bool:
        return len(shape) >= 3 and shape[-1] == shape[-2] > 1

    values = problem.by_name
    users = problem.users
    found: set[str] = set()
    stack = [
        v.name
        for v in problem.values
        if v.role is Role.FORWARD and v.op in _MATMULS and square(v.shape)
    ]
    while stack:
        name = stack.pop()
        if name in found:
            continue
        found.add(name)
        for u in users[name]:
            w = values[u]
            if w.role is Role.FORWARD and w.op not in _MATMULS and square(w.shape):
                stack.append(u)
    return frozenset(found)


def megatron_selective(problem: Problem, *, budget_bytes: int | None, config: SolverConfig) -> Plan:
    scores = attention_scores(problem)
    why = {
        n: "saved: read by the backward, not an attention score"
        for n in problem.backward_reads
        if n not in scores
    }
    why |= must_save(problem)
    reason = (
        f"attention scores recomputed ({len(scores)} values)"
        if scores
        else "no explicit attention scores (fused attention): same as keep_all"
    )
    return make_plan(
        problem, why, solver="megatron", reason=reason, proof=Proof.HEURISTIC, why_saved=why
    )
