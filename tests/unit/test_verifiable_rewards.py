"""The built-in verifiable rewards: math accuracy graded by math-verify (gold first) in the
checks' bounded worker, from a worker thread, with no answer found counted; the think format;
DAPO's overlong punishment against hand-computed values; names and options at recipe load."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from rlhf_cli.rewards import load_reward_function
from rlhf_cli.scoring import RewardScorer


def test_math_accuracy_grades_from_a_worker_thread_and_counts_no_answer() -> None:
    pytest.importorskip("math_verify")
    fn = load_reward_function("builtin:math_accuracy")
    responses = ["so it is \\boxed{1/2}", "\\boxed{3}", "I think 7, no, 42", "no idea", "9"]
    solution = ["0.5", "4", "42", "1", None]
    scorer = RewardScorer(None, None, "{p}{r}", 8, functions=[("builtin:math_accuracy", fn, 1.0)])
    with ThreadPoolExecutor(
        1
    ) as pool:  # math-verify's own signal timeouts fail off the main thread
        scored = pool.submit(scorer.scored, ["q"] * 5, responses, {"solution": solution}).result(
            timeout=300
        )
    assert scored.rewards.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert scored.metrics["reward/no_answer_rate"] == pytest.approx(1 / 5)
    assert scored.metrics["reward/no_solution_rate"] == pytest.approx(1 / 5)
    assert scored.metrics["reward/timeout_rate"] == 0.0


def test_a_marker_takes_the_answer_after_it_and_nothing_else() -> None:
    pytest.importorskip("math_verify")
    fn = load_reward_function("builtin:math_accuracy", {"marker": "####"})
    rewards = fn(["q"] * 3, ["3 apples, 5 pears\n#### 8", "it is 8", "#### 1,000"],
                 solution=["8", "8", "1000"])  # fmt: skip
    assert list(rewards) == [1.0, 0.0, 1.0]  # "it is 8" has no marker: no answer
    assert rewards.metrics["no_answer_rate"] == pytest.approx(1 / 3)


def test_think_format() -> None:
    fn = load_reward_function("builtin:think_format")
    responses = [
        "<think>add them</think> 5",
        "<think>add them</think>",
        "5",
        "<think>a<think>b</think> 5",
        "  <think>\nx\n</think>\n\nThe answer: 5",
    ]
    assert fn([""] * 5, responses) == [1.0, 0.0, 0.0, 0.0, 1.0]


def test_overlong_is_dapos_soft_punishment() -> None:
    fn = load_reward_function("builtin:overlong", {"max_length": 10, "cache": 4})
    ids = [[0] * n for n in (3, 6, 7, 8, 10, 12)]
    # 0 up to 10 - 4 = 6 tokens, then (6 - |y|) / 4, -1 at and past 10
    assert fn([""] * 6, [""] * 6, completion_ids=ids) == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    default = load_reward_function("builtin:overlong", {"max_length": 10})  # cache 10 // 5 = 2
    assert default([""], [""], completion_ids=[[0] * 9]) == [-0.5]


def test_builtin_names_and_options_are_checked_at_load() -> None:
    with pytest.raises(ValueError, match="no built-in reward 'accuracy'.*builtin:math_accuracy"):
        load_reward_function("builtin:accuracy")
    with pytest.raises(ValueError, match="needs the option max_length"):
        load_reward_function("builtin:overlong")
    with pytest.raises(ValueError, match="takes no option colour"):
        load_reward_function("builtin:think_format", {"colour": 1})


def test_a_recipe_names_a_builtin_with_its_options(make_recipe) -> None:
    from rlhf_cli.errors import RecipeError
    from rlhf_cli.recipe import load_recipe

    function = {"function": "builtin:overlong", "options": {"max_length": 32}}
    recipe = load_recipe(make_recipe({"reward": {"functions": [function]}}))
    loaded = recipe.reward.functions[0].load()
    assert loaded([""], [""], completion_ids=[[0] * 32]) == [-1.0]
    bad = make_recipe({"reward": {"functions": [{"function": "builtin:overlong"}]}}, "bad.yaml")
    with pytest.raises(RecipeError, match="reward.functions.0: .*needs the option max_length"):
        load_recipe(bad)
