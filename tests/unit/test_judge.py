"""The judge (`audit.judge`): the overoptimization decision on scripted (proxy, judge) series, the
agreement of two scorers on hand-written gains, the held-out judge metrics against hand-computed
numbers, the train-rm split of prompts between the reward model and the judge, and the recipe's
rules for both."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from rlhf_cli.audit.detectors import (
    change_se,
    fitted_change,
    judge_agreement,
    overoptimized,
)
from rlhf_cli.audit.measure import gain, judge_metrics, win_rate
from rlhf_cli.errors import DataError, RecipeError
from rlhf_cli.ppo.run import overoptimization
from rlhf_cli.recipe import load_recipe
from rlhf_cli.stages.reward import split_judge

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rewards.py"

# ── the overoptimization flag on scripted series ───────────────────────────────────────────────


def test_fitted_change_is_the_least_squares_line_across_the_window() -> None:
    assert fitted_change([1.0, 5.0, 2.0]) == pytest.approx(1.0)  # three points: last − first
    # x = 0..3, slope = Σ(x − 1.5)(y − ȳ) / Σ(x − 1.5)² = (−1.5·0 − 0.5·2 + 0.5·1 + 1.5·3) / 5 = 0.8
    assert fitted_change([0.0, 2.0, 1.0, 3.0]) == pytest.approx(0.8 * 3)


def test_rising_proxy_and_falling_judge_flag() -> None:
    series = [(0.1, 0.5), (0.4, 0.3), (0.9, 0.1)]
    assert overoptimized(series, window=3, margin=0.1)


@pytest.mark.parametrize(
    "series",
    [
        [(0.1, 0.1), (0.4, 0.3), (0.9, 0.6)],  # both rise: the policy improves
        [(0.9, 0.5), (0.4, 0.3), (0.1, 0.1)],  # both fall
        [(0.9, 0.1), (0.4, 0.3), (0.1, 0.6)],  # the proxy falls while the judge rises
    ],
)
def test_other_directions_do_not_flag(series: list[tuple[float, float]]) -> None:
    assert not overoptimized(series, window=3, margin=0.0)


def test_noise_under_the_margin_does_not_flag() -> None:
    series = [(0.50, 0.50), (0.58, 0.41), (0.55, 0.45)]  # proxy +0.05, judge −0.05
    assert not overoptimized(series, window=3, margin=0.1)
    assert overoptimized(series, window=3, margin=0.04)  # the same series beyond a small margin


def test_a_move_exactly_at_the_margin_does_not_flag() -> None:
    series = [(0.0, 1.0), (0.5, 0.75), (0.25, 0.5)]  # proxy +0.25, judge −0.5
    assert not overoptimized(series, window=3, margin=0.25)


def test_a_judge_fall_within_its_sampling_noise_does_not_flag() -> None:
    """Judge −0.4 over three evaluations (last − first), proxy +0.8, margin 0.1. Each judge
    reward's standard error 0.15: the fall's is 2·0.15·sqrt(1/2) = 0.2121 (the slope's error
    σ/sqrt(Σ(x − x̄)²) = 0.15/sqrt(2), times 2), so the fall must pass 0.1 + 2·0.2121 = 0.5243:
    no flag. At 0.05 each: 0.1 + 2·0.0707 = 0.2414 < 0.4: flagged."""
    series = [(0.1, 0.5), (0.5, 0.3), (0.9, 0.1)]
    assert change_se([0.15, 0.15, 0.15], 3) == pytest.approx(0.2121, abs=1e-4)
    assert not overoptimized(series, window=3, margin=0.1, judge_se=[0.15] * 3)
    assert overoptimized(series, window=3, margin=0.1, judge_se=[0.05] * 3)
    # only the window's errors count: a noisy evaluation before it does not hide the fall
    assert overoptimized([(0.0, 0.5), *series], window=3, margin=0.1, judge_se=[9.0, *[0.05] * 3])


def test_fewer_than_k_evaluations_do_not_flag() -> None:
    series = [(0.0, 1.0), (1.0, 0.0)]
    assert not overoptimized(series, window=3, margin=0.0)
    assert overoptimized(series, window=2, margin=0.0)


def test_only_the_last_k_evaluations_count() -> None:
    recovering = [(0.0, 1.0), (0.5, 0.5), (1.0, 0.0), (1.2, 0.1), (1.4, 0.2)]
    assert not overoptimized(recovering, window=3, margin=0.0)  # the judge rises again
    assert overoptimized(recovering, window=5, margin=0.0)  # though lower than it started
    assert overoptimized(recovering[:3], window=3, margin=0.0)


# ── the held-out evaluation's flag in training (ppo/run.py) ────────────────────────────────────


def judged_run(history: list[dict[str, Any]], rollbacks: list[dict[str, Any]]) -> Any:
    warned: list[str] = []
    judge = SimpleNamespace(window=3, margin=0.1)
    return SimpleNamespace(
        recipe=SimpleNamespace(audit=SimpleNamespace(judge=judge)),
        logs=SimpleNamespace(history=history, warn=warned.append, warned=warned),
        rollbacks=rollbacks,
    )


def evaluation(iteration: int, proxy: float, judge: float) -> dict[str, float]:
    return {"iteration": iteration, "eval/reward_gain": proxy, "eval/judge_reward_gain": judge}


def test_training_flags_over_this_and_the_earlier_evaluations() -> None:
    history = [evaluation(2, 0.0, 0.5), {"iteration": 3}, evaluation(4, 0.3, 0.3)]
    run = judged_run(history, rollbacks=[])
    assert overoptimization(run, 6, evaluation(6, 0.6, 0.1)) == {"audit/overoptimization": 1.0}
    assert run.logs.warned == [
        "iteration 6: overoptimization: over the last 3 held-out evaluations the proxy's reward "
        "rose while the judge's fell"
    ]
    rising = judged_run(history, rollbacks=[])
    assert overoptimization(rising, 6, evaluation(6, 0.6, 0.6)) == {"audit/overoptimization": 0.0}
    assert rising.logs.warned == []


def test_evaluations_before_a_rollback_do_not_count() -> None:
    history = [evaluation(2, 0.0, 0.5), evaluation(4, 0.3, 0.3)]
    run = judged_run(history, rollbacks=[{"iteration": 4, "restored": 2}])
    assert overoptimization(run, 6, evaluation(6, 0.6, 0.1)) == {"audit/overoptimization": 0.0}


def test_no_judge_metrics_no_flag() -> None:
    run = judged_run([], rollbacks=[])
    assert overoptimization(run, 2, {"iteration": 2, "eval/reward_mean": 1.0}) == {}


# ── agreement of the proxy and the judge (`rlhf audit`) ────────────────────────────────────────


def test_agreement_counts_the_same_preferred_answer_ties_included() -> None:
    proxy = [0.5, -0.2, 0.0, 0.3, 0.1]
    judge = [0.1, -0.4, 0.0, -0.2, 0.0]  # agree, agree, tie-tie, disagree, disagree (tie)
    report = judge_agreement(proxy, judge)
    assert report == {"judge_agreement": 3 / 5, "proxy_against_judge": 1 / 5, "flags": []}


def test_overoptimization_when_the_judge_prefers_the_reference_on_most_samples() -> None:
    assert judge_agreement([1.0, 1.0, 1.0, -1.0], [-1.0, -1.0, -1.0, -1.0])["flags"] == [
        "overoptimization"
    ]
    half = judge_agreement([1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, 1.0, 1.0])  # exactly half: no
    assert half["proxy_against_judge"] == 0.5 and half["flags"] == []


def test_agreement_needs_one_gain_of_each_per_sample() -> None:
    with pytest.raises(DataError):
        judge_agreement([1.0], [1.0, 2.0])
    with pytest.raises(DataError):
        judge_agreement([], [])


# ── the held-out judge metrics ─────────────────────────────────────────────────────────────────


def test_judge_metrics_by_hand() -> None:
    proxy, proxy_ref = torch.tensor([2.0, 3.0, 4.0]), torch.tensor([1.0, 2.0, 3.0])  # std 1
    judge, judge_ref = torch.tensor([0.0, 1.0, 1.0]), torch.tensor([1.0, 1.0, 3.0])
    metrics = judge_metrics((proxy, judge), (proxy_ref, judge_ref))
    judge_std = math.sqrt(((1 - 5 / 3) ** 2 * 2 + (3 - 5 / 3) ** 2) / 2)
    expected = {
        "eval/judge_reward_mean": 2 / 3,
        "eval/judge_reward_reference_mean": 5 / 3,
        "eval/judge_win_rate": (0 + 0.5 + 0) / 3,
        "eval/reward_gain": 1.0,
        "eval/judge_reward_gain": -1.0 / judge_std,
        "eval/proxy_judge_gap": 1.0 + 1.0 / judge_std,
        # the policy's judge scores 0, 1, 1: std sqrt(1/3), over sqrt(3), in judge_std units
        "eval/judge_reward_gain_se": math.sqrt(1 / 3) / math.sqrt(3) / judge_std,
    }
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value), key


def test_a_gain_over_alike_reference_scores_is_in_raw_units() -> None:
    assert gain(torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.5])) == pytest.approx(1.0)
    assert gain(torch.tensor([3.0]), torch.tensor([1.0])) == pytest.approx(2.0)  # one prompt
    assert_close(win_rate(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0])), 0.75)


# ── train-rm's split of prompts ────────────────────────────────────────────────────────────────


def pairs_of(prompts: list[str]) -> list[dict[str, str]]:
    return [{"prompt": p, "chosen": f"yes {i}", "rejected": "no"} for i, p in enumerate(prompts)]


def test_the_judge_gets_a_share_of_the_prompts_with_all_their_pairs() -> None:
    prompts = [f"q{i}" for i in range(20)] * 2  # every prompt twice
    proxy, judge = split_judge(pairs_of(prompts), 0.25, seed=0)
    judged = {p["prompt"] for p in judge}
    assert len(judged) == 5 and len(judge) == 10 and len(proxy) == 30
    assert judged.isdisjoint(p["prompt"] for p in proxy)
    assert split_judge(pairs_of(prompts), 0.25, seed=0) == (proxy, judge)  # the seed decides
    assert {p["prompt"] for p in split_judge(pairs_of(prompts), 0.25, seed=1)[1]} != judged


def test_no_judge_fraction_no_judge_pairs() -> None:
    pairs = pairs_of(["a", "b"])
    assert split_judge(pairs, 0.0, seed=0) == (pairs, [])


# ── the recipe ─────────────────────────────────────────────────────────────────────────────────


def test_no_judge_by_default(make_recipe) -> None:
    recipe = load_recipe(make_recipe())
    assert recipe.audit.judge is None and recipe.reward.judge_fraction == 0.0


def test_a_judge_of_rule_functions_or_train_rm(make_recipe) -> None:
    rules = {"functions": [{"function": f"{EXAMPLE}:politeness", "weight": 2.0}], "window": 4}
    recipe = load_recipe(make_recipe({"audit": {"judge": rules}}))
    assert recipe.audit.judge.functions[0].weight == 2.0 and recipe.audit.judge.window == 4
    trained = {"reward": {"judge_fraction": 0.3}, "audit": {"judge": {"from_rm": True}}}
    assert load_recipe(make_recipe(trained)).audit.judge.from_rm


@pytest.mark.parametrize(
    ("updates", "message"),
    [
        ({"audit": {"judge": {}}}, "the judge needs audit.judge.pretrained"),
        (
            {"audit": {"judge": {"from_rm": True, "pretrained": "builtin:minilm"}}},
            "not both",
        ),
        ({"audit": {"judge": {"from_rm": True, "input": "pair"}}}, "drop audit.judge.input"),
        ({"audit": {"judge": {"from_rm": True, "window": 1}}}, "audit.judge.window"),
        ({"audit": {"judge": {"pretrained": "./nowhere"}}}, "judge model folder not found"),
        ({"reward": {"judge_fraction": 0.6}}, "reward.judge_fraction"),
        (
            {"reward": {"base_model": None, "pretrained": "builtin:minilm", "judge_fraction": 0.2}},
            "the judge is trained by `rlhf train-rm`",
        ),
    ],
)
def test_judge_recipe_mistakes_are_one_line(make_recipe, updates, message) -> None:
    with pytest.raises(RecipeError, match=message):
        load_recipe(make_recipe(updates))
