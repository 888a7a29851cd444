"""`rlhf dpo` end to end on the tiny run: it trains (the held-out margin rises, the loss falls
from log 2), keeps the reference's log-probs and reuses them with no reference forward, computes
them again when the pairs change, and refuses unpaired rows in one line."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlhf_cli.cli import app
from rlhf_cli.recipe import load_recipe
from rlhf_cli.tracking import read_metrics

pytestmark = pytest.mark.slow

# a few steps: 96 pairs (about 82 trained on, 14 held out), 16 a step, a learning rate LoRA
# moves at
DPO = [
    "dpo.learning_rate=1e-3",
    "dpo.batch_size=16",
    "dpo.max_length=128",
    "dpo.logging_steps=1",
    "data.preferences.max_samples=96",
]


@pytest.fixture(scope="module")
def sft_run(sft_folder: Callable[[str, dict], Path]) -> Path:
    """A tiny SFT run, once for the module; each test copies its folder."""
    return sft_folder("dpo_sft", {"sft": {"epochs": 1}, "data": {"sft": {"max_samples": 160}}})


@pytest.fixture
def run_copy(sft_run: Path, tmp_path: Path, small_recipe: Callable[..., Path]) -> Path:
    """The SFT run copied into this test's folder; its recipe's path."""
    shutil.copytree(sft_run / "runs", tmp_path / "runs")
    return small_recipe(tmp_path, {"sft": {"epochs": 1}, "data": {"sft": {"max_samples": 160}}})


@pytest.fixture
def reference_forwards(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts TRL's reference forwards (each batch of `compute_ref_log_probs`), the one way
    TRL's DPOTrainer computes the reference's log-probs when they are precomputed."""
    from trl import DPOTrainer

    calls: list[int] = []
    original = DPOTrainer.compute_ref_log_probs

    def counted(self, model, inputs):
        calls.append(len(inputs["input_ids"]))
        return original(self, model, inputs)

    monkeypatch.setattr(DPOTrainer, "compute_ref_log_probs", counted)
    return calls


def dpo(recipe: Path, *sets: str):
    args = ["dpo", "--recipe", str(recipe), "--json"]
    for item in [*DPO, *sets]:
        args += ["--set", item]
    return CliRunner().invoke(app, args)


def test_dpo_trains_and_a_rerun_reuses_the_reference_log_probs(
    run_copy: Path, reference_forwards: list[int]
) -> None:
    result = dpo(run_copy)
    assert result.exit_code == 0, result.output
    assert "Computing reference log probs" not in result.stderr  # TRL's tqdm, off under --json
    manifest = json.loads(result.stdout)
    stage = Path(manifest["dir"])
    metrics = manifest["metrics"]
    pairs = metrics["train_rows"] + metrics["eval_rows"]
    # every pair's chosen and rejected answer scored once by the reference: train, then held out
    assert pairs >= 90 and sum(reference_forwards) == 2 * pairs
    assert manifest["reference"]["splits"] == {"train": "computed", "eval": "computed"}
    assert manifest["method"]["loss_type"] == ["sigmoid"]
    assert set(manifest["inputs"]) == {"sft", "preferences"}
    assert (stage / "adapter" / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in (stage / "ref_logps").iterdir()) == [
        "eval.safetensors",
        "train.safetensors",
    ]

    # it learnt the preference: from log 2 (policy = reference), the held-out loss fell and the
    # margin rose, and the training rows log TRL's metrics
    assert metrics["eval_loss_start"] == pytest.approx(math.log(2), abs=1e-5)
    assert metrics["eval_loss"] < metrics["eval_loss_start"] - 0.01
    assert metrics["eval_rewards/margins"] > 0.05
    rows = [r for r in read_metrics(stage / "metrics.jsonl") if "rewards/margins" in r]
    assert len(rows) == metrics["steps"] == math.ceil(metrics["train_rows"] / 16)
    assert rows[-1]["rewards/margins"] > rows[0]["rewards/margins"]
    assert rows[-1]["loss"] < rows[0]["loss"]
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen"):
        assert name in rows[-1]

    # a rerun: the kept log-probs, not one reference forward, and the same training
    reference_forwards.clear()
    again = dpo(run_copy)
    assert again.exit_code == 0, again.output
    rerun = json.loads(again.stdout)
    assert reference_forwards == []
    assert rerun["reference"]["splits"] == {"train": "reused", "eval": "reused"}
    assert rerun["metrics"]["eval_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-6)


def test_changed_pairs_or_sft_compute_the_reference_log_probs_again(
    run_copy: Path, reference_forwards: list[int], tmp_path: Path
) -> None:
    def reference_splits(*sets: str) -> dict[str, str]:
        reference_forwards.clear()
        result = dpo(run_copy, *sets)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["reference"]["splits"]

    assert reference_splits() == {"train": "computed", "eval": "computed"}
    pairs = tmp_path / "pairs.jsonl"
    source = load_recipe(run_copy).data.preferences.path
    rows = [json.loads(line) for line in Path(source).read_text().splitlines() if line.strip()]
    rows[0]["chosen"] = rows[0]["chosen"] + " Thank you for asking."  # one answer changed
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    changed = f"data.preferences.path={pairs}"
    assert "computed" in reference_splits(changed).values()
    assert sum(reference_forwards) > 0

    # the same pairs on an SFT model made again (its manifest names another attempt)
    assert reference_splits(changed) == {"train": "reused", "eval": "reused"}
    sft_manifest = tmp_path / "runs" / "tiny" / "sft" / "manifest.json"
    made = json.loads(sft_manifest.read_text())
    sft_manifest.write_text(json.dumps({**made, "finished_at": "2030-01-01T00:00:00+00:00"}))
    assert reference_splits(changed) == {"train": "computed", "eval": "computed"}
    assert sum(reference_forwards) > 0


def test_dpo_refuses_unpaired_rows_naming_their_layout(run_copy: Path, tmp_path: Path) -> None:
    rows = [
        {"prompt": "Can you help me?", "completion": "Of course, gladly.", "label": True},
        {"prompt": "Can you help me?", "completion": "No.", "label": False},
    ]
    kto = tmp_path / "thumbs.jsonl"
    kto.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = CliRunner().invoke(
        app, ["dpo", "--recipe", str(run_copy), "--set", f"data.preferences.path={kto}"]
    )
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert str(kto) in lines[0]
    assert "unpaired (prompt-completion · standard with `label`: KTO's" in lines[0]
    assert "`chosen`, `rejected`" in lines[0]
