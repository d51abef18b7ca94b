"""Hand-built problems for solver and simulator tests (no torch)."""

from __future__ import annotations

from remat.problem import Problem, Role, Value

MiB = 1 << 20


def op(
    name: str,
    role: Role,
    inputs: tuple[str, ...] = (),
    *,
    alloc: int = 1,
    view_of: str | None = None,
    flops: int = 0,
    random: bool = False,
    op_name: str = "aten.op.default",
) -> tuple[Value, dict[str, int]]:
    """A value allocating ``alloc`` MiB storages (or viewing ``view_of``'s storage)."""
    if view_of is not None:
        return Value(name, role, "aten.view.default", inputs, storages=(f"{view_of}#0",)), {}
    storages = tuple(f"{name}#{i}" for i in range(alloc))
    return (
        Value(
            name,
            role,
            op_name,
            inputs,
            storages=storages,
            allocates=storages,
            flops=flops,
            time_s=float(flops),
            random=random,
        ),
        {s: MiB for s in storages},
    )


def problem(
    specs: list[tuple[Value, dict[str, int]]],
    user_outputs: tuple[str, ...],
    grads: tuple[str, ...],
    mutations: tuple[str, ...] = (),
) -> Problem:
    sizes: dict[str, int] = {}
    for _, s in specs:
        sizes |= s
    return Problem(
        values=tuple(v for v, _ in specs),
        storage_bytes=sizes,
        user_outputs=user_outputs,
        mutation_outputs=mutations,
        grad_outputs=grads,
    )


def external(name: str, role: Role = Role.PARAM) -> tuple[Value, dict[str, int]]:
    return Value(name, role, "placeholder"), {}


def chain() -> Problem:
    """x, w -> a -> b -> out, all 1 MiB; backward gb, ga, gw.

    x  w                  t (tangent of out)
     \\/                   |
      a --> b --> out     gb = h'(t, b) --> ga = g'(gb, a) --> gw = f'(ga, x)
    """
    return problem(
        [
            external("x", Role.INPUT),
            external("w"),
            op("a", Role.FORWARD, ("x", "w"), flops=10),
            op("b", Role.FORWARD, ("a",), flops=20),
            op("out", Role.FORWARD, ("b",), flops=30),
            op("t", Role.TANGENT),
            op("gb", Role.BACKWARD, ("t", "b")),
            op("ga", Role.BACKWARD, ("gb", "a")),
            op("gw", Role.BACKWARD, ("ga", "x")),
        ],
        user_outputs=("out",),
        grads=("gw",),
    )
