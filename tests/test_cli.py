"""The README's main job, on a tiny configuration."""

from __future__ import annotations

import json
import re

import pytest

from remat.cli import main


def test_demo_runs_and_reports_equal(
    tmp_path: object, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a 100-column terminal: no column cut, and nothing but remat's lines (no profiler
    or allocator chatter on stderr)."""
    from pathlib import Path

    monkeypatch.setenv("COLUMNS", "100")
    out_dir = Path(str(tmp_path)) / "demo"
    code = main(["demo", "--layers", "2", "--dim", "32", "--heads", "2", "--vocab", "64",
                 "--seq", "16", "--batch", "2", "--steps", "1", "--time-limit", "2",
                 "--budgets", "3", "--out", str(out_dir)])  # fmt: skip
    out, err = capfd.readouterr()
    assert code == 0
    assert err == "", err
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 100
    for plan in ("keep_all", "keep_inputs", "keep_matmuls", "block", "megatron", "auto @"):
        assert plan in out
    assert "DIFFER" not in out and out.count("equal") >= 7
    assert "lp_round" in out and "by solver and budget" in out  # the sweep
    for png in ("pareto.png", "timeline.png"):
        _assert_real_png(out_dir / png)


def _assert_real_png(path: object) -> None:
    """A PNG of a plotted figure: decodable, of a figure's size, with drawn content."""
    import matplotlib.image
    import numpy as np

    pixels = np.asarray(matplotlib.image.imread(str(path)))
    assert pixels.shape[0] >= 300 and pixels.shape[1] >= 500, pixels.shape
    # Not blank: several distinct colours (axes, text, curves) on the white background.
    colours = np.unique(pixels.reshape(-1, pixels.shape[-1]).round(2), axis=0)
    assert len(colours) > 20 and (pixels[..., :3] < 0.5).mean() > 0.002


SMALL = ["--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=2", "--seq", "64"]
BUDGET_GB = "0.1115"  # recompute needed; offload fits it (a100)


def test_plan_lists_presets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("gpt2", "gpt2-medium", "bert-base", "llama-7b", "llama-13b", "llama-70b"):
        assert name in out


def test_plan_prints_the_report_and_saves(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "plan.json"
    code = main(["plan", "gpt2", *SMALL, "--budget-gb", "0.12", "--device", "a100",
                 "--time-limit", "5", "--save", str(path)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "memory per device" in out and "transformer.h.*.attn" in out and "fits" in out
    assert "max RSS" in out and path.exists()


def test_plan_json_with_a_host_budget_offloads_and_steps_faster(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--json`` prints the plan document alone on stdout (the report on stderr);
    ``--host-budget-gb`` offloads where the a100's link hides the copies."""
    args = ["plan", "gpt2", *SMALL, "--budget-gb", BUDGET_GB, "--device", "a100",
            "--executor", "graph", "--solver", "lp_round", "--time-limit", "2", "--json"]  # fmt: skip
    docs = []
    for extra in ([], ["--host-budget-gb", "1"]):
        assert main([*args, *extra]) == 0
        out = capsys.readouterr().out
        docs.append(json.loads(out))
    plain, offload = docs
    assert plain["format"] == "remat-plan" and plain["offloaded"] == []
    assert plain["offloaded_bytes"] == plain["predicted_host_peak_bytes"] == 0
    assert offload["offloaded_bytes"] > 0 and offload["predicted_host_peak_bytes"] > 0
    assert offload["step_time_s"] < plain["step_time_s"]
    assert offload["device_memory"]["total"] <= offload["device_memory"]["budget"]
    assert main([*args, "--pp-size", "2"]) == 2


def test_an_optimizer_by_module_path_has_its_state_measured(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--optimizer module:attr`` loads a torch.optim.Optimizer class; the plan's device
    memory counts the state it makes (Adafactor's factored moments: less than AdamW's)."""
    args = ["plan", "gpt2", *SMALL, "--budget-gb", "1", "--executor", "graph",
            "--solver", "chen_greedy", "--json"]  # fmt: skip
    state = {}
    for name in ("adamw", "torch.optim:Adafactor"):
        assert main([*args, "--optimizer", name]) == 0
        state[name] = json.loads(capsys.readouterr().out)["device_memory"]["optimizer_state"]
    assert 0 < state["torch.optim:Adafactor"] < state["adamw"] // 2
    for bad in ("lion", "torch.optim:Lion", "math:pi"):
        with pytest.raises(SystemExit):
            main([*args, "--optimizer", bad])
        assert "--optimizer" in capsys.readouterr().err


def test_plan_sac_executor_writes_a_file_apply_takes(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--executor sac`` (and ``auto`` over several ranks) plans remat.apply's executor; its
    plan file is re-applied by ``remat.apply`` and refused by ``remat.optimize``."""
    from pathlib import Path

    import remat
    from remat.presets import build, parse_settings

    path = Path(str(tmp_path)) / "native.json"
    sharded = ["--zero-stage", "3", "--world-size", "2", "--device", "a100"]
    code = main(["plan", "gpt2", *SMALL, *sharded, "--budget-gb", "0.12", "--time-limit", "5",
                 "--save", str(path)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "executor: PyTorch's selective checkpointing" in out and "plan by region" in out
    assert "transformer.h.1" in out and path.exists()
    written = remat.plan.files.read_plan(path)
    assert written.record["graph"]["executor"] == remat.plan.files.NATIVE

    settings = parse_settings(SMALL[1:6:2])
    built = build("gpt2", seq=64, batch=1, settings=settings)
    model = remat.apply(built.model, built.args, example_kwargs=built.kwargs, plan=str(path),
                        zero_stage=3, world_size=2, device_profile="a100")  # fmt: skip
    assert remat.plan_of(model).saved == written.saved
    again = build("gpt2", seq=64, batch=1, settings=settings)
    with pytest.raises(remat.PlanFileError, match=r"load it with remat.apply"):
        remat.optimize(again.model, again.args, example_kwargs=again.kwargs, plan=str(path))

    assert main(["plan", "gpt2", *SMALL, *sharded, "--executor", "graph", "--budget-gb", "0.12",
                 "--time-limit", "5"]) == 0  # fmt: skip
    assert "executor: remat's whole-graph executor" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "gpt2", "--executor", "checkmate"])
    assert "unknown executor 'checkmate'; valid: auto, graph, sac" in capsys.readouterr().err


def test_plan_below_static_memory_explains(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "gpt2", *SMALL, "--budget-gb", "0.001"]) == 1
    out = capsys.readouterr().out
    assert "does not hold the static memory" in out and "ZeRO stage 3" in out


def test_plan_bad_model_and_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "gpt5"]) == 2
    assert "unknown model 'gpt5'" in capsys.readouterr().out
    assert main(["plan", "hf:gpt2", "--set", "oops"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().out


@pytest.mark.slow
def test_plan_llama_7b_zero3_on_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's command: 6.7B under FakeTensorMode, bf16-mixed, ZeRO-3 over 8 devices."""
    args = ["plan", "llama-7b", "--seq", "4096", "--precision", "bf16-mixed",
            "--zero-stage", "3", "--world-size", "8", "--executor", "graph",
            "--time-limit", "1"]  # fmt: skip  # a plan that fits, not the optimum
    assert main([*args, "--budget-gb", "24"]) == 0
    out = capsys.readouterr().out
    recomputed = int(out.split(" recomputed (")[0].rsplit(",", 1)[-1].split()[-1])
    assert recomputed > 0 and "fits: budget 24.00 GB" in out
    assert main([*args, "--budget-gb", "1"]) == 1
    assert "does not hold the static memory" in capsys.readouterr().out


def test_compare_sweeps_every_solver_to_csv(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    import csv
    from pathlib import Path

    from remat.solver.plan import Proof
    from remat.solver.registry import SOLVERS

    out_csv = Path(str(tmp_path)) / "cmp.csv"
    out_png = Path(str(tmp_path)) / "cmp.png"
    code = main(["compare", "gpt2", *SMALL, "--sweep", "2", "--device", "a100",
                 "--time-limit", "5", "--csv", str(out_csv), "--plot", str(out_png)])  # fmt: skip
    assert code == 0, capsys.readouterr().out
    rows = list(csv.DictReader(out_csv.open()))
    assert {r["solver"] for r in rows} == {*SOLVERS, "auto"}
    assert len({r["budget_bytes"] for r in rows}) == 2
    for r in rows:
        if not r["error"]:
            assert int(r["total_bytes"]) <= int(r["budget_bytes"])
            assert r["proof"] in {p.value for p in Proof}
            assert r["added_pct"] == r["recompute_pct"]  # no dispatch, no copies, here
    # Never beaten: every other solver's plan is a start of the exact MILP (and of auto).
    for budget in {r["budget_bytes"] for r in rows}:
        fits = {r["solver"]: float(r["recompute_pct"]) for r in rows
                if r["budget_bytes"] == budget and not r["error"]}  # fmt: skip
        for best in ("exact", "auto"):
            assert fits[best] <= min(fits.values()) * (1 + 1e-9), (budget, fits)
    out = capsys.readouterr().out
    assert "n_layer=2" in out and "proof" in out
    _assert_real_png(out_png)


def test_plan_any_transformers_architecture(capsys: pytest.CaptureFixture[str]) -> None:
    """hf:MODEL_TYPE with --set overrides: an architecture no preset covers (GQA, SiLU MLP)."""
    code = main(["plan", "hf:mistral", "--set", "num_hidden_layers=2", "--set", "hidden_size=64",
                 "--set", "intermediate_size=128", "--set", "num_attention_heads=4",
                 "--set", "num_key_value_heads=2", "--set", "vocab_size=128", "--seq", "64",
                 "--batch", "2", "--budget-gb", "0.01", "--device", "a100", "--time-limit", "5"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "mistral (transformers config)" in out and "model.layers.*.self_attn" in out


def test_floor_time_reaches_the_solvers() -> None:
    """``--floor-time`` (plan, compare) becomes the chain solver's ``floor_time_s``."""
    import argparse

    from remat.cli.common import request_of

    args = argparse.Namespace(budget_gb=1.0, optimizer="adamw", precision="fp32", zero_stage=0,
                              world_size=1, reserve=0.05, solver=None, device="h100",
                              time_limit=5.0, floor_time=7.0)  # fmt: skip
    assert request_of(args, print).solver_config().floor_time_s == 7.0
    with pytest.raises(SystemExit):
        main(["fit", "gpt2", "--floor-time", "7"])  # fit plans no floor: not an option there


def test_a_factory_with_its_loss_is_planned_on_either_executor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A factory returning ``(model, inputs, loss_fn, target)``: ``auto`` picks the user's
    blocks (as torchtitan's trainer runs them), ``graph`` plans the loss too, and both
    reports say the step covers it."""
    code = main(["plan", "tests.zoo:titan_factory", "--budget-gb", "0.01", "--time-limit", "5"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "executor: PyTorch's selective checkpointing" in out
    assert "with its loss (loss_fn)" in out
    code = main(["plan", "tests.zoo:titan_factory", "--executor", "graph", "--budget-gb", "0.01"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "executor: remat's" in out and "with its loss (loss_fn)" in out


def test_plan_json_of_the_sac_executor_with_a_host_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``remat plan --executor sac --host-budget-gb --json`` on a small Llama 3 on an H100's
    profile: the plan offloads block inputs, because that adds less time than the best plan
    without offload (which the reason states, solved in the same run)."""
    small = ["--set", "num_hidden_layers=4", "--set", "hidden_size=256", "--set",
             "intermediate_size=512", "--set", "num_attention_heads=4", "--set",
             "num_key_value_heads=2", "--set", "vocab_size=1000"]  # fmt: skip
    args = ["plan", "llama3-8b", *small, "--executor", "sac", "--seq", "1024", "--batch", "2",
            "--device", "h100", "--budget-gb", "0.12", "--host-budget-gb", "1", "--json"]  # fmt: skip
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["offloaded_bytes"] > 0 and doc["offloaded"]
    assert 0 < doc["predicted_host_peak_bytes"] <= 10**9
    found = re.search(r"([\d.]+) ms added against ([\d.]+) ms without offload", doc["reason"])
    assert found is not None, doc["reason"]
    assert float(found[1]) < float(found[2])
    assert doc["step_time_s"] > 0 and doc["copy_exposed_s"] >= 0
