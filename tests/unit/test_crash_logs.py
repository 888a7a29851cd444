"""A crash log (`error.log`, the traceback of a bug) stays only beside the attempt that wrote it
(#50 item 13): a stage that starts again removes its earlier attempts' logs, from its folder and
those its command wrote in the run's folder, and a later success has none beside it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlhf_cli.errors import write_crash_log
from rlhf_cli.recipe import Recipe, parse_recipe
from rlhf_cli.record import StageRecord
from rlhf_cli.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]


def _recipe(tmp_path: Path) -> Recipe:
    data = yaml.safe_load((REPO / "recipes" / "tiny.yaml").read_text())
    data["run"]["output_dir"] = str(tmp_path / "runs")
    return parse_recipe(yaml.safe_dump(data), "r.yaml", base_dir=REPO / "recipes")


def _crash(run: RunDir, recipe: Recipe, stage: str, command: str) -> Path:
    """An attempt of `stage` that hits a bug after replacing its outputs, logged as the CLI
    logs it (`cli._internal_error`: into the folder the record names)."""
    with pytest.raises(RuntimeError) as caught:
        with StageRecord(run, stage, recipe, inputs={}) as record:
            record.replacing()
            raise RuntimeError("a bug")
    log = write_crash_log(caught.value, caught.value.log_dir, command)
    assert log is not None and log.parent == run.stage_dir(stage)
    return log


def test_a_stage_that_succeeds_after_a_crash_keeps_no_crash_log(tmp_path, monkeypatch) -> None:
    recipe = _recipe(tmp_path)
    run = RunDir.for_recipe(recipe)
    log = _crash(run, recipe, "sft", "sft")
    monkeypatch.setenv("RANK", "1")  # process 1 of a multi-process attempt logs beside it
    rank_log = write_crash_log(RuntimeError("a bug"), run.stage_dir("sft"), "sft")
    monkeypatch.delenv("RANK")
    assert rank_log == run.stage_dir("sft") / "error.rank1.log"
    assert log.is_file() and run.read_manifest("sft")["status"] == "failed"

    with StageRecord(run, "sft", recipe, inputs={}):
        assert not log.exists() and not rank_log.exists()  # gone as the stage starts again
    assert run.read_manifest("sft")["status"] == "completed"
    assert sorted(p.name for p in run.stage_dir("sft").glob("error*")) == []


def test_a_run_folder_crash_log_goes_with_its_own_command_only(tmp_path) -> None:
    """A bug before any stage record opened logs into the run's folder: the next attempt of
    the same command removes it; another stage leaves it (it is about another command)."""
    recipe = _recipe(tmp_path)
    run = RunDir.for_recipe(recipe)
    run.path.mkdir(parents=True)
    audit_log = write_crash_log(RuntimeError("an audit bug"), run.path, "audit")
    assert audit_log == run.path / "error.log"
    with StageRecord(run, "sft", recipe, inputs={}):
        pass
    assert audit_log.read_text().splitlines()[-1] == "RuntimeError: an audit bug"

    write_crash_log(RuntimeError("a merge bug"), run.path, "merge")
    with StageRecord(run, "merged", recipe, inputs={}):
        pass
    assert not (run.path / "error.log").exists()
