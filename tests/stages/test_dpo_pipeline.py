"""`rlhf dpo && rlhf merge --stage dpo && rlhf push --dry-run` on a tiny run with SFT, each with
no other argument (the run found from runs/LATEST as the CLI finds it), and what the pipeline then
knows of the DPO stage: `rlhf status` lists it with its numbers and advises the merge, the merge
records where it came from and passes its logit check, the model card names DPO and its inputs,
eval and compare find the DPO policy; a variant run takes its SFT from `run.base`."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from rlhf_cli.cli import app
from rlhf_cli.recipe import load_recipe
from rlhf_cli.rundir import RunDir

pytestmark = pytest.mark.slow

# a few steps of DPO (96 pairs, 16 a step) and the demo's push settings, in the run's snapshot
DPO = {"learning_rate": 1e-3, "batch_size": 16, "max_length": 128, "logging_steps": 1}
SFT = {"sft": {"epochs": 1}, "data": {"sft": {"max_samples": 160}}}


@pytest.fixture(scope="module")
def sft_run(sft_folder: Callable[[str, dict], Path]) -> Path:
    """A tiny SFT run, once for the module; each test copies its folder."""
    return sft_folder("dpo_pipeline_sft", SFT)


@pytest.fixture
def demo_run(sft_run: Path, chdir_tmp: Path) -> Path:
    """The SFT run copied to ./runs of an empty working folder, its snapshot (what the CLI
    reads with no --recipe) writing there, with a few DPO steps on 96 pairs."""
    shutil.copytree(sft_run / "runs", chdir_tmp / "runs")
    snapshot = chdir_tmp / "runs" / "tiny" / "recipe.yaml"
    data = yaml.safe_load(snapshot.read_text())
    data["run"]["output_dir"] = "runs"
    data["dpo"] = {**data.get("dpo", {}), **DPO}
    data["data"]["preferences"]["max_samples"] = 96
    snapshot.write_text(yaml.safe_dump(data, sort_keys=False))
    return chdir_tmp / "runs"


def rlhf(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def test_dpo_merge_push_with_no_arguments_and_status_shows_dpo(demo_run: Path) -> None:
    from rlhf_cli.stages.eval import resolve_target

    assert rlhf("dpo").exit_code == 0
    stage = demo_run / "tiny" / "dpo"
    dpo_manifest = json.loads((stage / "manifest.json").read_text())
    assert dpo_manifest["status"] == "completed"

    # status: dpo after the SFT, its numbers, and the merge of its adapter advised, not train-rm
    shown = rlhf("status", "--json")
    assert shown.exit_code == 0, shown.output
    status = json.loads(shown.stdout)
    rows = {row["stage"]: row for row in status["stages"]}
    assert [r["stage"] for r in status["stages"]][:3] == ["sft", "rm", "ppo"]
    assert rows["dpo"]["status"] == "completed"
    metrics = dpo_manifest["metrics"]
    for key in ("eval_loss", "eval_rewards/margins", "eval_rewards/accuracies"):
        assert rows["dpo"]["metrics"][key] == metrics[key]
    assert status["next"] == "rlhf merge --stage dpo"
    text = rlhf("status")
    assert text.exit_code == 0 and "dpo" in text.stdout and "rlhf merge --stage dpo" in text.stdout

    # the merge: the DPO adapter on the SFT model it was trained from, checked
    merged = rlhf("merge", "--stage", "dpo", "--json")
    assert merged.exit_code == 0, merged.output
    manifest = json.loads(merged.stdout)
    assert manifest["merged_from"]["stage"] == "dpo"
    assert manifest["merged_from"]["adapter"] == str(stage / "adapter")
    assert Path(manifest["merged_from"]["base"]).resolve() == demo_run / "tiny" / "sft" / "model"
    assert manifest["metrics"]["max_abs_logit_diff"] <= manifest["metrics"]["tolerance"]
    assert set(manifest["inputs"]) == {"sft", "dpo"}
    assert json.loads(rlhf("status", "--json").stdout)["next"] == "rlhf push"

    # push: the merged model, its card naming DPO, its settings and the pairs it trained on
    pushed = rlhf("push", "--dry-run", "--json")
    assert pushed.exit_code == 0, pushed.output
    result = json.loads(pushed.stdout)
    assert result["dry_run"] is True and "model.safetensors" in result["files"]
    card = (Path(result["folder"]) / "README.md").read_text()
    assert "tags: [rlhf, dpo, rlhf-cli]" in card
    assert "aligned with DPO from preference pairs" in card
    assert "\n| DPO | " in card and "loss_type ['sigmoid']" in card
    assert f"preferences `{dpo_manifest['inputs']['preferences']['path']}`" in card
    assert dpo_manifest["inputs"]["preferences"]["sha256"][:12] in card
    assert "PPO" not in card and "reward model" not in card.replace("without a reward", "")

    # eval takes `dpo` as a label: the DPO adapter over the SFT model
    recipe = load_recipe(demo_run / "tiny" / "recipe.yaml")
    target = resolve_target(recipe, RunDir.for_recipe(recipe), "dpo")
    assert (target.label, target.source) == ("dpo", str(stage / "adapter"))
    assert set(target.inputs) == {"sft", "dpo"}


def test_status_advice_is_unchanged_for_a_ppo_run(tmp_path: Path) -> None:
    """Manifests alone: a run with sft done and nothing else is told `rlhf train-rm`; a DPO
    stage stopped mid-way is told to resume."""
    from rlhf_cli.stages.status import run_status

    run = RunDir(tmp_path / "runs", "r")
    (run.path).mkdir(parents=True)
    for stage, status in (("sft", "completed"),):
        run.stage_dir(stage).mkdir()
        run.manifest_path(stage).write_text(json.dumps({"stage": stage, "status": status}))
    assert run_status(run)["next"] == "rlhf train-rm"
    assert [r["stage"] for r in run_status(run)["stages"]] == [
        "sft", "rm", "ppo", "audit", "merged", "push",
    ]  # fmt: skip
    run.stage_dir("dpo").mkdir()
    run.manifest_path("dpo").write_text(json.dumps({"stage": "dpo", "status": "failed"}))
    status = run_status(run)
    assert [r["stage"] for r in status["stages"]][3] == "dpo"
    assert status["next"] == "rlhf dpo"


def test_a_dpo_variant_takes_its_sft_from_run_base(demo_run: Path) -> None:
    snapshot = yaml.safe_load((demo_run / "tiny" / "recipe.yaml").read_text())
    snapshot["run"].update(name="variant", base="tiny")
    snapshot["dpo"]["beta"] = 0.3
    recipe = demo_run.parent / "variant.yaml"
    recipe.write_text(yaml.safe_dump(snapshot, sort_keys=False))
    result = rlhf("dpo", "--recipe", str(recipe), "--json")
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.stdout)
    assert Path(manifest["inputs"]["sft"]["path"]).resolve() == demo_run / "tiny" / "sft"
    assert manifest["method"]["beta"] == 0.3
    assert not (demo_run / "variant" / "sft").exists()
    status = json.loads(rlhf("status", "variant", "--json").stdout)
    rows = {row["stage"]: row for row in status["stages"]}
    assert rows["sft"]["from_run"] == "tiny" and rows["dpo"]["status"] == "completed"
    assert status["next"] == "rlhf merge --stage dpo"
