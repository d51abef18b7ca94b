"""The experiment harness's quick mode: every peer and every remat row runs; remat's rows train
bitwise like eager, measured == predicted at the allocator and for live tensors, and within the
budget at the allocator (matched rows: the peer's measured allocator peak)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from types import ModuleType

from tests.checks import assert_peak_close

EXPERIMENTS = Path(__file__).parents[2] / "experiments"


def _compare() -> ModuleType:
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        import compare
    finally:
        sys.path.remove(str(EXPERIMENTS))
    return compare


def _quick_rows(tmp_path: Path) -> list[dict[str, str]]:
    compare = _compare()
    out = tmp_path / "quick.csv"
    compare.main(["--quick", "--out", str(out)])
    for model in compare.QUICK:
        assert out.with_name(f"quick_{model}.png").stat().st_size > 5_000
    with out.open() as f:
        return list(csv.DictReader(f))


def test_quick_run_rows(tmp_path: Path) -> None:
    """One quick run (about a minute) and every check on its rows, in one test so that the
    xdist workers do not each run it."""
    rows = _quick_rows(tmp_path)
    _every_model_has_every_peer_and_remat_rows(rows)
    _remat_rows_are_bitwise_and_predicted_equals_measured(rows)
    _eager_checkpointing_is_bitwise_and_saves_memory(rows)


def _every_model_has_every_peer_and_remat_rows(rows: list[dict[str, str]]) -> None:
    by_model: dict[str, set[str]] = {}
    for r in rows:
        by_model.setdefault(r["model"], set()).add(f"{r['kind']}:{r['method']}")
    assert set(by_model) == {"gpt", "gpt2", "llama", "bert", "resnet", "unet"}
    for model, kinds in by_model.items():
        expected = {"peer:eager", "peer:torch_budget", "peer:torch_checkpoint", "matched:remat",
                    "sweep:remat"}  # fmt: skip
        if model in ("gpt2", "llama", "bert"):
            expected.add("peer:hf_checkpointing")
        assert kinds == expected, model


def _remat_rows_are_bitwise_and_predicted_equals_measured(rows: list[dict[str, str]]) -> None:
    remat_rows = [r for r in rows if r["method"] == "remat" and r["peak_bytes"]]
    assert len(remat_rows) >= 6 * 5
    for r in remat_rows:
        assert r["equal"] == "True", r
        assert r["peak_bytes"] == r["predicted_tensor_peak_bytes"], r
        alloc, predicted = int(r["allocator_peak_bytes"]), int(r["predicted_peak_bytes"])
        assert_peak_close(predicted, alloc, f"{r['model']} {r['setting']}, allocator")
        assert alloc <= int(r["budget_bytes"]), r
    matched = [r for r in rows if r["kind"] == "matched"]
    peers = {(r["model"], f"{r['method']} {r['setting']}"): r for r in rows if r["kind"] == "peer"}
    for r in matched:
        assert r["budget_bytes"] == peers[r["model"], r["setting"]]["allocator_peak_bytes"], r


def _eager_checkpointing_is_bitwise_and_saves_memory(rows: list[dict[str, str]]) -> None:
    """The peers are measured, not assumed: eager checkpointing of every block or layer
    (RNG state preserved) gives eager's gradients and a lower peak."""
    eager = {r["model"]: int(r["peak_bytes"]) for r in rows if r["method"] == "eager"}
    every = {("torch_checkpoint", "every block"), ("hf_checkpointing", "every layer")}
    checked = [r for r in rows if (r["method"], r["setting"]) in every]
    assert len(checked) == 6 + 3  # every model, and the three HF models once more
    for r in checked:
        assert r["equal"] == "True", r
        assert int(r["peak_bytes"]) < eager[r["model"]], r


def test_timing_gives_every_measured_row_a_ratio(tmp_path: Path) -> None:
    """The timing pass builds each row's module for its turn (none is kept between rows): every
    row that ran gets a step-time ratio to eager. Ratios are not asserted (wall clock)."""
    compare = _compare()

    rows = compare.main(
        ["--quick", "--models", "gpt", "--reps", "1", "--out", str(tmp_path / "t.csv")]
    )
    measured = [r for r in rows if r.get("peak_bytes")]
    assert len(measured) >= 8
    assert all(isinstance(r.get("time_ratio"), float) and r["time_ratio"] > 0 for r in measured)
