"""metrics.jsonl writing and reading, the optional trackers, and the console."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from rlhf_cli import tracking
from rlhf_cli.errors import RlhfError
from rlhf_cli.tracking import (
    MetricsWriter,
    Trackers,
    make_console,
    read_metrics,
    require_trackers,
    tracker_config,
    truncate_metrics,
)

NOW = 1_700_000_000.123456


@pytest.fixture
def frozen_time(monkeypatch):
    monkeypatch.setattr(tracking.time, "time", lambda: NOW)


def test_one_json_line_per_log_with_step_and_time(tmp_path, frozen_time):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.log({"loss": 0.5, "note": "warm-up"}, step=1)
    writer.log({"loss": 0.25, "count": 3}, step=2)
    writer.close()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines == [
        '{"step": 1, "time": 1700000000.123, "loss": 0.5, "note": "warm-up"}',
        '{"step": 2, "time": 1700000000.123, "loss": 0.25, "count": 3}',
    ]
    assert read_metrics(path) == [
        {"step": 1, "time": 1700000000.123, "loss": 0.5, "note": "warm-up"},
        {"step": 2, "time": 1700000000.123, "loss": 0.25, "count": 3},
    ]


def test_non_finite_numbers_are_written_as_null(tmp_path, frozen_time):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.log(
        {"nan": float("nan"), "inf": float("inf"), "ninf": float("-inf"), "ok": 1.5, "zero": 0.0},
        step=4,
    )
    writer.close()
    text = path.read_text(encoding="utf-8")
    assert "NaN" not in text and "Infinity" not in text
    json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl"))
    assert read_metrics(path) == [
        {
            "step": 4,
            "time": 1700000000.123,
            "nan": None,
            "inf": None,
            "ninf": None,
            "ok": 1.5,
            "zero": 0.0,
        }
    ]


def test_each_line_is_on_disk_before_close(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.log({"loss": 1.0}, step=1)
    assert [r["loss"] for r in read_metrics(path)] == [1.0]
    writer.log({"loss": 2.0}, step=2)
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    writer.close()


def test_missing_parent_folders_are_created(tmp_path):
    path = tmp_path / "runs" / "demo" / "ppo" / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.log({"x": 1}, step=0)
    writer.close()
    assert [r["x"] for r in read_metrics(path)] == [1]


@pytest.mark.parametrize("resume, steps", [(True, [1, 2, 3]), (False, [3])])
def test_resume_appends_and_a_new_run_truncates(tmp_path, resume, steps):
    path = tmp_path / "metrics.jsonl"
    first = MetricsWriter(path)
    first.log({"loss": 1.0}, step=1)
    first.log({"loss": 0.9}, step=2)
    first.close()
    second = MetricsWriter(path, resume=resume)
    second.log({"loss": 0.8}, step=3)
    second.close()
    assert [r["step"] for r in read_metrics(path)] == steps


def test_disabled_writer_creates_nothing(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    writer = MetricsWriter(path, enabled=False)
    writer.log({"loss": 1.0}, step=1)
    writer.close()
    assert not path.parent.exists()
    assert read_metrics(path) == []


def test_disabled_writer_keeps_an_existing_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n', encoding="utf-8")
    writer = MetricsWriter(path, enabled=False)
    writer.log({"loss": 1.0}, step=2)
    writer.close()
    assert read_metrics(path) == [{"step": 1}]


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb", "trackio", "mlflow"])
def test_an_uninstalled_tracker_names_the_extra_to_install(monkeypatch, tracker):
    monkeypatch.setitem(sys.modules, tracker, None)  # find_spec now answers None
    with pytest.raises(
        RlhfError, match=rf"lists {tracker} but .* pip install 'rlhf-cli\[{tracker}\]'$"
    ):
        require_trackers(["tensorboard", tracker] if tracker != "tensorboard" else [tracker])


def _run_section(**kw):
    from rlhf_cli.recipe import RunSection

    return RunSection(name="my-run", **kw)


def test_trackers_are_named_after_the_run_and_stage(tmp_path):
    trackers = Trackers.for_stage(
        _run_section(trackers=["tensorboard"], project="proj"), "ppo", tmp_path / "ppo"
    )
    assert trackers == Trackers(
        ("tensorboard",), "proj", "my-run-ppo", "my-run", tmp_path / "ppo" / "tensorboard"
    )
    from transformers import TrainingArguments

    assert trackers.trainer_args(TrainingArguments.__dataclass_fields__) == {
        "report_to": ["tensorboard"],
        "run_name": "my-run-ppo",
        "project": "proj",
    }
    assert trackers.trainer_args({})["report_to"] == ["tensorboard"]
    none = Trackers.for_stage(_run_section(), "sft", tmp_path / "sft")
    assert none.trainer_args({})["report_to"] == "none" and none.for_accelerate() == []


def test_accelerate_trackers_get_the_project_and_run_names(tmp_path):
    from accelerate import tracking as acc

    trackers = Trackers(
        ("tensorboard", "wandb", "trackio", "mlflow"),
        "proj",
        "r-ppo",
        "r",
        tmp_path / "tensorboard",
    )
    tb, wandb, trackio, mlflow = trackers.for_accelerate()
    assert isinstance(tb, acc.TensorBoardTracker)
    assert (Path(tb.logging_dir_param) / tb.run_name) == tmp_path / "tensorboard"
    assert isinstance(wandb, acc.WandBTracker) and wandb.run_name == "proj"
    assert wandb.init_kwargs == {"name": "r-ppo", "group": "r"}
    assert isinstance(trackio, acc.TrackioTracker) and trackio.run_name == "proj"
    assert trackio.init_kwargs == {"name": "r-ppo", "resume": "allow"}
    assert isinstance(mlflow, acc.MLflowTracker) and mlflow.run_name == "r-ppo"


def test_the_environment_is_set_for_the_stage_and_restored(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "users-own")
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "users-experiment")
    trackers = Trackers(("tensorboard",), "proj", "r-sft", "r", tmp_path / "tensorboard")
    with trackers.environment():
        assert os.environ["TENSORBOARD_LOGGING_DIR"] == str(tmp_path / "tensorboard")
        assert os.environ["WANDB_PROJECT"] == "proj"
        assert os.environ["WANDB_RUN_GROUP"] == "r"
        assert os.environ["MLFLOW_EXPERIMENT_NAME"] == "users-experiment"  # MLflow's rule
    assert "TENSORBOARD_LOGGING_DIR" not in os.environ
    assert os.environ["WANDB_PROJECT"] == "users-own"


def test_tracker_config_is_flat_and_scalar():
    dump = {"run": {"seed": 1, "trackers": ["tensorboard"], "x": None}, "ppo": {"lr": 1e-5}}
    assert tracker_config(dump) == {
        "run.seed": 1,
        "run.trackers": "['tensorboard']",
        "run.x": "None",
        "ppo.lr": 1e-5,
    }


def test_read_metrics_of_a_missing_file_is_empty(tmp_path):
    assert read_metrics(tmp_path / "nothing.jsonl") == []


def test_read_metrics_skips_blank_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n\n   \n{"step": 2, "loss": null}\n', encoding="utf-8")
    assert read_metrics(path) == [{"step": 1}, {"step": 2, "loss": None}]


def test_a_last_line_cut_short_by_a_kill_is_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo', encoding="utf-8")
    assert read_metrics(path) == [{"step": 1}, {"step": 2}]


@pytest.mark.parametrize("bad", ['{"step": 2, "lo', "[1, 2]", "\udcff garbage"])
def test_a_damaged_line_before_the_end_names_the_file_and_line(tmp_path, bad):
    from rlhf_cli.errors import DataError

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n' + bad + '\n{"step": 3}\n', errors="surrogateescape")
    with pytest.raises(DataError, match=r"metrics.jsonl:2: not a JSON object"):
        read_metrics(path)


def test_resume_truncation_keeps_whole_lines_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "lo', encoding="utf-8")
    truncate_metrics(path, 2)
    assert read_metrics(path) == [{"step": 1}, {"step": 2}]
    assert path.read_text().endswith("}\n")


@pytest.mark.parametrize(
    "quiet, json_mode, shown",
    [
        (False, False, True),
        (True, False, False),
        (False, True, False),
        (True, True, False),
    ],
)
def test_console_writes_to_stderr_and_json_mode_is_quiet(capsys, quiet, json_mode, shown):
    console = make_console(quiet=quiet, json_mode=json_mode)
    assert console.quiet is not shown and console.stderr
    console.print("hello from the console")
    out, err = capsys.readouterr()
    assert out == ""
    assert ("hello from the console" in err) is shown


def _step(callback, step: int, max_steps: int = 10, save: bool = False):
    """`on_step_end` after transformers' DefaultFlowCallback asked to save (`save`) or not."""
    from types import SimpleNamespace

    import torch

    args = SimpleNamespace(device=torch.device("cpu"))
    state = SimpleNamespace(global_step=step, max_steps=max_steps, is_world_process_zero=True)
    control = SimpleNamespace(
        should_save=save, should_training_stop=False, should_evaluate=True, should_log=False
    )
    callback.on_step_end(args, state, control)
    return args, state, control


def test_the_stage_callback_stops_after_the_step_of_a_signal(tmp_path):
    """Ctrl-C: save, stop, no end-of-epoch evaluation, and nothing logged after the stop's
    checkpoint; a signal in the last step changes nothing, and the Trainer's end-of-training
    checkpoint is not written (the stage saves its result)."""
    from rich.console import Console

    from rlhf_cli.stages.trainers import StageCallback

    callback = StageCallback(Console(quiet=True), "sft")
    callback.writer = MetricsWriter(tmp_path / "metrics.jsonl")
    _, _, control = _step(callback, 3)
    assert not (control.should_save or control.should_training_stop or callback.stopping)
    assert not control.should_log
    assert _step(callback, 2, save=True)[2].should_log  # a periodic checkpoint's step is logged
    callback.flag.requested = True
    args, state, control = _step(callback, 4)
    assert callback.stopping and control.should_save and control.should_training_stop
    assert control.should_log  # the stop's checkpoint ends a loss window too
    callback.on_log(args, state, control, logs={"loss": 1.5})  # the stop step's own log: kept
    callback.on_save(args, state, control)
    assert callback.flag.saved == "checkpoint-4 (step 4)" and callback.closed
    callback.on_epoch_end(args, state, control)
    assert not control.should_evaluate
    callback.on_log(args, state, control, logs={"train_loss": 1.0})  # the summary: dropped
    callback.writer.close()
    assert [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1.5]

    last = StageCallback(Console(quiet=True), "sft")
    last.flag.requested = True
    _, _, control = _step(last, 10, save=True)  # its end-of-training save, set before ours
    assert not (control.should_save or control.should_training_stop or last.stopping)


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        # windows (0,2] (2,3] (3,5] tile the steps before the checkpoint at 5; 3 more steps
        # trained after it at mean 0.1: (1.0*2 + 0.5*1 + 0.2*2 + 0.1*3) / 8
        ([(2, 1.0), (3, 0.5), (5, 0.2), (6, 9.0)], 3.2 / 8),
        # a checkpoint at 5 that ended no row: (3,5] is left out, not counted as zero
        ([(2, 1.0), (3, 0.5), (6, 9.0)], (2.0 + 0.5 + 0.3) / 6),
    ],
)
def test_the_run_train_loss_adds_the_logged_windows_before_a_resume(
    tmp_path, rows, expected
) -> None:
    """Hand-computed: the Trainer's `training_loss` after a resume covers its own steps only."""
    from types import SimpleNamespace

    from rlhf_cli.stages.trainers import run_train_loss

    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    for step, loss in rows:
        writer.log({"loss": loss}, step=step)
        writer.log({"eval_loss": 7.0}, step=step)  # rows without a training loss: not counted
    writer.close()
    result = SimpleNamespace(training_loss=0.1, global_step=8)
    record = SimpleNamespace(dir=tmp_path, manifest={"resumed_from": {"step": 5}})
    assert run_train_loss(record, result) == pytest.approx(expected, rel=1e-12)
    record.manifest = {}  # a run trained in one go: the Trainer's own mean
    assert run_train_loss(record, result) == 0.1
