"""Rule-based rewards for `reward.functions` (TRL's `reward_funcs` convention): each takes the
prompts and the responses and returns one float per response.

    reward:
      functions:
        - function: ../examples/rewards.py:politeness   # relative to the recipe's folder
          weight: 1.0
"""

from __future__ import annotations

POLITE = ("happy to", "glad", "of course", "great question", "certainly", "thanks", "good luck",
          "love to help", "here's")  # fmt: skip
CURT = ("can't be bothered", "figure it out", "everyone knows", "use your head", "do i look like",
        "next question", "whatever", "obviously")  # fmt: skip


def politeness(prompts: list[str], responses: list[str]) -> list[float]:
    """+1 for each polite phrase (at most 2), -1 for each curt one: the tiny data's preference
    written as a rule."""
    scores = []
    for response in responses:
        text = response.lower()
        polite = min(2, sum(phrase in text for phrase in POLITE))
        scores.append(float(polite - sum(phrase in text for phrase in CURT)))
    return scores
