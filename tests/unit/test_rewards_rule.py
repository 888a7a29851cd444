"""The demo's rule judge (examples/rewards.py `politeness`), the tone yardstick of `make demo`
(`audit.judge`) and of data/eval/checks.jsonl's tone rows, is the tiny data's preference as
written: it ranks every pair of data/tiny/preferences.jsonl as the data does, and length does not
move it. The data itself no longer ties the preference to length (issue #51: every chosen reply
was the longer, and the reward model learnt length)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from rewards import politeness  # noqa: E402

PAIRS = [json.loads(line) for line in (ROOT / "data/tiny/preferences.jsonl").open()]


def words(text: str) -> int:
    return len(text.split())


def test_the_rule_ranks_every_pair_as_the_data_does() -> None:
    prompts = [p["prompt"] for p in PAIRS]
    chosen = politeness(prompts, [p["chosen"] for p in PAIRS])
    rejected = politeness(prompts, [p["rejected"] for p in PAIRS])
    assert all(c > r for c, r in zip(chosen, rejected, strict=True))


def test_the_rule_is_blind_to_length_and_to_words_inside_others() -> None:
    answers = [
        "Of course! Just boil it.",  # short polite
        "Of course! Place it in boiling water for nine minutes, then cool it in cold water.",
        "Ugh, fine. Place it in boiling water for nine minutes, then cool it in cold water.",
        "Pull it up through the loop.",  # `ugh` inside `through` is no word of the rule's
    ]
    assert politeness([""] * 4, answers) == [1.0, 1.0, -1.0, 0.0]


def test_length_does_not_tell_which_reply_is_preferred() -> None:
    """Chosen the longer in about half the pairs (it was every pair), a median ratio near 1."""
    longer = sum(words(p["chosen"]) > words(p["rejected"]) for p in PAIRS) / len(PAIRS)
    ratio = statistics.median(words(p["chosen"]) / words(p["rejected"]) for p in PAIRS)
    assert 0.35 < longer < 0.65 and 0.75 < ratio < 1.33
