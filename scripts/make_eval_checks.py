"""Generate ``data/eval/checks.jsonl``, the offline verifiable checks of the demo and the tests
(`eval.checks`, `rlhf_cli/evals/checks.py`).

Synthetic, written for this project (CC0), like ``data/tiny``. Two kinds of row, shuffled
together so that `max_rows` takes some of each:

* 30 small additions, ``{"prompt": "What is 7 + 12?", "solution": "19"}``: a from 1 to 20 plus
  b from 1 to 9 (the task of issue #53), graded by math-verify from the last ``\\boxed{}`` or
  the last number of the answer. The tiny model was never taught arithmetic: its score here is
  a floor; a real model's is not.
* 10 prompts on the tiny data's topics, each with IFEval-style ``instructions`` and no
  solution: the answer names the topic's key thing (``include_words``, a word of the helpful
  answer that no dismissive reply holds), uses none of the dismissive replies' words
  (``exclude_words``) and stays within 30 words (``max_words``: the tiny data's polite replies
  have at most 25, so a policy that pads its answers fails). Checked below: every polite reply
  the tiny data can hold for the topic passes, every dismissive one fails.

The prompts carry a lead-in that no tiny data file uses, so no prompt string here was trained
on (the topics were).

Run from the repository root:  .venv/bin/python scripts/make_eval_checks.py
Output is deterministic (random.Random(0)).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from make_tiny_data import (
    MAX_RESPONSE_WORDS,
    POLITE_CLOSERS,
    POLITE_OPENERS,
    PROMPT_PREFIXES,
    RUDE_GENERIC,
    RUDE_TEMPLATES,
    TOPICS,
)

from rlhf_cli.evals.checks import CHECKS

OUT = Path(__file__).resolve().parent.parent / "data" / "eval" / "checks.jsonl"
N_ADDITIONS = 30
LEAD_IN = "Please help me with this. "
MAX_WORDS = 30
# words of the dismissive replies that no polite one uses
RUDE_WORDS = ["whatever", "yourself", "dumb", "ugh", "bother", "seriously", "obviously", "google"]
# question (as in the tiny data's table) -> a word or phrase of its helpful answer
KEYWORDS = {
    "How do I boil an egg properly?": "water",
    "How should I make a good cup of tea?": "steep",
    "How do I fix a flat tire on my bike?": "sandpaper",
    "How do I clean the inside of my oven?": "baking soda",
    "How can I unclog a slow kitchen drain?": "vinegar",
    "How do I sharpen a kitchen knife at home?": "whetstone",
    "What can I do to soothe a sore throat?": "gargle",
    "How do I paint a wall in my room?": "primer",
    "How can I make my phone battery last longer?": "brightness",
    "How do I create a strong password?": "phrase",
}


def additions(rng: random.Random) -> list[dict]:
    pairs = rng.sample([(a, b) for a in range(1, 21) for b in range(1, 10)], N_ADDITIONS)
    return [{"prompt": f"What is {a} + {b}?", "solution": str(a + b)} for a, b in pairs]


def instruction_rows() -> list[dict]:
    return [
        {
            "prompt": LEAD_IN + question,
            "instructions": [
                {"check": "include_words", "words": [keyword]},
                {"check": "exclude_words", "words": RUDE_WORDS},
                {"check": "max_words", "n": MAX_WORDS},
            ],
        }
        for question, keyword in KEYWORDS.items()
    ]


def passes(reply: str, instructions: list[dict]) -> bool:
    return all(
        CHECKS[i["check"]][0](reply, **{k: v for k, v in i.items() if k != "check"})
        for i in instructions
    )


def check(rows: list[dict]) -> None:
    """Each instruction row passes its topic's helpful answer and every polite reply the tiny
    data can hold for it (any opener, any closer within its word limit), and fails every
    dismissive one."""
    topics = {question: (answer, gist) for question, _, answer, gist in TOPICS}
    assert not any(LEAD_IN.strip() in prefix for prefix, _ in PROMPT_PREFIXES)
    for row in rows:
        if "instructions" not in row:
            continue
        answer, gist = topics[row["prompt"].removeprefix(LEAD_IN)]
        assert passes(answer, row["instructions"]), row["prompt"]
        replies = [f"{o} {answer}" for o in POLITE_OPENERS]
        replies += [f"{r} {c}" for r in replies for c in POLITE_CLOSERS]
        polite = [r for r in replies if len(r.split()) <= MAX_RESPONSE_WORDS]
        assert all(passes(reply, row["instructions"]) for reply in polite)
        rude = [t.format(g=gist, G=gist[0].upper() + gist[1:]) for t in RUDE_TEMPLATES]
        rude += RUDE_GENERIC
        assert not any(passes(reply, row["instructions"]) for reply in rude), row["prompt"]
    assert len({row["prompt"] for row in rows}) == len(rows), "duplicate prompts"


def main() -> None:
    rng = random.Random(0)
    rows = additions(rng) + instruction_rows()
    rng.shuffle(rows)
    check(rows)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    print(f"wrote {OUT}: {N_ADDITIONS} additions, {len(KEYWORDS)} instruction rows")


if __name__ == "__main__":
    main()
