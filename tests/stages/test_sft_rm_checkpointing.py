"""SFT and reward training follow `model.gradient_checkpointing` (TRL's configs would turn it on
by default), and what they train keeps fp32 master weights: a QLoRA adapter (TRL casts it to
bf16) and a LoRA reward model's score head (peft leaves it in the base dtype)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from rlhf_cli.modeling import is_checkpointing
from rlhf_cli.recipe import Recipe, load_recipe
from rlhf_cli.record import StageRecord
from rlhf_cli.rundir import RunDir
from rlhf_cli.tracking import Trackers

pytestmark = pytest.mark.slow
QUIET = Console(stderr=True, quiet=True)
CPU = torch.device("cpu")


def tiny(small_recipe: Callable[..., Path], folder: Path, updates: dict[str, Any]) -> Recipe:
    return load_recipe(small_recipe(folder, updates))


def sft_one_step(recipe: Recipe) -> Any:
    """The SFT stage's trainer, trained for one step."""
    from rlhf_cli.stages.sft import setup

    run = RunDir.for_recipe(recipe)
    with StageRecord(run, "sft", recipe, inputs={}) as record:
        trackers = Trackers.for_stage(recipe.run, "sft", record.dir)
        trainer, _, _ = setup(recipe, run, record, QUIET, trackers)
        trained = {n: p.dtype for n, p in trainer.model.named_parameters() if p.requires_grad}
        trainer.args.max_steps = 1
        trainer.train()
    return trainer, trained


@pytest.mark.parametrize("checkpointing", [False, True])
def test_sft_follows_the_recipes_gradient_checkpointing(
    small_recipe, tmp_path: Path, checkpointing: bool
) -> None:
    recipe = tiny(
        small_recipe,
        tmp_path,
        {
            "model": {"gradient_checkpointing": checkpointing},
            "data": {"sft": {"max_samples": 24}},
        },
    )
    trainer, _ = sft_one_step(recipe)
    assert trainer.args.gradient_checkpointing is checkpointing
    assert trainer.args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert is_checkpointing(trainer.model) is checkpointing


def test_qlora_sft_checkpoints_and_keeps_fp32_adapter_weights(small_recipe, tmp_path: Path) -> None:
    recipe = tiny(
        small_recipe,
        tmp_path,
        {
            "model": {
                "gradient_checkpointing": True,
                "quantization": {"load_in_4bit": True, "compute_dtype": "float32"},
                "lora": {"r": 4, "alpha": 8},
            },
            "sft": {"full_finetune": False},
            "data": {"sft": {"max_samples": 24}},
        },
    )
    trainer, trained = sft_one_step(recipe)
    assert trained and all("lora_" in n for n in trained)
    assert set(trained.values()) == {torch.float32}  # TRL's cast to bf16 is undone
    assert is_checkpointing(trainer.model)
    assert trainer.state.global_step == 1


@pytest.mark.parametrize("checkpointing", [False, True])
def test_reward_training_follows_gradient_checkpointing_with_an_fp32_lora_head(
    small_recipe, tmp_path: Path, checkpointing: bool
) -> None:
    """A LoRA reward model on a bf16 base (no autocast on the CPU): the adapter and the score
    head train in fp32, and the head still scores the bf16 hidden states."""
    from rlhf_cli.stages.reward import pairwise_eval, setup, train

    recipe = tiny(
        small_recipe,
        tmp_path,
        {
            "model": {"gradient_checkpointing": checkpointing},
            "data": {"preferences": {"max_samples": 20, "eval_fraction": 0.2}},
            "reward": {
                "base_model": "builtin:tiny-lm",
                "dtype": "bfloat16",
                "lora": {"enabled": True, "r": 4, "alpha": 8},
            },
        },
    )
    run = RunDir.for_recipe(recipe)
    with StageRecord(run, "rm", recipe, inputs={}) as record:
        data = setup(recipe, run, CPU, record)
        trained = {n: p for n, p in data.scorer.model.named_parameters() if p.requires_grad}
        assert any("score" in n for n in trained) and any("lora_" in n for n in trained)
        assert {p.dtype for p in trained.values()} == {torch.float32}
        trackers = Trackers.for_stage(recipe.run, "rm", record.dir)
        result, held_out = train(recipe, data, CPU, (record, QUIET), trackers, None)
    assert result.global_step >= 1
    assert is_checkpointing(data.scorer.model) is checkpointing  # the trained, merged model
    assert held_out == pairwise_eval(data.scorer, data.eval_pairs)
    assert all(torch.isfinite(torch.tensor(v)) for v in held_out.values())
