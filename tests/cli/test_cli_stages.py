"""The stage commands (sft, train-rm) and the run lock from the shell: exit codes, one-line
errors, `--json`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlhf_cli import views
from rlhf_cli.cli import app


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_help_lists_the_stages() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("validate", "sft", "train-rm", "ppo", "audit", "merge", "push"):
        assert command in result.output


def test_stage_with_a_bad_recipe_exits_2(make_recipe) -> None:
    path = make_recipe({"sft": {"learning_rate": -1}})
    result = invoke("sft", "--recipe", str(path))
    assert result.exit_code == 2
    assert f"{path}:" in result.output and "sft.learning_rate: " in result.output
    assert "Traceback" not in result.output


def test_sft_disabled_exits_2_with_one_line(make_recipe) -> None:
    result = invoke("sft", "--recipe", str(make_recipe({"sft": {"enabled": False}})))
    assert result.exit_code == 2
    assert "error: sft.enabled is false" in result.output


def test_train_rm_with_pretrained_reward_exits_2(make_recipe) -> None:
    path = make_recipe({"reward": {"base_model": None, "pretrained": "builtin:minilm"}})
    result = invoke("train-rm", "--recipe", str(path))
    assert result.exit_code == 2
    assert "reward.pretrained is set" in result.output


@pytest.mark.slow
def test_sft_json_prints_the_manifest(make_recipe, tmp_path: Path) -> None:
    path = make_recipe({"sft": {"epochs": 1}, "data": {"sft": {"max_samples": 80}}})
    result = invoke("sft", "--recipe", str(path), "--json")
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.stdout)
    assert manifest["status"] == "completed" and manifest["stage"] == "sft"
    assert manifest["dir"] == str(tmp_path / "runs" / "tiny" / "sft")
    on_disk = json.loads((tmp_path / "runs" / "tiny" / "sft" / "manifest.json").read_text())
    assert {k: v for k, v in manifest.items() if k != "dir"} == on_disk


@pytest.mark.slow
def test_train_rm_runs_without_sft(make_recipe, tmp_path: Path) -> None:
    path = make_recipe({"data": {"preferences": {"max_samples": 40}}})
    result = invoke("train-rm", "--recipe", str(path))
    assert result.exit_code == 0, result.output
    # the stage's table (stderr) shows like beside like in GiB: its live tensors' peak and the
    # plan's tensor bytes; the process's RSS (runtime included) in a row of its own
    assert "peak memory / plan" in result.output and "peak RSS (process)" in result.output
    assert " GiB of tensors" not in result.output
    assert "peak_memory_bytes" not in result.output
    run = tmp_path / "runs" / "tiny"
    assert not (run / "sft").exists()
    manifest = json.loads((run / "rm" / "manifest.json").read_text())
    assert manifest["status"] == "completed"
    assert (run / "rm" / "model" / "config.json").is_file()
    assert (tmp_path / "runs" / "LATEST").read_text().strip() == "tiny"
    # rlhf status shows the stage's measured peak beside the plan's estimate
    status = invoke("status", "--runs-dir", str(tmp_path / "runs"), "--json")
    (rm,) = [row for row in json.loads(status.stdout)["stages"] if row["stage"] == "rm"]
    metrics = rm["metrics"]
    assert metrics["peak_memory_kind"] == "cpu_tensors"
    assert metrics["peak_memory_rss_bytes"] > metrics["peak_memory_bytes"] > 0
    assert metrics["planned_peak_bytes"] > 0
    table = invoke("status", "--runs-dir", str(tmp_path / "runs"))
    cell = views.memory_cell(metrics)
    assert cell.count(" GiB") == 2 and " / " in cell and "RSS" not in table.stdout
    # where only the RSS was measured (a vLLM engine in the process), it says so
    rss_only = {**metrics, "peak_memory_kind": "cpu_rss"}
    assert views.memory_cell(rss_only).startswith("RSS ")
    assert views.memory_cell(rss_only).endswith(" GiB of tensors")


def test_cli_busy_run_exits_2_naming_the_holder(make_recipe, tmp_path):
    recipe = make_recipe()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = tmp_path / "runs" / "tiny" / ".lock"
        lock.parent.mkdir(parents=True)
        lock.write_text(f'{{"pid": {holder.pid}, "command": "rlhf train-rm"}}')
        result = CliRunner().invoke(app, ["sft", "--recipe", str(recipe)])
    finally:
        holder.kill()
        holder.wait()
    assert result.exit_code == 2
    assert f"busy: pid {holder.pid}" in result.output
    assert "Traceback" not in result.output
