"""The recipe's trackers for real: the session pipeline's sft and train-rm report to TensorBoard
and trackio through transformers' `report_to` (PPO through accelerate: test_ppo's contract
test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tracker_stores import tensorboard_scalars, trackio_logs

from rlhf_cli.tracking import read_metrics

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("stage", ["sft", "rm"])
def test_trl_stages_write_tensorboard_events_and_trackio_logs(pipeline: Path, stage: str):
    (run,) = [p for p in (pipeline / "runs").iterdir() if p.is_dir()]
    logged = read_metrics(run / stage / "metrics.jsonl")
    losses = {row["step"]: row["loss"] for row in logged if "loss" in row}
    assert len(losses) >= 2

    scalars = tensorboard_scalars(run / stage / "tensorboard")
    assert scalars["train/loss"] == pytest.approx(losses, rel=1e-6)
    # the held-out result of the manifest, at the last step: the SFT's from Trainer.evaluate,
    # the RM's pairwise accuracy (scored by the stage) logged through the Trainer
    metrics = json.loads((run / stage / "manifest.json").read_text())["metrics"]
    key = {"sft": "eval_loss", "rm": "eval_accuracy"}[stage]
    final, tag = metrics["steps"], key.replace("eval_", "eval/")
    assert scalars[tag][final] == pytest.approx(metrics[key], rel=1e-6)
    assert {r["step"]: r[key] for r in logged if key in r}[final] == pytest.approx(metrics[key])

    import trackio

    assert trackio.context_vars.current_run.get() is None  # reopened by evaluate(), finished
    tracked = trackio_logs(f"{run.name}-{stage}")
    assert {
        row["train/global_step"]: row["train/loss"] for row in tracked if "train/loss" in row
    } == (pytest.approx(losses, rel=1e-6))
    trackio_held_out = {row["train/global_step"]: row[tag] for row in tracked if tag in row}
    assert trackio_held_out[final] == pytest.approx(metrics[key], rel=1e-6)
