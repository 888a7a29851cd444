"""The recipes with checkable answers (issue #53): smollm2-addition.yaml (offline, GRPO on the
instruct model as it comes) and qwen2.5-0.5b-gsm8k.yaml (the hub's GSM8K) validate, and their
reward, built as the stages build it (`frozen_scorer`, no reward model), is the math accuracy of
the answer against the row's `solution` column: for GSM8K, the worked solution whole, whose
`#### N` math-verify reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rlhf_cli.cli import app
from rlhf_cli.recipe import load_recipe
from rlhf_cli.stages.trained import frozen_scorer

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
GSM8K_GOLD = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


def validated(name: str) -> dict:
    result = CliRunner().invoke(app, ["validate", "--recipe", str(RECIPES / name), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_the_addition_recipe_is_grpo_on_the_instruct_model_with_no_reward_model() -> None:
    r = validated("smollm2-addition.yaml")
    assert r["model"]["name_or_path"] == "builtin:smollm2-135m"
    assert r["sft"]["enabled"] is False
    reward = r["reward"]
    assert (reward["pretrained"], reward["base_model"], reward["url"]) == (None, None, None)
    assert [f["function"] for f in reward["functions"]] == ["builtin:math_accuracy"]
    ppo = r["ppo"]
    assert (ppo["advantage_estimator"], ppo["num_generations"]) == ("grpo", 4)
    assert ppo["generation"]["max_new_tokens"] == 32
    assert r["data"]["prompts"]["min_words"] <= 5  # "What is 7 + 4?" is five words
    assert (r["eval"]["baseline"], r["eval"]["checks"]["grader"]) == ("base", "math")
    assert r["eval"]["checks"]["path"].endswith("data/addition/checks.jsonl")


def test_the_gsm8k_recipe_reads_the_hubs_gsm8k_with_its_answer_as_the_solution() -> None:
    r = validated("qwen2.5-0.5b-gsm8k.yaml")
    assert r["model"]["name_or_path"] == "Qwen/Qwen2.5-0.5B-Instruct"
    prompts = r["data"]["prompts"]
    assert (prompts["path"], prompts["name"], prompts["split"]) == ("openai/gsm8k", "main", "train")
    assert prompts["columns"] == {"prompt": "question", "solution": "answer"}
    assert [f["function"] for f in r["reward"]["functions"]] == ["builtin:math_accuracy"]
    assert r["sft"]["enabled"] is False and r["reward"]["pretrained"] is None
    ppo = r["ppo"]
    assert (ppo["advantage_estimator"], ppo["num_generations"]) == ("grpo", 5)  # verl's rollout.n
    assert (ppo["kl_in"], ppo["kl_estimator"], ppo["init_kl_coef"]) == ("loss", "k3", 0.001)


@pytest.mark.parametrize(
    ("name", "gold", "answers", "rewards"),
    [
        (
            "smollm2-addition.yaml",
            "7",
            ["\\boxed{7}", "8", "3 + 4 = 7.", "I cannot say."],
            [1, 0, 1, 0],
        ),
        (
            "qwen2.5-0.5b-gsm8k.yaml",
            GSM8K_GOLD,
            [
                "She sold \\boxed{72} clips.",
                "48 + 24 = 72, so 72 clips.",
                "\\boxed{24}",
                "72 - 48 = 24",
            ],
            [1, 1, 0, 0],
        ),
    ],
)
def test_the_reward_is_the_math_accuracy_on_the_solution_column(
    name, gold, answers, rewards
) -> None:
    scorer = frozen_scorer(load_recipe(RECIPES / name).reward, None, None, torch.device("cpu"))
    prompts = ["What is 3 + 4?"] * len(answers)
    scores = scorer.scored(prompts, answers, {"solution": [gold] * len(answers)})
    assert scores.rewards.tolist() == rewards
    assert scores.metrics["reward/no_answer_rate"] == (0.25 if "I cannot say." in answers else 0.0)
