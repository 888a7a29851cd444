"""PPO's start-up checks, before any training: context and reward-model fit, and PPO prompts
the reward model was trained on."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlhf_cli.recipe import Recipe, parse_recipe
from rlhf_cli.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
TINY = yaml.safe_load((REPO / "recipes" / "tiny.yaml").read_text())


def _recipe(tmp_path: Path) -> Recipe:
    data = yaml.safe_load(yaml.safe_dump(TINY))
    data["run"]["output_dir"] = str(tmp_path / "runs")
    return parse_recipe(yaml.safe_dump(data), "r.yaml", base_dir=REPO / "recipes")


def _fake_model(context: int, vocab: int = 100):
    from types import SimpleNamespace

    import torch

    embeddings = torch.nn.Embedding(vocab, 2)
    return SimpleNamespace(
        config=SimpleNamespace(max_position_embeddings=context),
        get_input_embeddings=lambda: embeddings,
    )


def test_mismatches_are_caught_before_training(tmp_path):
    """The checks `generation_engine` and the reward scorer run before any text reaches a
    model, at their boundaries: a sum that fits exactly passes, one token more is refused."""
    from rlhf_cli.errors import ModelLoadError
    from rlhf_cli.model_checks import check_context, check_vocab

    recipe = _recipe(tmp_path)  # prompts 64 tokens + 32 new, reward max_length 128
    lengths = {"data.prompts.max_tokens": 64, "ppo.generation.max_new_tokens": 32}
    check_context(_fake_model(96), lengths, "the policy")  # fits exactly
    with pytest.raises(ModelLoadError, match=r"= 96\) exceeds the policy's context of 95"):
        check_context(_fake_model(95), lengths, "the policy")
    rm = {"reward.max_length": recipe.reward.max_length}
    check_context(_fake_model(128), rm, "the reward model")
    with pytest.raises(ModelLoadError, match=r"reward.max_length \(128\) exceeds .* 127"):
        check_context(_fake_model(127), rm, "the reward model")
    check_vocab(_fake_model(128), list(range(100)), "reward.tokenizer", "the reward model")
    with pytest.raises(ModelLoadError, match="101 tokens but the reward model only 100"):
        check_vocab(_fake_model(128), list(range(101)), "reward.tokenizer", "the reward model")


def test_prompt_overlap_with_reward_training_is_counted(tmp_path):
    import json

    from rlhf_cli.rundir import atomic_write_json
    from rlhf_cli.stages.ppo import prompt_overlap

    run = RunDir.for_recipe(_recipe(tmp_path))
    (run.stage_dir("rm")).mkdir(parents=True)
    atomic_write_json(run.stage_dir("rm") / "train_prompts.json", ["seen one", "seen two"])
    atomic_write_json(
        run.manifest_path("rm"),
        {"status": "completed", "outputs": {"train_prompts": "train_prompts.json"}},
    )
    assert prompt_overlap(run, ["seen one", "fresh", "seen two", "seen one"]) == 3
    assert json.loads(run.manifest_path("rm").read_text())["status"] == "completed"
