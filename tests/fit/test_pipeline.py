"""``remat fit --pp-size``: every rank of a pipeline within its budget, at shapes searched on
formulas fitted to whole schedule steps, and checked here against fresh traces."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import remat
import remat.cli.fit as cli_fit
from remat.cli import main
from remat.cli.common import next_token_loss
from remat.fit.graph_shapes import Dims, inputs_at
from remat.fit.pipeline import PipelineFitReport, fit_pipeline
from remat.parallel.split import causal_lm_stages, stage_example
from remat.presets import build, parse_settings

SETTINGS = ["num_hidden_layers=2", "hidden_size=64", "intermediate_size=128",
            "num_attention_heads=4", "num_key_value_heads=2", "vocab_size=128",
            "max_position_embeddings=256"]  # fmt: skip
FIT = ["fit", "hf:llama", *(x for kv in SETTINGS for x in ("--set", kv)), "--seq", "64",
       "--batch", "4", "--device", "cpu", "--executor", "sac", "--pp-size", "2",
       "--microbatches", "2", "--budget-gb", "0.0025"]  # fmt: skip


def _stage_peaks(plan: str, b: int, s: int) -> list[int]:
    """Each rank's predicted peak over a 1F1B step (2 microbatches) under ``plan`` at
    microbatch ``b`` and length ``s``, planned afresh by ``remat.apply`` on a stage of the
    same model: a trace of its own, at a shape the fit may not have traced."""
    built = build("hf:llama", seq=64, batch=4, settings=parse_settings(SETTINGS))
    stages = causal_lm_stages(built.model, 2)
    (tokens,), _ = inputs_at((built.args[0][:2],), {}, Dims(2, 64), b, s)
    peaks = []
    for r, stage in enumerate(stages):
        pipe = remat.Pipeline("1F1B", r, 2, 2, loss_fn=next_token_loss)
        remat.apply(
            stage,
            stage_example(stage, tokens, torch.float32),
            pipeline=pipe,
            target=tokens if pipe.last else None,
            plan=plan,
            device_profile="cpu",
            block_types=("layers.*",),
        )
        peaks.append(remat.plan_of(stage).predicted_peak_bytes)
        remat.unapply(stage)
    return peaks


def test_fit_answers_for_every_rank_of_a_pipeline(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The longest sequence each fixed plan fits on both ranks of a 1F1B pipeline: at it,
    every rank's step (2 microbatches in flight on rank 0) is within its budget, and one
    token more puts the rank the report names over, by ``remat.apply``'s own traces; the
    report's device bytes are static + those traces' peaks. The table says the same (from
    the same report: a fit takes ~15 s here)."""
    reports: list[PipelineFitReport] = []

    def recorded(*args: Any, **kwargs: Any) -> PipelineFitReport:
        reports.append(fit_pipeline(*args, **kwargs))
        return reports[-1]

    monkeypatch.setattr(cli_fit, "fit_pipeline", recorded)
    assert main([*FIT, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["schedule"] == "1F1B" and got["microbatch"] == 2 and got["microbatches"] == 2
    step_budget, static = got["step_budget_bytes"], got["static_bytes"]
    for plan, name in (("keep_all", "no checkpointing"), ("block", "every block")):
        row = got["plans"][name]
        s, bound = row["max_seq"], row["seq_bound_by"]
        assert s is not None and bound is not None and 8 < s < 256, row
        at = _stage_peaks(plan, 2, s)
        assert all(p <= b for p, b in zip(at, step_budget, strict=True)), (name, at)
        assert row["peak_bytes_at_max_seq"] == [a + p for a, p in zip(static, at, strict=True)]
        assert _stage_peaks(plan, 2, s + 1)[bound] > step_budget[bound], name
    rows = got["plans"]
    # Each plan is bound by another rank: rank 0 holds 2 microbatches, rank 1 the head.
    assert [rows[n]["seq_bound_by"] for n in ("no checkpointing", "every block")] == [0, 1]
    assert rows["every block"]["max_seq"] > rows["no checkpointing"]["max_seq"]
    assert rows["least peak"]["max_seq"] >= rows["every block"]["max_seq"]
    assert rows["every block"]["max_batch"] == 2 * rows["every block"]["max_microbatch"]
    monkeypatch.setattr(cli_fit, "fit_pipeline", lambda *a, **k: reports[0])
    assert main(FIT) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "2 stages on 2 ranks (layers per stage: 1, 1), 1F1B, 2 microbatches" in out, out
    assert f"every block {rows['every block']['max_seq']} rank" in out, out
    assert main([*FIT, "--plot", "x.png"]) == 2
    assert "not with --pp-size" in capsys.readouterr().err
    alone = [a for a in FIT if a not in ("--pp-size", "2", "--microbatches")]
    assert main([*alone, "--menus"]) == 2
    assert "--menus is for --pp-size" in capsys.readouterr().err
