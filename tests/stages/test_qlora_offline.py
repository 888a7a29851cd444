"""The offline methods on 4-bit weights (QLoRA) after a 4-bit SFT: the policy's adapter is stacked
over the frozen SFT adapter, as PPO's is, and the reference is the SFT adapter alone. TRL's own
reference for a given PeftModel is the base with every adapter off (or a copy of the new, zero
adapter), which is not the SFT model: DPO's held-out loss would then not start at log 2."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from test_offline_methods import thumbs_rows
from typer.testing import CliRunner

from rlhf_cli.cli import app
from rlhf_cli.tracking import read_metrics

pytestmark = pytest.mark.slow
pytest.importorskip("bitsandbytes")

QLORA = {
    "model": {"quantization": {"load_in_4bit": True, "compute_dtype": "float32"}},
    "sft": {"full_finetune": False, "epochs": 1, "learning_rate": 5e-3},
    "data": {"sft": {"max_samples": 64}, "preferences": {"max_samples": 96}},
}
FEW_STEPS = ["learning_rate=1e-3", "batch_size=16", "max_length=128", "logging_steps=1"]


@pytest.fixture(scope="module")
def sft_run(sft_folder: Callable[[str, dict], Path]) -> Path:
    """A tiny LoRA SFT on the 4-bit base, once for the module; each test copies its folder."""
    return sft_folder("qlora_sft", QLORA)


@pytest.fixture
def recipe(sft_run: Path, tmp_path: Path, small_recipe: Callable[..., Path]) -> Path:
    shutil.copytree(sft_run / "runs", tmp_path / "runs")
    return small_recipe(tmp_path, QLORA)


def rlhf(*args: str):
    return CliRunner().invoke(app, list(args))


def trained(recipe: Path, method: str, *more: str) -> dict:
    sets = [x for s in [*(f"{method}.{s}" for s in FEW_STEPS), *more] for x in ("--set", s)]
    result = rlhf(method, "--recipe", str(recipe), "--json", *sets)
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.stdout)
    stage = Path(manifest["dir"])
    # the adapter that trained, alone: not the frozen SFT adapter under it, nor TRL's copy
    assert sorted(p.name for p in (stage / "adapter").iterdir() if p.suffix != ".md") == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    losses = [r["loss"] for r in read_metrics(stage / "metrics.jsonl") if "loss" in r]
    assert len(losses) == manifest["metrics"]["steps"] >= 5
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    return manifest


def test_dpo_on_4bit_weights_starts_at_the_sft_model_and_merges(recipe: Path) -> None:
    metrics = trained(recipe, "dpo")["metrics"]
    # policy = reference at the start: the reference is the SFT model, not the bare base
    assert metrics["eval_loss_start"] == pytest.approx(math.log(2), abs=1e-5)
    assert metrics["eval_loss"] < metrics["eval_loss_start"]

    merged = rlhf("merge", "--recipe", str(recipe), "--stage", "dpo", "--json")
    assert merged.exit_code == 0, merged.output
    assert json.loads(merged.stdout)["merged_from"]["stage"] == "dpo"


@pytest.mark.parametrize("method", ["kto", "orpo"])
def test_kto_and_orpo_train_on_4bit_weights(recipe: Path, method: str, tmp_path: Path) -> None:
    sets = [f"data.preferences.path={thumbs_rows(recipe, tmp_path)}"] if method == "kto" else []
    manifest = trained(recipe, method, *sets)
    assert (manifest["reference"] is None) == (method == "orpo")
