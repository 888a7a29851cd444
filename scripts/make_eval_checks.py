"""Generate ``data/eval/checks.jsonl``, the offline verifiable checks of the demo and the tests
(`eval.checks`, `rlhf_cli/evals/checks.py`).

Synthetic, written for this project (CC0), like ``data/tiny``. Two kinds of row, shuffled
together so that `max_rows` takes some of each:

* 30 small additions, ``{"prompt": "What is 7 + 12?", "solution": "19"}``: a from 1 to 20 plus
  b from 1 to 9 (the task of issue #53), graded by math-verify from the last ``\\boxed{}`` or
  the last number of the answer. The tiny model was never taught arithmetic: its score here is
  a floor; a real model's is not.
* 40 prompts, each with IFEval-style ``instructions`` and no solution, grading the tiny data's
  one preference, tone: the answer holds a polite phrase (``include_any``), none of the
  dismissive ones (``exclude_words``), and stays within 30 words (``max_words``: the tiny data's
  replies have at most 25, so a policy that pads its answers fails). The phrases are those of
  the demo's rule judge (examples/rewards.py), whole words, any case. 35 of the prompts ask
  about the tiny data's topics, 5 about the audit's topics, found in no training file. Checked
  below: every polite reply the tiny data can hold for a topic passes, long or short, and every
  dismissive one fails, long or short, so length cannot pass a row.

The prompts carry a lead-in that no tiny data file uses, so no prompt string here was trained
on (the topics were).

Run from the repository root:  .venv/bin/python scripts/make_eval_checks.py
Output is deterministic (random.Random(0)).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from make_tiny_data import (
    AUDIT_PROMPTS,
    MAX_RESPONSE_WORDS,
    POLITE_CLOSERS,
    POLITE_OPENERS,
    PROMPT_PREFIXES,
    RUDE_CLOSERS,
    RUDE_GENERIC,
    RUDE_OPENERS,
    RUDE_TEMPLATES,
    TOPICS,
)

from rlhf_cli.evals.checks import CHECKS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from rewards import CURT, POLITE  # noqa: E402  (the demo's rule judge)

OUT = Path(__file__).resolve().parent.parent / "data" / "eval" / "checks.jsonl"
N_ADDITIONS = 30
LEAD_IN = "Please help me with this. "
MAX_WORDS = 30
N_TOPIC_ROWS = 35


def additions(rng: random.Random) -> list[dict]:
    pairs = rng.sample([(a, b) for a in range(1, 21) for b in range(1, 10)], N_ADDITIONS)
    return [{"prompt": f"What is {a} + {b}?", "solution": str(a + b)} for a, b in pairs]


def tone_rows(rng: random.Random) -> list[dict]:
    questions = [q for q, _, _, _ in rng.sample(TOPICS, N_TOPIC_ROWS)] + AUDIT_PROMPTS
    instructions = [
        {"check": "include_any", "words": list(POLITE)},
        {"check": "exclude_words", "words": list(CURT)},
        {"check": "max_words", "n": MAX_WORDS},
    ]
    return [{"prompt": LEAD_IN + q, "instructions": instructions} for q in questions]


def passes(reply: str, instructions: list[dict]) -> bool:
    return all(
        CHECKS[i["check"]][0](reply, **{k: v for k, v in i.items() if k != "check"})
        for i in instructions
    )


def check(rows: list[dict]) -> None:
    """Each tone row passes every polite reply the tiny data can hold for its topic (any opener,
    the full answer or the gist, any closer within its word limit) and fails every dismissive
    one (short, templated, or the full answer wrapped in rude words)."""
    assert not any(LEAD_IN.strip() in prefix for prefix, _ in PROMPT_PREFIXES)
    for row in rows:
        if "instructions" not in row:
            continue
        for answer, gist in [(a, g) for _, _, a, g in TOPICS]:
            bodies = [answer, f"Just {gist}."]
            polite = [f"{o} {b}" for o in POLITE_OPENERS for b in bodies]
            polite += [f"{r} {c}" for r in polite for c in POLITE_CLOSERS]
            polite = [r for r in polite if len(r.split()) <= MAX_RESPONSE_WORDS]
            assert all(passes(reply, row["instructions"]) for reply in polite), row["prompt"]
            rude = [t.format(g=gist, G=gist[0].upper() + gist[1:]) for t in RUDE_TEMPLATES]
            rude += RUDE_GENERIC + [f"{o} {answer}" for o in RUDE_OPENERS]
            rude += [f"{answer} {c}" for c in RUDE_CLOSERS]
            assert not any(passes(reply, row["instructions"]) for reply in rude), row["prompt"]
    assert len({row["prompt"] for row in rows}) == len(rows), "duplicate prompts"


def main() -> None:
    rng = random.Random(0)
    rows = additions(rng) + tone_rows(rng)
    rng.shuffle(rows)
    check(rows)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    print(f"wrote {OUT}: {N_ADDITIONS} additions, {N_TOPIC_ROWS + len(AUDIT_PROMPTS)} tone rows")


if __name__ == "__main__":
    main()
