"""Regenerate the paper's tables from the CSVs the experiments wrote.

    python paper/build.py            # rewrite paper/paper.md's tables in place
    python paper/build.py --check    # exit 1 if any table differs from its CSV

Every table in ``paper.md`` sits between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``
and is produced by ``TABLES[NAME]`` from ``experiments/results``; nothing between the markers is
typed by hand (tests/test_paper.py checks they are in sync). ``./run paper`` reruns the
experiments and then this.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "experiments" / "results"
PAPER = Path(__file__).parent / "paper.md"
MIB = 2**20


COMPARE_ORDER = ("gpt", "gpt2_small", "gpt2_medium", "llama", "bert", "resnet", "unet")


def _read(name: str) -> list[dict[str, str]]:
    if name == "compare.csv":  # the full comparison: one CSV per model (one process each)
        paths = sorted(
            (RESULTS / "compare").glob("*.csv"),
            key=lambda p: (COMPARE_ORDER.index(p.stem) if p.stem in COMPARE_ORDER else 99, p.stem),
        )
        rows = []
        for path in paths:
            with path.open() as f:
                rows += list(csv.DictReader(f))
        return rows
    with (RESULTS / name).open() as f:
        return list(csv.DictReader(f))


def _num(x: str | None) -> float | None:
    return None if x in (None, "", "None") else float(x)


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _gflop(x: str | None) -> str:
    """GFLOP, or "-" where the harness could not attribute them (e.g. graph breaks)."""
    v = _num(x)
    return "-" if v is None else _fmt(v / 1e9, 3)


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _peak_key(rows: list[dict[str, str]], model: str) -> str:
    """The peak a model's comparison matched remat at: the allocator's, or, for runs before
    the allocator-level prediction (no ``predicted_tensor_peak_bytes``), the live meter's."""
    new = any(r.get("predicted_tensor_peak_bytes") for r in rows if r["model"] == model)
    return "allocator_peak_bytes" if new else "peak_bytes"


def compare_table() -> str:
    """Each peer at its measured peak beside remat planned for exactly that peak."""
    rows = _read("compare.csv")
    matched = {(r["model"], r["setting"]): r for r in rows if r["kind"] == "matched"}
    keys = {r["model"]: _peak_key(rows, r["model"]) for r in rows}
    out = []
    for r in rows:
        if r["kind"] != "peer" or r["method"] == "eager":
            continue
        m = matched.get((r["model"], f"{r['method']} {r['setting']}"))
        if m is None:
            continue
        ran = bool(m["peak_bytes"])
        key = keys[r["model"]]
        out.append(
            [
                r["model"],
                "allocator" if key == "allocator_peak_bytes" else "live tensors",
                f"{r['method']} {r['setting']}",
                _fmt(_num(r[key]) / MIB),  # type: ignore[operator]
                _gflop(r["recompute_flops"]),
                _fmt(_num(r["time_ratio"])),
                "yes" if r["equal"] == "True" else f"**no** ({r['differing']})",
                _fmt((_num(m[key]) or 0) / MIB) if ran else m["reason"],
                _gflop(m["recompute_flops"]) if ran else "-",
                _fmt(_num(m["time_ratio"])),
                ("yes" if m["equal"] == "True" else "**no**") if ran else "-",
            ]
        )
    header = ["model", "peaks of", "peer", "peer peak MiB", "peer recompute GFLOP", "peer time x",
              "peer bitwise", "remat peak MiB", "remat recompute GFLOP", "remat time x",
              "remat bitwise"]  # fmt: skip
    return _table(header, out)


def at_budget_table() -> str:
    """The other direction: at each budget of remat's sweep, the cheapest peer run whose
    measured peak fits (per family: PyTorch's partitioner, eager checkpointing)."""
    rows = _read("compare.csv")
    out = []
    for r in rows:
        if r["kind"] != "sweep" or not r["peak_bytes"]:
            continue
        budget = int(r["budget_bytes"])
        cells = [r["model"], _fmt(budget / MIB), _fmt(int(r["recompute_flops"]) / 1e9, 3)]
        for family in (("torch_budget",), ("torch_checkpoint", "hf_checkpointing")):
            fits = [
                p
                for p in rows
                if p["model"] == r["model"]
                and p["kind"] == "peer"
                and p["method"] in family
                and int(p[_peak_key(rows, r["model"])]) <= budget
            ]
            known = [p for p in fits if _num(p["recompute_flops"]) is not None]
            best = min(known, key=lambda p: float(p["recompute_flops"]), default=None)
            cells.append(
                ("does not fit" if not fits else "fits, FLOPs unknown")
                if best is None
                else f"{best['setting']}: {_gflop(best['recompute_flops'])}"
                + ("" if best["equal"] == "True" else " (not bitwise)")
            )
        out.append(cells)
    header = ["model", "budget MiB", "remat recompute GFLOP",
              "PyTorch partitioner: budget, GFLOP", "eager checkpointing: GFLOP"]  # fmt: skip
    return _table(header, out)


def predicted_table() -> str:
    """Every remat row of the comparison: predicted against measured peak, for live tensors
    and at the allocator (rows from runs before the allocator-level prediction have no
    ``predicted_tensor_peak_bytes``: their prediction was the tensor peak)."""
    rows = [r for r in _read("compare.csv") if r["method"] == "remat" and r["peak_bytes"]]
    by: dict[str, list[dict[str, str]]] = {}
    for r in rows:
        by.setdefault(r["model"], []).append(r)
    out = []
    for model, rs in by.items():
        new = all(r.get("predicted_tensor_peak_bytes") for r in rs)
        tensors = sum(
            r["peak_bytes"]
            == (r["predicted_tensor_peak_bytes"] if new else r["predicted_peak_bytes"])
            for r in rs
        )
        above = max(
            (_num(r["allocator_peak_bytes"]) or 0) / (_num(r["peak_bytes"]) or 1) - 1 for r in rs
        )
        if new:
            gaps = [
                (_num(r["allocator_peak_bytes"]) or 0) - (_num(r["predicted_peak_bytes"]) or 0)
                for r in rs
            ]
            exact = sum(g == 0 for g in gaps)
            worst = max(gaps, key=abs)
            allocator = f"{exact} exact, largest gap {worst:+,.0f} B"
        else:
            allocator = "not predicted (run before it)"
        equal = sum(r["equal"] == "True" for r in rs)
        out.append(
            [model, str(len(rs)), str(tensors), allocator, str(equal), f"{100 * above:+.1f}%"]
        )
    header = ["model", "remat plans run", "predicted == measured, tensors",
              "predicted == measured, allocator", "bitwise equal to eager",
              "largest allocator peak above the live peak"]  # fmt: skip
    return _table(header, out)


def chain_gap_table() -> str:
    out = []
    for stem in ("4layers", "8layers", "gpt2_small"):
        if not (RESULTS / f"chain_gap_{stem}.csv").exists():
            continue
        for r in _read(f"chain_gap_{stem}.csv"):
            out.append(
                [
                    r["model"],
                    f"{int(r['budget_bytes']):,}",
                    _fmt(_num(r["chain_us"])),
                    _fmt(_num(r["exact_us"])),
                    _fmt(_num(r["exact_bound_us"])),
                    "yes" if r["exact_proven"] == "True" else "no",
                    _fmt(_num(r["gap_pct"])),
                    _fmt(_num(r["chain_s"]), 1),
                    _fmt(_num(r["exact_s"]), 1),
                ]
            )
    header = ["model", "budget B", "chain us", "flat MILP us", "flat bound us", "proven",
              "gap %", "chain s", "flat s"]  # fmt: skip
    return _table(header, out)


def scale_table() -> str:
    out = [
        [
            r["config"],
            r["solver"],
            _fmt(_num(r["capture_s"]), 1),
            _fmt(_num(r["joint_s"]), 1),
            _fmt(_num(r["solve_s"]), 1),
            _fmt(_num(r["wall_s"]), 1),
            _fmt(_num(r["max_rss_gib"])),
            _fmt(_num(r["step_peak_gb"])),
            _fmt(_num(r["total_gb"])),
            _fmt(_num(r["recompute_pct"])),
            _fmt(_num(r.get("bound_pct"))),
            _fmt(_num(r["megatron_peak_gb"])),
        ]
        for r in _read("scale.csv")
    ]
    header = ["config", "solver", "capture s", "joint s", "solve s", "wall s", "max RSS GiB",
              "step peak GB", "device total GB", "recompute %", "proven floor %",
              "Megatron's peak GB"]  # fmt: skip
    return _table(header, out)


def megatron_table() -> str:
    out = [
        [
            f"({r['s']}, {r['h']}, {r['a']})",
            r["precision"],
            _fmt(_num(r["paper_keep_all_sbh"]), 1),
            _fmt(_num(r["keep_all_per_layer_sbh"]), 3),
            r["paper_selective_sbh"],
            _fmt(_num(r["megatron_per_layer_sbh"]), 3),
            _fmt(_num(r["block_per_layer_sbh"]), 1),
            _fmt(_num(r["sdpa_p0_per_layer_sbh"]), 3),
        ]
        for r in _read("megatron_check.csv")
    ]
    header = ["(s, h, a)", "precision", "paper keep-all", "remat keep-all", "paper selective",
              "remat megatron", "remat block", "remat SDPA (p=0)"]  # fmt: skip
    return _table(header, out)


def gpu_table() -> str:
    measured = json.loads((RESULTS / "gpu_h200_measured.json").read_text())
    rows = [r for r in _read("gpu_table.csv") if r["attn"] == "sdpa"]
    out = []
    for r in rows:
        if r["plan"] not in ("keep_all", "block", "chain@block_peak", "chain@80GB"):
            continue
        ck = 0 if r["plan"] == "keep_all" else 1
        h200 = measured.get(f"B {r['seq']} ck={ck}") if r["plan"] in ("keep_all", "block") else None
        h200_s = "OOM" if h200 == "OOM" else _fmt(h200["step_gb"]) if h200 else "-"
        out.append(
            [
                r["seq"],
                r["plan"],
                r["table_gb"] or "-",
                _fmt(_num(r["step_peak_gb"])),
                _fmt(_num(r["plus_params_gb"])),
                h200_s,
                _fmt(_num(r["recompute_pct"]), 1),
                _fmt(_num(r["recompute_flops_pct"]), 1),
            ]
        )
    header = ["seq", "plan", "table GB", "remat step GB", "remat step + params GB",
              "H200 eager step GB", "recompute % time", "recompute % FLOPs"]  # fmt: skip
    return _table(header, out)


def table2() -> str:
    """Checkmate's Table 2: geometric mean over budgets of each heuristic's cost / the exact
    MILP's, on the model where the MILP proves optimality (budgets where it did, cost > 0)."""
    rows = _read("solvers_gpt2_2x768_s1024_b8.csv")
    proven = {
        r["budget_bytes"]
        for r in rows
        if r["solver"] == "exact" and r["exact_proven_optimal"] == "True" and _num(r["recompute_s"])
    }
    ratios: dict[str, list[float]] = {}
    for r in rows:
        if r["budget_bytes"] in proven and r["solver"] != "exact":
            v = _num(r["vs_exact"])
            if v is not None:  # None: the solver's plan does not fit that budget
                ratios.setdefault(r["solver"], []).append(v)
    # Every ratio is positive: the optimum at these budgets recomputes something.
    out = [
        [s, str(len(v)), f"{math.exp(sum(map(math.log, v)) / len(v)):.2f}x"]
        for s, v in sorted(ratios.items(), key=lambda kv: kv[0])
    ]
    header = ["solver", f"budgets it fits (of {len(proven)} proven)", "geo-mean cost / optimum"]
    return _table(header, out)


NATIVE_ORDER = ("gpt2_small", "llama", "bert")


def native_table() -> str:
    """remat.apply's SAC plans against the hand-written policies and the partitioner, at each
    peer's measured peak (experiments/native.py, one CSV per model)."""
    out = []
    for model in NATIVE_ORDER:
        path = RESULTS / "native" / f"{model}.csv"
        if not path.exists():
            continue
        with path.open() as f:
            rows = {r["peer"]: r for r in csv.DictReader(f)}
        for peer, r in rows.items():
            if peer == "eager" or peer.startswith("remat @"):
                continue
            ours = rows.get(f"remat @ {peer}")
            level = "allocator" if r.get("allocator_bytes") else "live tensors"
            cells = [model, level, peer, *_native_cells(r, predicted=False)]
            if ours is None or not ours.get("peak_mib"):
                cells += ["no plan fits", "", "", ""]
            else:
                cells += _native_cells(ours, predicted=True)
            out.append(cells)
    header = ["model", "peaks of", "peer", "peak MiB", "GFLOP", "time x", "bitwise",
              "remat peak MiB (predicted)", "GFLOP", "time x", "bitwise"]  # fmt: skip
    return _table(header, out)


def _native_cells(r: dict[str, str], *, predicted: bool) -> list[str]:
    """Peaks at the allocator where the run recorded them as the matched level
    (``allocator_bytes``), else the live meter's (runs before the allocator prediction)."""
    peak = _fmt(_num(r["allocator_mib"] if r.get("allocator_bytes") else r["peak_mib"]))
    if predicted:
        peak += f" ({_fmt(_num(r['predicted_mib']))})"
    time_x = _num(r.get("time_x"))
    return [
        peak,
        _fmt(_num(r["recompute_gflop"]), 3),
        "-" if time_x is None else f"{time_x:.2f}x",
        "yes" if r["bitwise"] == "True" else "**no**",
    ]


def fit_table() -> str:
    """``remat fit`` on the practitioners' model at 80 GB: per plan, the longest sequence at
    batch 4 and the largest batch at 2048 and 8192 tokens."""
    rows = _read("fit_table.csv")
    by = {(r["seq"], r["plan"]): r for r in rows}
    out = []
    for plan in dict.fromkeys(r["plan"] for r in rows):
        short, long = by[("2048", plan)], by[("8192", plan)]
        peak = _num(short["peak_bytes_at_max"])
        out.append(
            [
                plan,
                short["max_seq"],
                _fmt(peak / 1e9 if peak and short["max_seq"] != "0" else None),
                _fmt(_num(short["recompute_pct"]), 1),
                "yes" if int(short["max_seq"]) >= 8192 else "no (OOM)",
                short["max_batch"],
                long["max_batch"],
            ]
        )
    header = ["plan", "max seq at batch 4", "device GB there", "recompute % there",
              "seq 8192 at batch 4 fits", "max batch at seq 2048", "max batch at seq 8192"]  # fmt: skip
    return _table(header, out)


def fit_layer_table() -> str:
    """One layer's saved bytes as remat derives them (keep-all, 16-bit model) against
    Korthikanti et al.'s s*b*h*(34 + 5*a*s/h)."""
    out = [
        [
            f"({r['h']}, {r['a']})",
            r["layer_saved_bytes"],
            f"34 h = {34 * int(r['h'])}",
            f"{r['bs_coefficient']} = {r['bs_in_h']}",
            f"5 a = {5 * int(r['a'])}",
            f"{r['bs2_coefficient']} = {r['bs2_in_a']} a",
            r["other_terms"],
        ]
        for r in _read("fit_layer.csv")
    ]
    header = ["(h, a)", "remat: one layer's saved bytes", "paper: b s term", "remat: b s term",
              "paper: b s^2 term", "remat: b s^2 term", "other terms"]  # fmt: skip
    return _table(header, out)


def lengths_table() -> str:
    """20 random lengths three ways: planning per length, one plan (max_seq), buckets."""
    out = [
        [
            r["strategy"],
            r["solves"],
            _fmt(_num(r["planning_s"]), 1),
            _fmt(_num(r["max_allocator_peak"]) / MIB),
            _fmt(_num(r["budget"]) / MIB),
            r["predicted_eq_measured"],
            r["bitwise_outputs"],
            _fmt(_num(r["recompute_ms"]), 1),
        ]
        for r in _read("lengths.csv")
    ]
    header = ["strategy", "solves", "planning s", "largest allocator peak MiB", "budget MiB",
              "predicted == measured", "bitwise", "recompute ms (sum)"]  # fmt: skip
    return _table(header, out)


def least_peaks_table() -> str:
    """Each executor's least peak on the zoo (experiments/least_peaks.py)."""
    out = [
        [
            r["model"],
            _fmt(_num(r["graph_least_bytes"]) / MIB),  # type: ignore[operator]
            _fmt(_num(r["native_blocks_least_bytes"]) / MIB),  # type: ignore[operator]
            _fmt(_num(r["native_least_bytes"]) / MIB),  # type: ignore[operator]
            f"{float(r['ratio']):.3f}x",
            r["native_plan"],
        ]
        for r in _read("least_peaks.csv")
    ]
    header = ["model", "whole-graph least MiB", "native, blocks MiB",
              "native, all regions MiB", "native / whole-graph", "native plan"]  # fmt: skip
    return _table(header, out)


def regions_table() -> str:
    """auto on blocks only against blocks or their sub-modules (experiments/regions.py)."""
    out = [
        [
            r["model"],
            r["share"],
            _fmt(_num(r["budget_bytes"]) / MIB),  # type: ignore[operator]
            _fmt(_num(r["blocks_ms"]), 3),
            _fmt(_num(r["with_sub_modules_ms"]), 3),
        ]
        for r in _read("regions.csv")
    ]
    header = ["model", "budget share", "budget MiB", "recompute ms, blocks",
              "recompute ms, with sub-modules"]  # fmt: skip
    return _table(header, out)


def parallel_table() -> str:
    """Per-rank plans of a pipeline against one plan for all (experiments/parallel.py)."""

    def sizes(field: str) -> str:
        values = [int(b) for b in field.split()]
        if len(set(values)) == 1 and len(values) > 1:
            values = values[:1]  # one budget for every rank
        gb = max(values) >= 2**30
        return " / ".join(_fmt(v / 1e9, 1) if gb else _fmt(v / MIB) for v in values) + (
            " GB" if gb else " MiB"
        )

    out = [
        [
            r["case"],
            r["microbatches"],
            sizes(r["budget_bytes"]),
            r["method"],
            "yes" if r["fits"] == "True" else "no",
            sizes(r["stage_peaks"]),
            r["stage_recompute_ms"].replace(" ", " / "),
            _fmt(_num(r["step_ms"]), 1),
            f"{float(r['bubble_share']):.1%}",
        ]
        for r in _read("parallel.csv")
    ]
    header = ["pipeline", "microbatches", "budget per rank", "plan", "fits", "rank peaks",
              "recompute ms per rank", "simulated step ms", "bubble"]  # fmt: skip
    return _table(header, out)


def titan_table() -> str:
    """torchtitan's Llama 3 and AC modes against remat.apply with the trainer's loss, at each
    mode's measured allocator peak (experiments/torchtitan_duel.py)."""
    if not (RESULTS / "torchtitan_duel.csv").exists():
        return "(no run yet: experiments/torchtitan_duel.py)"
    rows = {r["peer"]: r for r in _read("torchtitan_duel.csv")}

    def cells(r: dict[str, str] | None) -> list[str]:
        if r is None or not r.get("allocator_bytes"):
            return ["no plan fits", "", "", "", ""]
        predicted = _num(r.get("predicted_bytes"))
        time_x = _num(r.get("time_x"))
        return [
            _fmt(_num(r["allocator_bytes"]) / MIB),  # type: ignore[operator]
            "" if predicted is None else _fmt(predicted / MIB),
            _fmt(_num(r["recompute_gflop"]), 3),
            "-" if time_x is None else f"{time_x:.3f}x",
            "yes" if r["bitwise"] == "True" else "**no**",
        ]

    out = []
    for mode in ("none", "full", "op-sac"):
        peer = rows.get(f"torchtitan {mode}")
        if peer is not None:
            out.append(
                [mode, *cells(peer)[:1], *cells(peer)[2:], *cells(rows.get(f"remat @ {mode}"))]
            )
    header = ["torchtitan AC", "peak MiB", "GFLOP", "time x", "bitwise",
              "remat peak MiB", "predicted", "GFLOP", "time x", "bitwise"]  # fmt: skip
    return _table(header, out)


def offload_table() -> str:
    """remat.apply's plans without and with a host budget at scale (experiments/offload.py)."""
    out = [
        [
            _fmt(_num(r["budget_gb"]), 0),
            _fmt(_num(r["host_gb"]), 0),
            r["error"][:60] or _fmt(_num(r["step_ms"]), 1),
            _fmt(_num(r["recompute_ms"]), 1),
            _fmt(_num(r["copy_exposed_ms"]), 2),
            _fmt(_num(r["offloaded_gb"]), 2),
            _fmt(_num(r["host_peak_gb"]), 2),
            _fmt(_num(r["step_peak_gb"])),
            r["wall_s"],
        ]
        for r in _read("offload.csv")
    ]
    header = ["budget GB", "host GB", "step ms", "recompute ms", "copies exposed ms",
              "offloaded GB", "host peak GB", "step peak GB", "planning s"]  # fmt: skip
    return _table(header, out)


TABLES: dict[str, Callable[[], str]] = {
    "compare": compare_table,
    "predicted": predicted_table,
    "at_budget": at_budget_table,
    "chain_gap": chain_gap_table,
    "scale": scale_table,
    "megatron": megatron_table,
    "gpu_table": gpu_table,
    "table2": table2,
    "native": native_table,
    "fit": fit_table,
    "fit_layer": fit_layer_table,
    "lengths": lengths_table,
    "least_peaks": least_peaks_table,
    "regions": regions_table,
    "parallel": parallel_table,
    "titan": titan_table,
    "offload": offload_table,
}
MARK = re.compile(r"(<!-- table:(\w+) -->\n)(.*?)(<!-- /table:\2 -->)", re.S)


def build(text: str) -> str:
    """``text`` with every marked table regenerated."""

    def fill(m: re.Match[str]) -> str:
        name = m.group(2)
        if name not in TABLES:
            raise ValueError(f"paper.md names an unknown table {name!r}; known: {sorted(TABLES)}")
        return f"{m.group(1)}{TABLES[name]()}\n{m.group(4)}"

    return MARK.sub(fill, text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="fail if a table is out of date")
    a = ap.parse_args()
    text = PAPER.read_text()
    new = build(text)
    if a.check:
        if new != text:
            print("paper/paper.md is out of date: run python paper/build.py", file=sys.stderr)
            return 1
        return 0
    PAPER.write_text(new)
    print(f"wrote {PAPER}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
