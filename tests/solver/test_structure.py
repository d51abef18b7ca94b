"""Blocks and their classes (:mod:`remat.solver.structure`)."""

from __future__ import annotations

from dataclasses import replace

from remat.problem import Problem, Role
from remat.solver.structure import block_problem, find_structure
from tests.solver.builders import external, op, problem


def _with_accumulations(n: int) -> Problem:
    """``n`` blocks whose backward sums two gradients of ``a`` (``acc``, as autograd does for a
    value with two users) and adds the gradient flowing in (``join``); both carry the head's
    module, as the trace attributes them on GPT-2."""
    specs = [external("x", Role.INPUT), external("w")]
    prev = "x"
    for i in range(n):
        stack = ((f"layers.{i}", "Layer"),)
        for v, s in (
            op(f"a{i}", Role.FORWARD, (prev, "w")),
            op(f"b{i}", Role.FORWARD, (f"a{i}",)),
            op(f"h{i}", Role.FORWARD, (f"a{i}", f"b{i}")),
        ):
            specs.append((replace(v, module_stack=stack), s))
        prev = f"h{i}"
    head = (("head", "Linear"),)
    specs.append(op("loss", Role.FORWARD, (prev,)))
    specs.append(op("t", Role.TANGENT))
    grad = "t"
    for i in reversed(range(n)):
        stack = ((f"layers.{i}", "Layer"),)
        for (value, sizes), module in (
            (op(f"gb{i}", Role.BACKWARD, (grad, f"a{i}")), stack),
            (op(f"gh{i}", Role.BACKWARD, (grad, f"b{i}")), stack),
            (op(f"acc{i}", Role.BACKWARD, (f"gb{i}", f"gh{i}")), head),
            (op(f"ga{i}", Role.BACKWARD, (f"acc{i}", "w")), stack),
            (op(f"join{i}", Role.BACKWARD, (f"ga{i}", grad)), head),
        ):
            specs.append((replace(value, module_stack=module), sizes))
        grad = f"join{i}"
    return problem(specs, user_outputs=("loss",), grads=())


def test_an_accumulation_inside_a_blocks_backward_belongs_to_the_block() -> None:
    """``acc`` runs between the block's backward ops and reads only its values: the block's,
    so the block problem frees its summands once it has run instead of holding them as
    gradients passed on. ``join`` reads the gradient flowing in: it stays outside, and the
    blocks stay one class."""
    prob = _with_accumulations(3)
    structure = find_structure(prob)
    assert structure.classes == ((0, 1, 2),)
    for i, block in enumerate(structure.blocks):
        assert f"acc{i}" in block.backward and f"join{i}" not in block.backward
    sub = block_problem(prob, structure.blocks[1])
    assert "gb1" not in sub.grad_outputs and "gh1" not in sub.grad_outputs
    assert "ga1" in sub.grad_outputs  # the join outside reads it
