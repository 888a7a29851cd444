"""SFT and reward-model stages end to end on the tiny recipe (shortened), on the CPU."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from rlhf_cli.errors import StageError
from rlhf_cli.recipe import Recipe, load_recipe
from rlhf_cli.record import require
from rlhf_cli.rundir import RunDir
from rlhf_cli.tracking import read_metrics

pytestmark = pytest.mark.slow
QUIET = Console(stderr=True, quiet=True)


def trained(
    small_recipe: Callable[..., Path], folder: Path, updates: dict[str, Any], stage: str
) -> tuple[Recipe, dict[str, Any]]:
    from rlhf_cli.stages.reward import run_train_rm
    from rlhf_cli.stages.sft import run_sft

    recipe = load_recipe(small_recipe(folder, updates))
    manifest = (run_sft if stage == "sft" else run_train_rm)(recipe, QUIET)
    return recipe, manifest


@pytest.fixture(scope="module")
def sft_full(small_recipe, tmp_path_factory) -> tuple[Recipe, dict[str, Any]]:
    return trained(small_recipe, tmp_path_factory.mktemp("sft_full"), {}, "sft")


@pytest.fixture(scope="module")
def sft_lora(small_recipe, tmp_path_factory) -> tuple[Recipe, dict[str, Any]]:
    updates = {
        "sft": {"full_finetune": False, "epochs": 1},
        "data": {"sft": {"max_samples": 160}},
        "model": {"lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}},
    }
    return trained(small_recipe, tmp_path_factory.mktemp("sft_lora"), updates, "sft")


@pytest.fixture(scope="module")
def rm(small_recipe, tmp_path_factory) -> tuple[Recipe, dict[str, Any]]:
    updates = {"data": {"preferences": {"max_samples": 120, "eval_fraction": 0.2}}}
    return trained(small_recipe, tmp_path_factory.mktemp("rm"), updates, "rm")


# ── SFT, full fine-tuning (the tiny recipe's setting) ───────────────────────────────────────


def test_sft_manifest_is_completed(sft_full) -> None:
    recipe, manifest = sft_full
    run = RunDir.for_recipe(recipe)
    on_disk = json.loads(run.manifest_path("sft").read_text())
    assert on_disk == manifest
    assert manifest["stage"] == "sft" and manifest["status"] == "completed"
    assert manifest["recipe_sha256"] == recipe.sha256()
    assert manifest["inputs"] == {}
    assert manifest["outputs"] == {
        "model": "model",
        "tokenizer": "tokenizer",
        "metrics": "metrics.jsonl",
    }
    assert manifest["metrics"]["train_rows"] == 360 and manifest["metrics"]["eval_rows"] == 40
    assert (run.output_dir / "LATEST").read_text().strip() == recipe.run.name
    assert load_recipe(run.recipe_path()).sha256() == recipe.sha256()
    assert require(run, "sft", needed_by="test")["status"] == "completed"


def test_sft_lowers_the_held_out_loss(sft_full) -> None:
    metrics = sft_full[1]["metrics"]
    assert metrics["eval_loss"] < metrics["eval_loss_start"] - 1.0
    assert metrics["steps"] == 2 * 23  # ceil(360 / 16) steps per epoch, two epochs


def test_sft_metrics_jsonl_has_the_training_log(sft_full) -> None:
    recipe, manifest = sft_full
    rows = read_metrics(RunDir.for_recipe(recipe).stage_dir("sft") / "metrics.jsonl")
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) >= 5  # logging_steps 5 over 46 steps
    assert losses[-1] < losses[0]
    # held out: before training, after the first epoch, and once at the end (the second
    # epoch's own evaluation would measure the same weights as the final one)
    evaluated = [r["step"] for r in rows if "eval_loss" in r]
    assert evaluated == [0, 23, 46], evaluated
    assert rows[-1]["eval_loss"] == manifest["metrics"]["eval_loss"]


def test_sft_model_and_tokenizer_reload(sft_full) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe, manifest = sft_full
    run = RunDir.for_recipe(recipe)
    model_dir = run.resolve_output("sft", manifest, "model")
    tok_dir = run.resolve_output("sft", manifest, "tokenizer")
    assert (model_dir / "config.json").is_file() and not (run.stage_dir("sft") / "adapter").exists()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    assert tokenizer.padding_side == "left"  # saved for generation downstream
    assert tokenizer.pad_token == "<pad>"
    ids = tokenizer(["How do I keep my kitchen knives sharp?"], return_tensors="pt")
    with torch.no_grad():
        assert torch.isfinite(model(**ids).logits).all()


def test_sft_weights_changed_from_the_base(sft_full) -> None:
    from transformers import AutoModelForCausalLM

    from rlhf_cli.modeling import resolve_model_path

    recipe, manifest = sft_full
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(recipe.model.name_or_path))
    tuned = AutoModelForCausalLM.from_pretrained(
        RunDir.for_recipe(recipe).resolve_output("sft", manifest, "model")
    )
    base_w = dict(base.named_parameters())
    changed = [n for n, p in tuned.named_parameters() if not torch.equal(p, base_w[n])]
    assert len(changed) == len(base_w)  # full fine-tuning: every tensor moves


def test_disabled_sft_is_a_stage_error(small_recipe, tmp_path: Path) -> None:
    from rlhf_cli.stages.sft import run_sft

    recipe = load_recipe(small_recipe(tmp_path, {"sft": {"enabled": False}}))
    with pytest.raises(StageError, match="sft.enabled is false"):
        run_sft(recipe, QUIET)
    assert not (tmp_path / "runs").exists()


def test_prompts_that_fill_sft_max_length_are_reported(small_recipe, tmp_path: Path) -> None:
    """The tiny chat template's prompts of the first 40 rows take 13 to 20 tokens. TRL drops a
    row whose answer the cut at max_length removes entirely: at 12 every row goes (one line
    naming the field, not the trainer's KeyError later), at 18 some do (a manifest warning,
    the kept counts in the metrics)."""
    from rlhf_cli.stages.sft import run_sft

    data = {"sft": {"max_samples": 40, "eval_fraction": 0.4}}
    recipe = load_recipe(small_recipe(tmp_path, {"data": data, "sft": {"max_length": 12}}))
    with pytest.raises(StageError, match=r"sft.max_length \(12\) leaves no answer token in any"):
        run_sft(recipe, QUIET)
    sft = {"max_length": 18, "epochs": 0.1}
    manifest = run_sft(load_recipe(small_recipe(tmp_path, {"data": data, "sft": sft})), QUIET)
    dropped = [w for w in manifest["warnings"] if "their prompts fill sft.max_length (18)" in w]
    assert dropped
    kept = manifest["metrics"]["train_rows"] + manifest["metrics"]["eval_rows"]
    assert 0 < kept < 40


# ── SFT with LoRA ───────────────────────────────────────────────────────────────────────────


def test_lora_sft_writes_an_adapter(sft_lora) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlhf_cli.modeling import resolve_model_path

    recipe, manifest = sft_lora
    run = RunDir.for_recipe(recipe)
    assert manifest["status"] == "completed"
    assert manifest["outputs"]["adapter"] == "adapter"
    assert "model" not in manifest["outputs"] and not (run.stage_dir("sft") / "model").exists()
    assert manifest["metrics"]["eval_loss"] < manifest["metrics"]["eval_loss_start"]
    adapter = run.resolve_output("sft", manifest, "adapter")
    assert (adapter / "adapter_config.json").is_file()
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 8 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]

    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(recipe.model.name_or_path))
    model = PeftModel.from_pretrained(base, str(adapter))
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # B starts at zero: it trained


# ── reward model ────────────────────────────────────────────────────────────────────────────


def test_rm_manifest_and_accuracy(rm) -> None:
    recipe, manifest = rm
    run = RunDir.for_recipe(recipe)
    assert json.loads(run.manifest_path("rm").read_text()) == manifest
    assert manifest["status"] == "completed" and manifest["stage"] == "rm"
    metrics = manifest["metrics"]
    assert metrics["eval_accuracy"] >= 0.75
    assert metrics["train_pairs"] == 96 and metrics["eval_pairs"] == 24
    assert metrics["truncated_texts"] == 0 and manifest["warnings"] == []
    assert manifest["template"] == recipe.reward.template
    assert manifest["input"] == recipe.reward.input == "template"  # the tiny recipe's choice
    evaluation = json.loads((run.stage_dir("rm") / "eval.json").read_text())
    assert evaluation["after"]["accuracy"] == metrics["eval_accuracy"]
    assert evaluation["eval_pairs"] == 24
    assert not (run.stage_dir("sft")).exists()  # train-rm does not need sft


def test_rm_model_reloads_and_prefers_chosen(rm) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_cli.scoring import RewardScorer

    recipe, manifest = rm
    run = RunDir.for_recipe(recipe)
    model_dir = run.resolve_output("rm", manifest, "model")
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(run.resolve_output("rm", manifest, "tokenizer"))
    assert model.config.num_labels == 1
    scorer = RewardScorer(
        model, tokenizer, recipe.reward.template, recipe.reward.max_length, input="template"
    )
    prompt = "How do I keep my kitchen knives sharp?"
    scores, n_truncated = scorer.score(
        [prompt, prompt],
        [
            "Happy to help. Hone them before each use and sharpen them on a stone twice a year.",
            "Figure it out yourself.",
        ],
    )
    assert n_truncated == 0 and scores.shape == (2,)
    assert scores[0] > scores[1]
    train_prompts = json.loads((run.stage_dir("rm") / "train_prompts.json").read_text())
    assert len(train_prompts) <= 96 and train_prompts == sorted(train_prompts)


def test_pair_input_trains_on_the_scorers_encoding_with_its_token_types(
    small_recipe, tmp_path: Path
) -> None:
    """`reward.input: pair` on MiniLM: train-rm's chosen / rejected rows are the scorer's
    encoding, `tokenizer(prompt, answer)` with its token types, and those types reach the model
    in training (TRL's own collator would drop them)."""
    from rlhf_cli.record import StageRecord
    from rlhf_cli.stages.reward import setup, train
    from rlhf_cli.tracking import Trackers

    updates = {
        "data": {"preferences": {"max_samples": 20, "eval_fraction": 0.2}},
        "reward": {"input": "pair", "batch_size": 8},
    }
    recipe, cpu = load_recipe(small_recipe(tmp_path, updates)), torch.device("cpu")
    run = RunDir.for_recipe(recipe)
    with StageRecord(run, "rm", recipe, inputs={}) as record:
        data = setup(recipe, run, cpu, record)
        prompts = [p["prompt"] for p in data.train_pairs]
        for side in ("chosen", "rejected"):
            answers = [p[side] for p in data.train_pairs]
            tokenized = data.scorer.tokenizer(prompts, answers)
            features, _ = data.scorer.encode(prompts, answers)
            assert data.train_ds[f"{side}_ids"] == features["input_ids"]
            assert data.train_ds[f"{side}_ids"] == tokenized["input_ids"]
            assert data.train_ds[f"{side}_token_type_ids"] == features["token_type_ids"]
            assert data.train_ds[f"{side}_token_type_ids"] == tokenized["token_type_ids"]
        assert data.n_truncated == 0 and data.scorer.input == "pair"
        seen: list[torch.Tensor] = []
        data.scorer.model.register_forward_pre_hook(
            lambda module, args, kwargs: (
                seen.append(kwargs.get("token_type_ids")) if module.training else None
            ),
            with_kwargs=True,
        )
        train(
            recipe,
            data,
            cpu,
            (record, QUIET),
            Trackers.for_stage(recipe.run, "rm", record.dir),
            None,
        )
    assert seen and all(types is not None and types.max() == 1 for types in seen)


def test_pretrained_reward_is_a_stage_error(small_recipe, tmp_path: Path) -> None:
    from rlhf_cli.stages.reward import run_train_rm

    recipe = load_recipe(
        small_recipe(tmp_path, {"reward": {"base_model": None, "pretrained": "builtin:minilm"}})
    )
    with pytest.raises(StageError, match="reward.pretrained is set"):
        run_train_rm(recipe, QUIET)
