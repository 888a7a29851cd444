"""Rule-based rewards for `reward.functions` (TRL's `reward_funcs` convention): each takes the
prompts and the responses and returns one float per response.

    reward:
      functions:
        - function: ../examples/rewards.py:politeness   # relative to the recipe's folder
          weight: 1.0
"""

from __future__ import annotations

import re

# The tiny data's tone as phrases (scripts/make_tiny_data.py: its polite openers and sign-offs,
# its dismissive replies, templates and wrappers), lower case. tests/unit/test_rewards_rule.py
# checks the rule scores every chosen reply of data/tiny/preferences.jsonl above its rejected one.
POLITE = ("happy to help", "great question", "sure thing", "of course", "good question",
          "glad", "thanks for asking", "absolutely", "here's how", "certainly",
          "no problem at all", "here's a simple way", "i can help", "good thinking",
          "nice question", "love to help", "hope that helps", "good luck", "enjoy",
          "have a great day", "feel free", "hope this is useful", "take care", "best of luck",
          "you've got this", "let me know", "happy to explain")  # fmt: skip
CURT = ("not my problem", "figure it out", "figure out", "someone else", "why would i know",
        "do i look like", "google it", "not my job", "dumb", "can't be bothered", "stop asking",
        "who cares", "go away", "use your head", "next question", "not worth my time",
        "read the manual", "seriously", "ugh", "bother", "everyone knows", "whatever",
        "leave me alone", "my concern", "not doing this", "on your own", "don't care",
        "stop wasting", "obviously", "done", "not hard", "come on", "why ask me", "look it up",
        "do i have to", "was that so hard")  # fmt: skip


def politeness(prompts: list[str], responses: list[str]) -> list[float]:
    """+1 for each polite phrase (at most 2), -1 for each curt one: the tiny data's preference
    written as a rule, blind to length (the full answer and its gist score alike)."""
    scores = []
    for response in responses:
        polite = min(2, sum(_has(response, phrase) for phrase in POLITE))
        scores.append(float(polite - sum(_has(response, phrase) for phrase in CURT)))
    return scores


def _has(text: str, phrase: str) -> bool:
    """`phrase` as whole words, any case: `ugh` is not found in `through`."""
    return re.search(rf"(?<!\w){re.escape(phrase)}(?!\w)", text, re.IGNORECASE) is not None
