"""`rlhf kto`, `rlhf orpo` and `rlhf simpo` end to end on the tiny SFT run: each trains a few
steps with its loss falling into `runs/<name>/<method>/` with dpo's manifest (method, inputs,
health); KTO keeps its reference's log-probs as DPO does, ORPO and SimPO hold no reference; KTO
refuses pairs and the others refuse thumbs rows, in one line naming the layout, exit 2."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from test_dpo import run_copy, sft_run  # noqa: F401  (the tiny SFT run, once for the module)
from typer.testing import CliRunner

from rlhf_cli.cli import app
from rlhf_cli.recipe import load_recipe
from rlhf_cli.tracking import read_metrics

pytestmark = pytest.mark.slow

# a few steps: 64 pairs (about 54 trained on), 8 a step, short rows, a learning rate LoRA moves at
FEW_STEPS = [
    "batch_size=8",
    "max_length=96",
    "logging_steps=1",
    "learning_rate=2e-3",
]
SAMPLES = "data.preferences.max_samples=64"


def offline(method: str, recipe: Path, *sets: str):
    args = [method, "--recipe", str(recipe), "--json", "--set", SAMPLES]
    for item in [f"{method}.{s}" for s in FEW_STEPS] + list(sets):
        args += ["--set", item]
    return CliRunner().invoke(app, args)


def thumbs_rows(recipe: Path, folder: Path) -> Path:
    """The tiny pairs as KTO's rows: each chosen answer a thumbs-up, each rejected one down."""
    source = Path(load_recipe(recipe).data.preferences.path)
    rows = []
    for line in source.read_text().splitlines():
        pair = json.loads(line)
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True})
        rows.append({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False})
    path = folder / "thumbs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def trained(result, method: str) -> dict:
    """The manifest of a run that trained with its training loss falling."""
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.stdout)
    stage = Path(manifest["dir"])
    assert stage.name == method and manifest["method"]["name"] == method
    assert (stage / "adapter" / "adapter_model.safetensors").is_file()
    rows = [r for r in read_metrics(stage / "metrics.jsonl") if "loss" in r]
    assert len(rows) == manifest["metrics"]["steps"] >= 4
    losses = [r["loss"] for r in rows]
    half = len(losses) // 2
    assert sum(losses[-half:]) / half < sum(losses[:half]) / half, losses
    metrics = manifest["metrics"]
    assert metrics["eval_loss"] < metrics["eval_loss_start"]  # and on the held-out rows
    assert isinstance(manifest["health"], list)
    return manifest


def test_kto_trains_on_thumbs_rows_and_keeps_its_reference_log_probs(
    run_copy: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    thumbs = f"data.preferences.path={thumbs_rows(run_copy, tmp_path)}"
    manifest = trained(offline("kto", run_copy, thumbs), "kto")
    assert manifest["method"] == {
        "name": "kto",
        "trainer": "KTOTrainer",
        "beta": 0.1,
        "desirable_weight": 1.0,
        "undesirable_weight": 1.0,
    }
    assert set(manifest["inputs"]) == {"sft", "preferences"}
    assert manifest["reference"]["splits"] == {"train": "computed", "eval": "computed"}
    assert manifest["data"]["preferences"]["layouts"] == {
        str(tmp_path / "thumbs.jsonl"): "prompt-completion · standard"
    }
    again = json.loads(offline("kto", run_copy, thumbs).stdout)
    assert again["reference"]["splits"] == {"train": "reused", "eval": "reused"}
    assert again["metrics"]["eval_loss"] == pytest.approx(manifest["metrics"]["eval_loss"])


@pytest.mark.parametrize(
    ("method", "settings"),
    [
        ("orpo", {"name": "orpo", "trainer": "ORPOTrainer", "beta": 0.1, "start": "sft"}),
        ("simpo", {"name": "simpo", "trainer": "CPOTrainer", "beta": 2.0, "gamma": 0.5}),
    ],
)
def test_reference_free_methods_train_with_no_reference(
    run_copy: Path,  # noqa: F811
    method: str,
    settings: dict,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        manifest = trained(offline(method, run_copy), method)
    # the config asks for what TRL's pair collator needs, so TRL has nothing to warn about
    assert not [r for r in caplog.records if "remove_unused_columns" in r.getMessage()]
    assert manifest["method"] == settings
    assert manifest["reference"] is None
    assert "ref_logps" not in manifest["outputs"]
    assert not (Path(manifest["dir"]) / "ref_logps").exists()
    assert set(manifest["inputs"]) == {"sft", "preferences"}


def test_orpo_from_the_base_needs_no_sft(run_copy: Path) -> None:  # noqa: F811
    manifest = trained(offline("orpo", run_copy, "orpo.start=base"), "orpo")
    assert manifest["method"]["start"] == "base"
    assert set(manifest["inputs"]) == {"preferences"}


def one_line_refusal(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    return lines[0]


def test_kto_refuses_pairs_naming_their_layout(run_copy: Path) -> None:  # noqa: F811
    line = one_line_refusal(offline("kto", run_copy))
    assert "its rows are paired (preference · standard)" in line
    assert "rlhf kto needs one answer per row" in line and "`label` true/false" in line


@pytest.mark.parametrize("method", ["orpo", "simpo"])
def test_pair_methods_refuse_thumbs_rows_naming_their_layout(
    run_copy: Path,  # noqa: F811
    tmp_path: Path,
    method: str,
) -> None:
    thumbs = thumbs_rows(run_copy, tmp_path)
    line = one_line_refusal(offline(method, run_copy, f"data.preferences.path={thumbs}"))
    assert str(thumbs) in line
    assert "unpaired (prompt-completion · standard with `label`: KTO's" in line
    assert f"rlhf {method} needs a chosen and a rejected answer per row" in line
