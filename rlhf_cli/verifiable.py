"""The built-in verifiable rewards (`reward.functions: [{function: builtin:<name>}]`), for tasks
whose answers a program can check (the guide's "reasoning tasks, DeepSeek-style"):

- `math_accuracy`: 1 when the answer equals the row's `solution` under math-verify, else 0
  (TRL's `accuracy_reward`). The answer is the last `\\boxed{}`'s content, else the text after
  the last `marker` (option; GSM8K's `####`), else, with no marker set, the last number
  (`grading.extract_answer`, as `rlhf eval`'s checks read it). Graded in their worker process
  under a deadline (`timeout_s`), so it works from any thread (Math-Verify #50). No answer
  found scores 0 and is counted (`no_answer_rate`), as are a verdict past its deadline
  (`timeout_rate`) and a row with no `solution` (`no_solution_rate`): the scorer logs them,
  never a silent 0 (verl PR #7789).
- `think_format`: 1 when the response is one `<think>...</think>` block followed by an answer.
- `overlong`: DAPO's soft overlong punishment (eq. 13): 0 up to `max_length - cache` tokens,
  then linear down to -1 at `max_length`, -1 beyond; `max_length` (option, required: the
  generation's `max_new_tokens`) and `cache` (option; default a fifth of `max_length`, DAPO's
  4096 of 20480).

Options are given in the recipe (`options: {marker: "####"}`); a built-in's keyword-only
argument without a default is a required option."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from rlhf_cli.grading import BOXED, TIMEOUT, extract_answer, math_verdicts
from rlhf_cli.recipe.names import BUILTIN_REWARDS


class Rewards(list):
    """A reward function's values with counts the scorer logs (`metrics`, e.g. `no_answer`:
    responses a verifier found no answer in), so no built-in's 0 is silent."""

    def __init__(self, values: list[float], metrics: dict[str, float]):
        super().__init__(values)
        self.metrics = metrics


THINK = re.compile(r"\s*<think>(?:(?!<think>).)*?</think>\s*\S", re.DOTALL)


def answer_of(response: str, marker: str | None) -> str | None:
    """The answer graded: the last `\\boxed{}`'s content, else the text after the last `marker`
    (the number in it when there is one), else, without a marker, the last number; None when
    there is none."""
    if marker is None or BOXED in response:
        return extract_answer(response)
    if marker not in response:
        return None
    after = response.rpartition(marker)[2].strip()
    return (extract_answer(after) or after.split("\n")[0].strip()) or None


def math_accuracy(
    prompts: list[str],
    responses: list[str],
    solution: list[Any],
    *,
    marker: str | None = None,
    timeout_s: float = 5.0,
) -> Rewards:
    """1.0 for each response whose answer (`answer_of`) math-verify finds equal to its row's
    `solution` (the gold parsed first), else 0.0; the shares with no answer, no verdict in time
    and no solution in `metrics`."""
    answers = [answer_of(r, marker) for r in responses]
    graded = [
        i for i, a in enumerate(answers) if a is not None and a.strip() and solution[i] is not None
    ]
    verdicts = dict.fromkeys(range(len(responses)), "no_answer")
    for i in range(len(responses)):
        if solution[i] is None:
            verdicts[i] = "no_solution"
    found = math_verdicts(
        [str(solution[i]) for i in graded], [answers[i] for i in graded], timeout_s
    )
    verdicts.update(zip(graded, found, strict=True))
    n = max(len(responses), 1)
    counts = list(verdicts.values())
    return Rewards(
        [float(verdicts[i] == "correct") for i in range(len(responses))],
        {
            "no_answer_rate": counts.count("no_answer") / n,
            "timeout_rate": counts.count(TIMEOUT) / n,
            "no_solution_rate": counts.count("no_solution") / n,
        },
    )


def think_format(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 for a response that opens with one `<think>...</think>` block and then answers
    (TRL's `think_format_reward`), else 0.0."""
    return [float(THINK.match(r) is not None) for r in responses]


def overlong(
    prompts: list[str],
    responses: list[str],
    completion_ids: list[list[int]],
    *,
    max_length: int,
    cache: int | None = None,
) -> list[float]:
    """DAPO's soft overlong punishment of each response's length |y| in tokens (eq. 13):
    0 for |y| <= L_max - L_cache, (L_max - L_cache - |y|) / L_cache up to L_max, -1 beyond."""
    cache = max(1, max_length // 5) if cache is None else cache
    if not 0 < cache <= max_length:
        raise ValueError(f"overlong: cache {cache} must be in 1..max_length ({max_length})")
    out = []
    for ids in completion_ids:
        over = len(ids) - (max_length - cache)
        out.append(0.0 if over <= 0 else max(-1.0, -over / cache))
    return out


BUILTINS: dict[str, Callable[..., Any]] = {
    "math_accuracy": math_accuracy,
    "think_format": think_format,
    "overlong": overlong,
}
assert tuple(BUILTINS) == BUILTIN_REWARDS
