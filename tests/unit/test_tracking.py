"""metrics.jsonl writing and reading, the optional trackers, and the console."""

from __future__ import annotations

import json
import sys
import types

import pytest

from rlhf_cli import tracking
from rlhf_cli.errors import RlhfError
from rlhf_cli.tracking import MetricsWriter, make_console, read_metrics

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
    writer = MetricsWriter(path, trackers=["wandb", "tensorboard"], enabled=False)
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


@pytest.mark.parametrize(
    "tracker, module", [("wandb", "wandb"), ("tensorboard", "torch.utils.tensorboard")]
)
def test_uninstalled_tracker_names_the_package_to_install(tmp_path, monkeypatch, tracker, module):
    monkeypatch.setitem(sys.modules, module, None)  # `import` now raises ImportError
    with pytest.raises(RlhfError, match=f"lists {tracker} but .* pip install {tracker}$"):
        MetricsWriter(tmp_path / "metrics.jsonl", trackers=[tracker])


def test_wandb_gets_the_run_name_and_only_numbers(tmp_path, monkeypatch, frozen_time):
    calls = []

    class FakeRun:
        def log(self, metrics, step):
            calls.append(("log", metrics, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(("init", kwargs)) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)

    path = tmp_path / "runs" / "my-run" / "ppo" / "metrics.jsonl"
    writer = MetricsWriter(path, trackers=["wandb"])
    writer.log({"loss": 0.5, "iteration": 3, "note": "text", "list": [1, 2]}, step=7)
    writer.close()
    assert calls == [
        ("init", {"project": "rlhf-cli", "name": "my-run", "resume": "allow"}),
        ("log", {"loss": 0.5, "iteration": 3}, 7),
        ("finish",),
    ]
    assert read_metrics(path) == [
        {
            "step": 7,
            "time": 1700000000.123,
            "loss": 0.5,
            "iteration": 3,
            "note": "text",
            "list": [1, 2],
        }
    ]


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
    from rlhf_cli.stages.ppo import _truncate_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "lo', encoding="utf-8")
    _truncate_jsonl(path, 2)
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
