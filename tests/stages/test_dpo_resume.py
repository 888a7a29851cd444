"""`rlhf dpo` never loses work: Ctrl-C finishes the step, writes a Trainer checkpoint and stops
with the manifest 'interrupted'; `--resume` continues from it, reads the reference's log-probs
it kept (no reference forward), and ends with the weights and held-out numbers of the
uninterrupted run."""

from __future__ import annotations

import json
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_sft_rm_resume import _signal_at
from typer.testing import CliRunner

from rlhf_cli.cli import app

pytestmark = pytest.mark.slow
# 96 pairs: 82 trained on, 16 a step, 6 steps; a checkpoint every 2, the stop after step 3
SETTINGS = {
    "sft": {"epochs": 1},
    "data": {"sft": {"max_samples": 160}, "preferences": {"max_samples": 96}},
    "dpo": {"learning_rate": 1e-3, "batch_size": 16, "max_length": 128, "save_steps": 2},
}
STOP = 3
# 4-bit: the LoRA SFT adapter frozen on the NF4 base, DPO's adapter stacked over it
QLORA = {
    **SETTINGS,
    "model": {"quantization": {"load_in_4bit": True, "compute_dtype": "float32"}},
    "sft": {"epochs": 1, "full_finetune": False, "learning_rate": 5e-3},
}


@pytest.fixture(scope="module", params=[SETTINGS, QLORA], ids=["lora", "4-bit"])
def sft_run(
    request: pytest.FixtureRequest, sft_folder: Callable[[str, dict], Path]
) -> tuple[Path, dict[str, Any]]:
    return sft_folder("dpo_resume_sft", request.param), request.param


def test_an_interrupted_dpo_resumed_ends_where_an_uninterrupted_one_does(
    sft_run: tuple[Path, dict[str, Any]],
    small_recipe: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trl import DPOTrainer

    sft_folder, settings = sft_run

    def dpo(name: str, *args: str) -> Any:
        """`rlhf dpo` on the run in `name`/, copied from the SFT run the first time."""
        if not (tmp_path / name).exists():
            shutil.copytree(sft_folder / "runs", tmp_path / name / "runs")
        recipe = small_recipe(tmp_path / name, settings)
        return CliRunner().invoke(app, ["dpo", "--recipe", str(recipe), "--json", *args])

    done = dpo("whole")
    assert done.exit_code == 0, done.output
    expected = json.loads(done.stdout)
    whole_dir = Path(expected["dir"])

    with monkeypatch.context() as patch:
        _signal_at(patch, STOP, signal.SIGINT)
        stopped = dpo("cut")
    assert stopped.exit_code == 130, stopped.output
    assert f"interrupted: checkpoint-{STOP} (step {STOP}) saved" in stopped.output
    stage_dir = tmp_path / "cut" / "runs" / "tiny" / "dpo"
    manifest = json.loads((stage_dir / "manifest.json").read_text())
    assert manifest["status"] == "interrupted"
    on_disk = sorted(p.name for p in (stage_dir / "checkpoints").glob("checkpoint-*"))
    assert on_disk == ["checkpoint-2", f"checkpoint-{STOP}"]

    forwards: list[int] = []
    original = DPOTrainer.compute_ref_log_probs
    monkeypatch.setattr(
        DPOTrainer,
        "compute_ref_log_probs",
        lambda self, model, inputs: forwards.append(1) or original(self, model, inputs),
    )
    again = dpo("cut", "--resume")
    assert again.exit_code == 0, again.output
    resumed = json.loads(again.stdout)
    assert resumed["status"] == "completed"
    assert forwards == []  # the kept log-probs, not the reference again
    assert resumed["resumed_from"] == {"checkpoint": f"checkpoint-{STOP}", "step": STOP}
    assert resumed["metrics"]["steps"] == expected["metrics"]["steps"] == 6
    for key in ("eval_loss", "eval_rewards/margins", "eval_rewards/accuracies"):
        assert resumed["metrics"][key] == pytest.approx(expected["metrics"][key], rel=1e-5)
    weights = "adapter/adapter_model.safetensors"
    got, want = load_file(stage_dir / weights), load_file(whole_dir / weights)
    assert got.keys() == want.keys() and len(want) > 0
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
    # the weights moved: the comparison is not of two untrained adapters
    assert resumed["metrics"]["eval_loss"] < resumed["metrics"]["eval_loss_start"] - 1e-3
    assert not (stage_dir / "checkpoints").exists()
