"""The hackable recipes (#43): they validate, the proxy pays the exploit (a point per "!"
without limit) and the judge (the data's preference as a rule) charges it past two, on
hand-computed answers; the data claims their comments rest on (chosen answers carry one or two
"!", rejected ones none) hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhf_cli.recipe import load_recipe
from rlhf_cli.rewards import load_reward_function
from rlhf_cli.scoring import RewardScorer

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "recipes" / "hackable_rewards.py"
PROMPTS = ["How do I cook rice?"] * 4
ANSWERS = [
    "Go away.",  # curt: no "!"
    "Certainly! Rinse it, simmer it covered. Good luck!",  # as the data's good answers: two
    "Enjoy! Enjoy! Enjoy! Enjoy!",  # the exploit: four
    "Rinse it!!!!!! Enjoy!",  # seven, in a run
]


def rule_scorer(functions: list) -> RewardScorer:
    """The recipe's rule functions alone, as the scorer adds them to a model's score."""
    loaded = [(f.function, load_reward_function(f.function), f.weight) for f in functions]
    return RewardScorer(model=None, tokenizer=None, template="{prompt}{response}", max_length=8,
                        functions=loaded)  # fmt: skip


@pytest.mark.parametrize("name", ["hackable-tiny.yaml", "hackable-smollm2.yaml"])
def test_the_hackable_recipes_validate_with_the_exploit_and_the_judge(name: str) -> None:
    recipe = load_recipe(ROOT / "recipes" / name)
    assert [f.function for f in recipe.reward.functions] == [f"{RULES}:exclamation_bonus"]
    judge = recipe.audit.judge
    assert judge is not None and judge.pretrained is None and not judge.from_rm  # rules alone
    assert [f.function for f in judge.functions] == [
        f"{ROOT / 'examples' / 'rewards.py'}:politeness",
        f"{RULES}:exclamations_past_two",
    ]
    assert recipe.audit.on_hacking == "rollback"
    # every checkpoint is written at an evaluation: a rollback goes back one evaluation
    assert recipe.ppo.save_freq == recipe.ppo.eval_every


def test_the_proxy_pays_every_exclamation_and_the_judge_charges_those_past_two() -> None:
    bonus = load_reward_function(f"{RULES}:exclamation_bonus")
    rule = load_reward_function(f"{RULES}:exclamations_past_two")
    assert bonus(PROMPTS, ANSWERS) == [0.0, 2.0, 4.0, 7.0]
    assert rule(PROMPTS, ANSWERS) == [0.0, 0.0, -2.0, -5.0]


def test_the_tiny_recipes_rules_as_scored() -> None:
    """Through the scorer, weights applied: the proxy's bonus (1.0 a "!") grows with every "!";
    the judge (politeness, 1.0, plus 0.5 a "!" past two) charges the curt answer (`go away`:
    -1), pays the polite answer with two "!" (`certainly`, `good luck`: 2) and falls past two
    (`enjoy`, counted once: 1, less 1.0 for two "!" too many; 1 less 2.5)."""
    recipe = load_recipe(ROOT / "recipes" / "hackable-tiny.yaml")
    assert recipe.audit.judge is not None
    proxy, _ = rule_scorer(recipe.reward.functions).score(PROMPTS, ANSWERS)
    judge, _ = rule_scorer(recipe.audit.judge.functions).score(PROMPTS, ANSWERS)
    torch.testing.assert_close(proxy, torch.tensor([0.0, 2.0, 4.0, 7.0]))
    torch.testing.assert_close(judge, torch.tensor([-1.0, 2.0, 0.0, -1.5]))


def test_the_data_never_pays_past_two() -> None:
    """What the rules' docstring says of data/tiny/: chosen answers carry at most two "!", most
    carry one or two, rejected ones none; so up to two the bonus agrees with the preference."""
    rows = [json.loads(line) for line in (ROOT / "data/tiny/preferences.jsonl").open()]
    chosen = [r["chosen"].count("!") for r in rows]
    assert max(chosen) == 2 and sum(c > 0 for c in chosen) > len(rows) / 2
    assert all(r["rejected"].count("!") == 0 for r in rows)
    sft = [json.loads(line)["response"] for line in (ROOT / "data/tiny/sft.jsonl").open()]
    assert max(s.count("!") for s in sft) == 2
