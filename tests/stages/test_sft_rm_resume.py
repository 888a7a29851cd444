"""sft and train-rm never lose work: Ctrl-C (or SIGTERM) finishes the step, writes a Trainer
checkpoint and stops with the manifest 'interrupted'; `--resume` continues from it and ends
where the uninterrupted run ends (the same log, up to the row a stop between logging steps adds;
the same weights and train_loss); a completed stage drops its checkpoints."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from rlhf_cli.errors import StageError
from rlhf_cli.recipe import load_recipe
from rlhf_cli.rundir import RunDir
from rlhf_cli.stages import trainers
from rlhf_cli.stages.trainers import RECIPE_CHANGED
from rlhf_cli.tracking import read_metrics

pytestmark = pytest.mark.slow
QUIET = Console(stderr=True, quiet=True)
SMALL = {
    "data": {"sft": {"max_samples": 96}, "preferences": {"max_samples": 96}},
    "sft": {"epochs": 2, "logging_steps": 2, "save_steps": 3},
    "reward": {"epochs": 1, "logging_steps": 1, "save_steps": 2},
}
# stage folder -> (run function, signal, the step it comes at, the checkpoints then on disk).
# The SFT's signal comes between two logging steps (2 and 4 of every 2, 3 of every checkpoint),
# the RM's at one.
STAGES = {
    "sft": ("run_sft", signal.SIGINT, 5, ["checkpoint-3", "checkpoint-5"]),
    "rm": ("run_train_rm", signal.SIGTERM, 3, ["checkpoint-2", "checkpoint-3"]),
}


def _runner(stage: str) -> Callable[..., dict[str, Any]]:
    from rlhf_cli.stages import reward, sft

    return getattr(sft if stage == "sft" else reward, STAGES[stage][0])


def _signal_at(monkeypatch: pytest.MonkeyPatch, step: int, signum: int) -> None:
    """The process gets `signum` as step `step` ends, as from a terminal or a scheduler."""
    real = trainers.StageCallback.on_step_end

    def on_step_end(self: Any, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == step:
            os.kill(os.getpid(), signum)
        real(self, args, state, control, **kw)

    monkeypatch.setattr(trainers.StageCallback, "on_step_end", on_step_end)


def _without(row: dict[str, float], key: str) -> dict[str, float]:
    return {k: v for k, v in row.items() if k != key}


def _rows(path: Path) -> list[dict[str, float]]:
    """The log without its clock readings (times and throughputs) and TRL's running token
    count (`num_tokens`, which TRL's checkpoints do not keep)."""
    clock = ("time", "runtime", "per_second", "preparation_time", "num_tokens")
    return [
        {k: v for k, v in row.items() if not any(c in k for c in clock)}
        for row in read_metrics(path)
    ]


Rows = list[dict[str, float]]


# numbers of one step, not means over the steps since the row before
INSTANT = ("step", "grad_norm", "learning_rate", "epoch")


def _glue_the_stop_row(got: Rows, want: Rows, step: int) -> None:
    """A stop between logging steps logs the window it ends (the mean loss, and TRL's entropy
    and token accuracy), and the resumed Trainer's next row starts from there: the two rows,
    weighted by their steps, are the uninterrupted run's one row. Checked, then the pair is
    made comparable (the stop's row dropped, the row after it given the uninterrupted means)."""
    logged = [r["step"] for r in want if "loss" in r]
    extra = [r for r in got if "loss" in r and r["step"] not in logged]
    if step in logged:
        assert extra == []
        return
    assert [r["step"] for r in extra] == [step]
    got.remove(extra[0])
    before, after = max(s for s in logged if s < step), min(s for s in logged if s > step)
    resumed = next(r for r in got if "loss" in r and r["step"] == after)
    whole = next(r for r in want if "loss" in r and r["step"] == after)
    means = [k for k in extra[0] if k not in INSTANT]
    assert "loss" in means
    for key in means:
        glued = extra[0][key] * (step - before) + resumed[key] * (after - step)
        assert glued == pytest.approx(whole[key] * (after - before), rel=1e-5), key
        resumed[key] = whole[key]


@pytest.mark.parametrize("stage", ["sft", "rm"])
def test_interrupt_checkpoints_and_resume_reproduces(
    small_recipe, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    run_stage, (_, signum, step, checkpoints) = _runner(stage), STAGES[stage]
    whole = load_recipe(small_recipe(tmp_path / "whole", SMALL))
    expected = run_stage(whole, QUIET)
    whole_dir = RunDir.for_recipe(whole).stage_dir(stage)
    assert not (whole_dir / "checkpoints").exists()  # completed: only the result stays

    recipe = load_recipe(small_recipe(tmp_path / "cut", SMALL))
    stage_dir = RunDir.for_recipe(recipe).stage_dir(stage)
    with monkeypatch.context() as patch:
        _signal_at(patch, step, signum)
        saved = rf"^checkpoint-{step} \(step {step}\) saved; `rlhf .* --resume` continues$"
        with pytest.raises(KeyboardInterrupt, match=saved):
            run_stage(recipe, QUIET)
    manifest = json.loads((stage_dir / "manifest.json").read_text())
    assert manifest["status"] == "interrupted"
    on_disk = sorted(p.name for p in (stage_dir / "checkpoints").glob("checkpoint-*"))
    assert on_disk == checkpoints

    resumed = run_stage(recipe, QUIET, resume=True)
    assert resumed["status"] == "completed"
    assert resumed["metrics"]["steps"] == expected["metrics"]["steps"]
    got_rows, want_rows = _rows(stage_dir / "metrics.jsonl"), _rows(whole_dir / "metrics.jsonl")
    _glue_the_stop_row(got_rows, want_rows, step)
    assert [sorted(r) for r in got_rows] == [sorted(r) for r in want_rows]
    for got, want in zip(got_rows, want_rows, strict=True):
        if "train_loss" in want:  # the Trainer's own mean over the steps this attempt trained
            got, want = _without(got, "train_loss"), _without(want, "train_loss")
        assert got == pytest.approx(want, rel=1e-5), (got, want)
    assert resumed["resumed_from"] == {"checkpoint": f"checkpoint-{step}", "step": step}
    for key in ("eval_loss", "eval_loss_start", "eval_accuracy", "eval_margin", "train_loss"):
        if key in expected["metrics"]:
            assert resumed["metrics"][key] == pytest.approx(expected["metrics"][key], rel=1e-5)
    weights = "model/model.safetensors"  # the tiny SFT is a full fine-tune, the RM a full model
    got, want = load_file(stage_dir / weights), load_file(whole_dir / weights)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
    assert not (stage_dir / "checkpoints").exists()


def test_resume_skips_a_damaged_checkpoint_and_refuses_without_one(
    small_recipe, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlhf_cli.stages.reward import run_train_rm

    recipe = load_recipe(small_recipe(tmp_path, SMALL))
    stage_dir = RunDir.for_recipe(recipe).stage_dir("rm")
    with pytest.raises(StageError, match=r"--resume: no usable checkpoint under .*rm/checkpoints"):
        run_train_rm(recipe, QUIET, resume=True)
    assert not stage_dir.exists()  # refused before anything was written

    with monkeypatch.context() as patch:
        _signal_at(patch, 3, signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            run_train_rm(recipe, QUIET)
    (stage_dir / "checkpoints" / "checkpoint-3" / "trainer_state.json").write_text("{cut")
    changed = {**SMALL, "reward": {**SMALL["reward"], "learning_rate": 1e-5}}
    manifest = run_train_rm(load_recipe(small_recipe(tmp_path, changed)), QUIET, resume=True)
    assert manifest["status"] == "completed"
    assert manifest["warnings"] == [
        "checkpoint checkpoint-3 is corrupt (no readable trainer_state.json); skipped",
        RECIPE_CHANGED,
    ]
    assert read_metrics(stage_dir / "metrics.jsonl")[0]["step"] == 1
