"""The exact MILP's model of the executor's schedule: variables, memory rows, lazy cuts.

Model (all quantities are those of :mod:`remat.solver.simulate`):

* ``s[v]`` (binary): forward value ``v`` is saved. ``R[v, t]`` (binary): ``v`` is recomputed in
  backward *stage* ``t``. Stages are the backward ops that read forward values, in the fixed
  backward order; recomputation only ever happens just before one of them. Each value is
  available once at most (``s + sum_t R <= 1``), must be available where the backward reads it,
  and a recomputed value's forward inputs must be available when it is recomputed. Random values
  are never recomputed.
* Memory is counted per storage. A storage is live at a moment if one of its holders has been
  materialised (saved, or recomputed at an earlier or the same stage) and is still to be used
  (by a later backward op, or by a recomputation at a later moment). Constraints are written at
  every forward op, at every backward op between stages, and at the moment each stage's backward
  op allocates: at all of these the model's live bytes equal the simulator's.
* The moments *inside* a stage, while its recomputations run and eager frees release
  intermediates, are not written up front (there are values x stages of them). The MILP is
  therefore a relaxation: its optimum is a lower bound on the true optimum. Its plan is
  simulated; if a recomputation moment exceeds the budget, that moment's exact constraint is
  added (a lazy cut) and the MILP solved again. When the simulated plan fits, it is optimal.

"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping

import pulp

from remat.problem import EXTERNAL_ROLES, Problem, Role, Value
from remat.solver import clock
from remat.solver.backend import best_bound, objective_scale
from remat.solver.milp_constants import backward_constants, forward_constants
from remat.solver.plan import Plan
from remat.solver.simulate import Simulation

SAVED, UNUSED = "<saved>", "<unused>"
"""Fixed choices of a neighbourhood solve besides "recomputed for backward op X"."""


def cost_bound(model: MilpModel) -> float | None:
    """The proven lower bound on recompute seconds of a budgeted model, if the solver has one
    (the model is a relaxation until its cuts are in, so its bound is always valid)."""
    raw = best_bound(model.lp)
    if raw is None or not math.isfinite(raw) or model.budget_var is not None:
        return None
    bound = max(0.0, raw - model.tie_max) / model.scale
    return bound if math.isfinite(bound) else None


class ModelTimeout(RuntimeError):
    """Building the LP/MILP model took the whole time limit (the solver never started)."""


class BelowFloor(Exception):
    """The budget is below the live bytes every plan has (``floor``): no model is built."""

    def __init__(self, floor: int) -> None:
        super().__init__(f"budget below the plan-independent floor, {floor:,} B")
        self.floor = floor


class MilpModel:
    """The relaxation (without intra-stage moments) plus whatever cuts are added to it."""

    def __init__(
        self,
        problem: Problem,
        budget: int | None,
        fold: Mapping[str, str] | None = None,
        fix: Mapping[str, str] | None = None,
        deadline: float | None = None,
        kept_weight: float = 0.0,
        kept_stage: int = 0,
        forward_memory: bool = True,
        memory_from: int = 0,
    ) -> None:
        self.problem = problem
        self.deadline = deadline
        """``clock.now()`` past which building stops with :class:`ModelTimeout`: on a
        graph of a few hundred values the model takes longer to build than to solve, and the
        solvers' own time limits do not cover it."""
        self.kept_weight = kept_weight
        self.kept_stage = kept_stage
        """Seconds per byte live before stage ``kept_stage``'s recomputations added to the
        objective (:func:`remat.solver.milp.kept_tradeoff`)."""
        self.forward_memory = forward_memory
        self.memory_from = memory_from
        """``forward_memory=False`` drops the memory rows along the forward, ``memory_from``
        those of the backward's stages before it: relaxations, for a bound that writes the
        rest under a budget those moments do not share (:mod:`remat.solver.block_bound`)."""
        self.fold = dict(fold or {})
        self.fix = dict(fix or {})
        """Forward values fixed as in a start plan (a neighbourhood solve) -> the stage (backward
        op) they are recomputed for, ``SAVED`` or ``UNUSED``."""
        bw = [v for v in problem.values if v.role is Role.BACKWARD]
        self._stages(bw)
        self._windows()
        owned_by_fwd = self._storages()
        self.bw_const = backward_constants(
            problem, bw, self.stage_k, self.user_storages, owned_by_fwd
        )
        self.fw_const = forward_constants(
            problem, self.fwd, self.pos, self.fwd_storages, self.user_storages
        )
        self.floor = max([*self.bw_const.base, *self.fw_const.base, self.bw_const.tail_max])
        """Live bytes whatever the plan: no budget below it is feasible."""
        if budget is not None and budget < self.floor:
            raise BelowFloor(self.floor)  # nothing to build
        self.lp = pulp.LpProblem("remat", pulp.LpMinimize)
        self._build(budget)

    # ----------------------------------------------------------------- indexes
    def _stages(self, bw: list[Value]) -> None:
        """Forward values in order, and the stages: the backward ops (of ``bw``, the backward
        in order) that read forward values, where recomputations happen."""
        self.fwd = [v.name for v in self.problem.values if v.role is Role.FORWARD]
        self.pos = {n: i for i, n in enumerate(self.fwd)}
        self.bw_index = {v.name: k for k, v in enumerate(bw)}
        fwd_set = set(self.fwd)
        self.stages = [v.name for v in bw if any(i in fwd_set for i in v.inputs)]
        self.stage_of_op = {n: t for t, n in enumerate(self.stages)}
        self.T = len(self.stages)
        self.stage_k = [self.bw_index[n] for n in self.stages]

    def _windows(self) -> None:
        """Direct backward reads, forward consumers, and each value's window: the stages at
        which it may be recomputed (read there, or by a consumer recomputed there)."""
        values = self.problem.by_name
        self.direct: dict[str, set[int]] = {n: set() for n in self.fwd}
        for t, name in enumerate(self.stages):
            for i in values[name].inputs:
                if i in self.pos:
                    self.direct[i].add(t)
        self.consumers: dict[str, list[str]] = {n: [] for n in self.fwd}
        for n in self.fwd:
            for i in dict.fromkeys(values[n].inputs):
                if i in self.pos:
                    self.consumers[i].append(n)
        window: dict[str, set[int]] = {}
        for n in reversed(self.fwd):
            w = set(self.direct[n])
            for c in self.consumers[n]:
                if not values[c].never_recomputed:  # never recomputed, so never needs n recomputed
                    w |= window[c]
            window[n] = w
        self.window = {n: sorted(w) for n, w in window.items()}
        self.last_direct = {n: max(d) if d else -1 for n, d in self.direct.items()}
        self.last_possible = {n: max(window[n]) if window[n] else -1 for n in self.fwd}

    def _storages(self) -> set[str]:
        """Storages owned by forward values, with their forward holders; user outputs'
        storages are held all step long. Returns the storages forward values allocate."""
        values = self.problem.by_name
        self.user_storages = {s for o in self.problem.user_outputs for s in values[o].storages}
        self.fwd_storages: dict[str, list[str]] = {}  # storage -> forward holders
        for n in self.fwd:
            for s in values[n].storages:
                if s not in self.user_storages:
                    self.fwd_storages.setdefault(s, []).append(n)
        owned_by_fwd = {s for n in self.fwd for s in values[n].allocates}
        self.fwd_storages = {s: h for s, h in self.fwd_storages.items() if s in owned_by_fwd}
        return owned_by_fwd

    # ----------------------------------------------------------------- model
    def _tick(self) -> None:
        """Called for every variable and in the loops that add constraints only."""
        clock.charge(clock.MODEL_TICK_S)
        if self.deadline is not None and clock.now() > self.deadline:
            raise ModelTimeout(
                "the LP/MILP model was not built within the time limit "
                f"({self.lp.numVariables():,} variables so far)"
            )

    def _var(
        self,
        name: str,
        lowBound: float | None = None,
        upBound: float | None = None,
        cat: str = "Continuous",  # noqa: N803
    ) -> pulp.LpVariable:
        self._tick()
        var = self.lp.add_variable(name, lowBound, upBound, cat=cat)
        if cat == "Binary":
            # pulp resets a binary's bounds to [0, 1] whatever it is given: fixing one (a folded
            # value never saved, a neighbourhood's fixed choices) needs them set afterwards.
            var.lowBound = 0 if lowBound is None else lowBound
            var.upBound = 1 if upBound is None else upBound
        return var

    def _build(self, budget: int | None) -> None:
        """The MILP, section by section: variables, dataflow, uses, no second copies, the
        backward's memory, the forward's memory, the objective."""
        self.budget_var = self._var("peak", lowBound=0) if budget is None else None
        self.M = self.budget_var if budget is None else budget
        self.cuts = 0
        self._variables()
        self._dataflow()
        self._uses()
        self._no_second_copies()
        self._backward_memory()
        if self.forward_memory:
            self._forward_memory()
        self._objective(budget)

    def _variables(self) -> None:
        """s (saved), R (recomputed at stage t) and their cumulative availability C."""
        lp, values = self.lp, self.problem.by_name
        # A folded value is never saved and shares its consumer's recompute variables
        # (remat.solver.compress).
        self.s = {
            n: self._var(
                f"s_{i}",
                lowBound=int(self.fix.get(n) == SAVED),
                upBound=0 if n in self.fold or self.fix.get(n, SAVED) != SAVED else 1,
                cat="Binary",
            )
            for i, n in enumerate(self.fwd)
        }
        self.R: dict[tuple[str, int], pulp.LpVariable] = {}
        for i in reversed(range(len(self.fwd))):
            n = self.fwd[i]
            if values[n].never_recomputed:
                continue
            for t in self.window[n]:
                if n in self.fold:
                    self.R[n, t] = self.R[self.fold[n], t]
                elif n in self.fix:
                    on = int(self.fix[n] == self.stages[t])
                    self.R[n, t] = self._var(f"r_{i}_{t}", on, on, cat="Binary")
                else:
                    self.R[n, t] = self._var(f"r_{i}_{t}", cat="Binary")
        self.R_of: dict[str, list[tuple[int, pulp.LpVariable]]] = {n: [] for n in self.fwd}
        for (n, t), var in self.R.items():
            self.R_of[n].append((t, var))
        # Cumulative availability C[n][k] = s[n] + R[n, t_0] + ... + R[n, t_k] over n's window,
        # one variable each: writing the sums out wherever availability is read would cost
        # (values x stages x window) nonzeros (16 M on GPT-2 small, 100x the rest).
        self.C_t: dict[str, list[int]] = {}
        self.C: dict[str, list[pulp.LpVariable]] = {}
        for n in self.fwd:
            self.R_of[n].sort(key=lambda tv: tv[0])
            prev = self.s[n]
            chain = []
            for t, r in self.R_of[n]:
                c = self._var(f"c_{self.pos[n]}_{t}", lowBound=0, upBound=1)
                _row(lp, [(c, 1), (prev, -1), (r, -1)], 0, EQ)
                chain.append(c)
                prev = c
            self.C_t[n] = [t for t, _ in self.R_of[n]]
            self.C[n] = chain

    def avail(self, n: str, t: int, strict: bool = False) -> pulp.LpAffineExpression:
        """Materialised by stage t (before it if strict)."""
        var = self.avail_var(n, t, strict)
        return pulp.lpSum([]) + 1 if var is None else pulp.lpSum([var])

    def avail_var(self, n: str, t: int, strict: bool = False) -> pulp.LpVariable | None:
        """:meth:`avail`'s variable; None for a value the caller holds (always available)."""
        if self.problem.by_name[n].role in EXTERNAL_ROLES:
            return None
        k = (bisect.bisect_left if strict else bisect.bisect_right)(self.C_t[n], t)
        return self.C[n][k - 1] if k else self.s[n]

    def _dataflow(self) -> None:
        """Each value computed once at most, available where read, recomputed only where used."""
        lp, values, has = self.lp, self.problem.by_name, self._has
        for n in self.fwd:
            if n not in self.fold:
                once = [(self.s[n], 1), *((v, 1) for _, v in self.R_of[n])]
                _row(lp, once, -1, LE, f"once_{self.pos[n]}")
        for t, name in enumerate(self.stages):
            self._tick()
            for u in dict.fromkeys(values[name].inputs):
                if u in self.pos:
                    terms, const = has(u, t)
                    _row(lp, terms, const - 1, GE, f"read_{t}_{self.pos[u]}")
        for (n, t), var in self.R.items():
            self._tick()
            for u in dict.fromkeys(values[n].inputs):
                if u in self.pos and self.fold.get(u) != n:  # a folded input shares var
                    terms, const = has(u, t)
                    _row(lp, [*terms, (var, -1)], const, GE, f"dep_{self.pos[n]}_{t}_{self.pos[u]}")
            # Recompute only where used: with the availability constraints this makes t the
            # first stage that needs the value, exactly where the executor recomputes it.
            if n not in self.fold and t not in self.direct[n]:
                users = [(self.R[c, t], -1) for c in self.consumers[n] if (c, t) in self.R]
                _row(lp, [(var, 1), *users], 0, LE, f"need_{self.pos[n]}_{t}")

    def _has(self, n: str, t: int, strict: bool = False) -> tuple[list[Term], float]:
        """:meth:`avail` as terms and a constant, for :func:`_row`."""
        var = self.avail_var(n, t, strict)
        return ([], 1.0) if var is None else ([(var, 1)], 0.0)

    def _uses(self) -> None:
        """B[h, t]: h is used at stage t or later (1 up to its last direct read)."""
        lp = self.lp
        self.B: dict[tuple[str, int], pulp.LpVariable] = {}
        for n in self.fwd:
            hi = self.last_possible[n]
            for t in range(hi, self.last_direct[n], -1):
                var = self._var(f"b_{self.pos[n]}_{t}", lowBound=0, upBound=1)
                nxt = self.B.get((n, t + 1))
                if nxt is not None:
                    _row(lp, [(var, 1), (nxt, -1)], 0, GE)
                for c in self.consumers[n]:
                    rc = self.R.get((c, t))
                    if rc is not None:
                        _row(lp, [(var, 1), (rc, -1)], 0, GE)
                self.B[n, t] = var

    def used_from(self, n: str, t: int) -> pulp.LpVariable | float:
        if t <= self.last_direct[n]:
            return 1.0
        return self.B.get((n, t), 0.0)

    def _no_second_copies(self) -> None:
        """No second copies (remat.solver.schedule): an op is not recomputed at t while another
        holder of a storage it allocates (a saved view, a view recomputed earlier, a backward
        value, the caller's user output) is materialised before t and still in use."""
        lp, values, avail, used_from = self.lp, self.problem.by_name, self.avail, self.used_from
        for o in self.fwd:
            self._tick()
            for s in values[o].allocates:
                for t, r in self.R_of[o]:
                    if s in self.user_storages or s in self.bw_const.pre_hold[t]:
                        lp += r == 0, f"copy_{_safe(s)}_{t}"
                        continue
                    for h in self.fwd_storages.get(s, ()):
                        use = used_from(h, t)
                        if h == o or (isinstance(use, float) and use == 0.0):
                            continue
                        lp += avail(h, t, strict=True) + r + use <= 2

    def _backward_memory(self) -> None:
        """Storage liveness at each stage's op (b_t) and in the gap before it, under M."""
        p, lp, T, M = self.problem, self.lp, self.T, self.M
        has, used_from = self._has, self.used_from
        total = 0
        at_op: list[list[tuple[int, pulp.LpVariable]]] = [[] for _ in range(T)]
        before: list[list[tuple[str, int, pulp.LpVariable]]] = [[] for _ in range(T)]
        for s, holders in self.fwd_storages.items():
            nbytes = p.storage_bytes[s]
            total += nbytes
            hi = max(self.last_possible[h] for h in holders)
            for t in range(hi + 1):
                for kind in ("a", "g"):
                    # var >= mat + use - 1 for each holder: materialised and still used.
                    rows: list[tuple[list[Term], float]] = []
                    for h in holders:
                        if kind == "a":
                            use = 1.0 if t in self.direct[h] else used_from(h, t + 1)
                            mat, const = has(h, t)
                        else:
                            use = used_from(h, t)
                            mat, const = has(h, t, strict=True)
                        if isinstance(use, float):
                            if use == 0.0:
                                continue
                            rows.append(([(x, -c) for x, c in mat], 1 - const - use))
                        else:
                            rows.append(([*((x, -c) for x, c in mat), (use, -1)], 1 - const))
                    bw_held = kind == "a" and s in self.bw_const.hold[self.stage_k[t]]
                    if not rows and not bw_held:
                        continue
                    var = self._var(f"{kind}_{_safe(s)}_{t}", lowBound=0, upBound=1)
                    for terms, const in rows:
                        _row(lp, [(var, 1), *terms], const, GE)
                    if bw_held:
                        _row(lp, [(var, 1)], -1, GE)
                    if kind == "a":
                        at_op[t].append((nbytes, var))
                    else:
                        before[t].append((s, nbytes, var))
        self.total_bytes = total + p.storages_bytes(self.user_storages)
        self.live_before = [[(b, v) for _, b, v in terms] for terms in before]
        """Per stage, the forward storages live before its recomputations: bytes, variable..."""
        self.live_at = at_op
        """...and while its op runs, after them."""
        at = self.kept_stage
        self.kept_terms = self.live_before[at] if at < T else []
        for t in range(self.memory_from, T):
            self._tick()
            base = self.bw_const.base[self.stage_k[t]]
            _under(lp, base, at_op[t], M, f"mem_stage_{t}")
            for g, (held, base) in enumerate(self.bw_const.gap_max[t].items()):
                live = [(b, v) for s_, b, v in before[t] if s_ not in held]
                _under(lp, base + p.storages_bytes(held), live, M, f"mem_gap_{t}_{g}")
        if self.bw_const.tail_max:
            lp += pulp.lpSum([]) + self.bw_const.tail_max <= M, "mem_tail"

    def _forward_memory(self) -> None:
        """Forward: saved storages outlive their natural death; optional ops run only if saved."""
        p, lp, M = self.problem, self.lp, self.M
        values = p.by_name
        S = {s: self._var(f"S_{_safe(s)}", lowBound=0, upBound=1) for s in self.fwd_storages}
        for s, holders in self.fwd_storages.items():
            for h in holders:
                lp += S[s] >= self.s[h]
        # Optional forward ops (no output needs them) run only to produce a saved value:
        # f[n] says n runs. A storage lives past its natural death (core ops only) until its
        # last running optional consumer, and to the end of the forward if saved.
        optional = [n for n in self.fwd if n not in self.fw_const.core]
        f = {n: self._var(f"f_{self.pos[n]}", lowBound=0, upBound=1) for n in optional}
        for n in optional:
            lp += f[n] >= self.s[n]
            for u in values[n].inputs:
                if u in f:
                    lp += f[u] >= f[n]
        owner = {st: n for n in self.fwd for st in values[n].allocates}
        extend_at: dict[int, list[tuple[int, pulp.LpVariable]]] = {}
        transient: dict[int, list[tuple[int, pulp.LpVariable]]] = {}
        for st, holders in self.fwd_storages.items():
            n = owner[st]
            start = self.pos[n] if n in f else self.fw_const.death[st] + 1
            users = sorted({w for h in holders for w in self.consumers[h] if w in f})
            users = [w for w in users if self.pos[w] >= start]
            last = max([self.pos[w] for w in users], default=start - 1)
            if n in f:
                last = max(last, start)  # its own step, if it runs
            for k in range(start, last + 1):
                a = self._var(f"o_{_safe(st)}_{k}", lowBound=0, upBound=1)
                lp += a >= S[st]
                if n in f and k == start:
                    lp += a >= f[n]
                for w in users:
                    if self.pos[w] >= k:
                        lp += a >= f[w]
                transient.setdefault(k, []).append((p.storage_bytes[st], a))
            extend_at.setdefault(last + 1, []).append((p.storage_bytes[st], S[st]))
        running: pulp.LpAffineExpression = pulp.lpSum([])
        for k in range(len(self.fwd)):
            if k in extend_at:
                running = running + pulp.lpSum(b * v for b, v in extend_at[k])
            extra = pulp.lpSum(b * v for b, v in transient.get(k, []))
            n = self.fwd[k]
            if n in f and values[n].scratch_bytes:
                extra += values[n].scratch_bytes * f[n]
            lp += self.fw_const.base[k] + running + extra <= M, f"mem_fw_{k}"

    def _objective(self, budget: int | None) -> None:
        """Recompute time in nanoseconds: solvers' default absolute gaps (HiGHS: 1e-6) would
        swallow differences of microseconds expressed in seconds. Ties go to fewer saved
        bytes, with a total weight below the cheapest op's time."""
        p, values = self.problem, self.problem.by_name
        self.scale = objective_scale([values[n].time_s for n, _ in self.R])
        cost = pulp.lpSum(self.scale * values[n].time_s * v for (n, _), v in self.R.items())
        cheapest = min(
            [self.scale * values[n].time_s for n, _ in self.R if values[n].time_s > 0] or [1.0]
        )
        tie = {
            n: 1e-3 * cheapest * p.storages_bytes(values[n].allocates) / max(1, self.total_bytes)
            for n in self.fwd
        }
        self.tie_max = sum(tie.values())
        """Largest value the tie-break can add to the objective (subtracted from bounds)."""
        small = pulp.lpSum(w * self.s[n] for n, w in tie.items())
        self.cost = cost.copy()
        """Recompute time in objective units (``scale`` per second), without the tie-break."""
        if self.kept_weight:
            w = self.scale * self.kept_weight
            cost += pulp.lpSum(w * b * v for b, v in self.kept_terms)
        self.lp += self.budget_var if budget is None else cost + small
        self.binaries = len({id(v) for v in self.R.values()}) + len(self.s) - len(self.fold)

    def add_moment_cut(self, w: str, t: int) -> bool:
        """Exact live bytes at the moment ``w`` is recomputed in stage ``t`` (eager frees)."""
        var_w = self.R.get((w, t))
        if var_w is None:
            return False
        p, lp = self.problem, self.lp
        pw = self.pos[w]
        terms = []
        held = self.bw_const.pre_hold[t]
        for s, holders in self.fwd_storages.items():
            if s in held:
                continue
            parts = []
            for h in holders:
                mat = self.avail(h, t, strict=self.pos[h] > pw)
                later = [
                    self.R[c, t]
                    for c in self.consumers[h]
                    if self.pos[c] >= pw and (c, t) in self.R
                ]
                use_now = 1.0 if t in self.direct[h] else None
                nxt = self.used_from(h, t + 1)
                if (
                    use_now is None
                    and not later
                    and isinstance(nxt, float)
                    and nxt == 0.0
                    and h != w
                ):
                    continue
                u = self._var(f"cu{self.cuts}_{self.pos[h]}_{_safe(s)}", lowBound=0, upBound=1)
                lp += u >= (use_now if use_now is not None else 0)
                if not isinstance(nxt, float) or nxt:
                    lp += u >= nxt
                for r in later:
                    lp += u >= r
                if h == w:
                    lp += u >= var_w
                parts.append(mat + u - 1)
            if parts:
                a = self._var(f"ca{self.cuts}_{_safe(s)}", lowBound=0, upBound=1)
                for part in parts:
                    lp += a >= part
                terms.append((p.storage_bytes[s], a))
        scratch = p.by_name[w].scratch_bytes  # w's kernel, while it runs
        lp += (
            self.bw_const.pre_base[t]
            + scratch
            + p.storages_bytes(held)
            + pulp.lpSum(b * a for b, a in terms)
            <= self.M + (self.total_bytes + scratch) * (1 - var_w),
            f"cut_{self.cuts}",
        )
        self.cuts += 1
        return True

    def saved(self) -> set[str]:
        return {n for n, v in self.s.items() if (v.value() or 0) > 0.5}

    def recomputed_at(self) -> dict[str, int]:
        return {n: t for (n, t), v in self.R.items() if (v.value() or 0) > 0.5}


def violations(
    model: MilpModel, sim: Simulation, budget: float, stage_op: Mapping[str, str]
) -> list[tuple[str, int]]:
    """(value, stage) of every recomputation moment above the budget, worst first; the stage
    is the MILP's if it recomputes the value, else the executor's."""
    chosen = model.recomputed_at()
    steps = [s for s in sim.timeline if s.recompute and s.allocated_bytes > budget]
    steps.sort(key=lambda s: -s.allocated_bytes)
    return [(s.name, chosen.get(s.name, model.stage_of_op[stage_op[s.name]])) for s in steps]


def stage_ops(plan: Plan) -> dict[str, str]:
    """The backward op each recomputed value is recomputed for (the next non-recompute op)."""
    out: dict[str, str] = {}
    pending: list[str] = []
    rec = set(plan.schedule.recomputed)
    for name in plan.schedule.backward:
        if name in rec:
            pending.append(name)
        else:
            for p in pending:
                out[p] = name
            pending = []
    return out


def start_values(model: MilpModel, plan: Plan) -> dict[pulp.LpVariable, float]:
    """Variable values of a plan (saved set and the executor's recompute stages)."""
    start = {var: 0.0 for var in model.s.values()} | {var: 0.0 for var in model.R.values()}
    for n in plan.schedule.saved:
        if n in model.s:
            start[model.s[n]] = 1.0
    for n, op in stage_ops(plan).items():
        var = model.R.get((n, model.stage_of_op[op]))
        if var is None:
            return {}
        start[var] = 1.0
    return start


Term = tuple[pulp.LpVariable, float]
"""A variable and its coefficient in a row."""
EQ, LE, GE = pulp.LpConstraintEQ, pulp.LpConstraintLE, pulp.LpConstraintGE


def _row(
    lp: pulp.LpProblem, terms: Iterable[Term], constant: float, sense: int, name: str | None = None
) -> None:
    """Add ``sum(coef * var) + constant <sense> 0``: the row pulp's operators build (the same
    terms in the same order, a repeated variable's coefficients summed), without the
    intermediate expressions each operator copies, which took most of a model's build."""
    coefs: dict[pulp.LpVariable, float] = {}
    for var, coef in terms:
        coefs[var] = coefs.get(var, 0) + coef
    lp.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(coefs, constant), sense), name)


def _under(
    lp: pulp.LpProblem,
    base: float,
    live: Iterable[tuple[int, pulp.LpVariable]],
    bound: float | pulp.LpVariable,
    name: str,
) -> None:
    """``base + sum(bytes * var) <= bound`` (a budget, or the peak variable)."""
    terms = [(v, b) for b, v in live if b != 0]  # pulp drops a product by zero
    if isinstance(bound, pulp.LpVariable):
        _row(lp, [*terms, (bound, -1)], base, LE, name)
    else:
        _row(lp, terms, base - bound, LE, name)


def _safe(name: str) -> str:
    return name.replace("#", "_")
