"""Generate ``data/addition/``, the offline task with checkable answers (issue #53) that
recipes/smollm2-addition.yaml trains SmolLM2-135M-Instruct on with GRPO and
`builtin:math_accuracy`.

Synthetic, written for this project (CC0), like ``data/tiny``. Every small addition "What is
a + b?" with a from 1 to 20 and b from 1 to 9 (180 of them), with its sum as text in a
``solution`` column, the gold the reward reads. The scale: SmolLM2-135M-Instruct answers 14 of 40
right when greedy, graded by the last number it writes (2026-12-07): room to learn, and not
nothing to start from.

Files written:

* ``prompts.jsonl``  {"prompt", "solution"}: the 150 additions that are not among the 30 of
  ``data/eval/checks.jsonl`` (`rlhf eval`'s checks), in a seeded order. The recipe holds
  `data.prompts.eval_fraction` of them out of training for PPO's held-out evaluation.
* ``checks.jsonl``   {"prompt", "solution"}: those 30 additions of ``data/eval/checks.jsonl``
  alone (its 40 tone rows left out), so `rlhf eval`'s accuracy is the addition accuracy. No
  prompt string here is in ``prompts.jsonl``: the policy is graded on additions it never
  trained on.
* ``README.md``      what the files are and how they were made.

Run from the repository root:  python scripts/make_addition_data.py
Output is deterministic (random.Random(0)); stdlib only.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ROOT / "data" / "eval" / "checks.jsonl"
A_RANGE = range(1, 21)
B_RANGE = range(1, 10)

README = """\
# Small additions: an offline task with checkable answers

Synthetic data for `recipes/smollm2-addition.yaml` (GRPO with `builtin:math_accuracy`, issue
#53), written for this project (no third-party text). License: CC0 1.0 (public domain).

Every addition "What is a + b?" with a from 1 to 20 and b from 1 to 9 ({n_all} of them); the
`solution` column holds the sum as text, the gold that `builtin:math_accuracy` grades the
answer against (its last `\\boxed{{}}`, else its last number). SmolLM2-135M-Instruct gets 14 of
40 of them right when greedy (2026-12-07): room to learn, and not nothing to start from.

| file | rows | content |
|---|---|---|
| `prompts.jsonl` | {n_prompts} | `{{"prompt", "solution"}}`, every addition but the checks |
| `checks.jsonl` | {n_checks} | `{{"prompt", "solution"}}`, the additions among the checks |

`prompts.jsonl` is in a seeded order; the recipe holds `data.prompts.eval_fraction` of it out of
training for PPO's held-out evaluation. `checks.jsonl` is `rlhf eval`'s checks: the additions of
`data/eval/checks.jsonl` with its tone rows left out, so the accuracy is the addition accuracy.
No prompt of `checks.jsonl` is in `prompts.jsonl`: the policy is graded on additions it never
trained on.

Regenerate (deterministic, stdlib only): `python scripts/make_addition_data.py`
"""


def addition(a: int, b: int) -> dict[str, str]:
    return {"prompt": f"What is {a} + {b}?", "solution": str(a + b)}


def read_checks(path: Path) -> list[dict[str, str]]:
    """The additions among `rlhf eval`'s checks (rows with a `solution`), as written there."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return [{"prompt": r["prompt"], "solution": r["solution"]} for r in rows if "solution" in r]


def build(rng: random.Random, checks: list[dict[str, str]]) -> dict[str, list[dict[str, str]]]:
    every = [addition(a, b) for a in A_RANGE for b in B_RANGE]
    checked = {row["prompt"] for row in checks}
    prompts = [row for row in every if row["prompt"] not in checked]
    rng.shuffle(prompts)
    return {"prompts": prompts, "checks": checks, "every": every}


def check(data: dict[str, list[dict[str, str]]]) -> None:
    every, prompts, checks = data["every"], data["prompts"], data["checks"]
    assert all(row in every for row in checks), "a check is not an addition of the task"
    assert len(prompts) + len(checks) == len(every), "a check is twice in data/eval/checks.jsonl"
    assert not {r["prompt"] for r in prompts} & {r["prompt"] for r in checks}
    for row in prompts + checks:
        a, b = (int(x) for x in row["prompt"][len("What is ") : -1].split(" + "))
        assert row["solution"] == str(a + b), row


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def main(out_dir: Path = ROOT / "data" / "addition") -> None:
    data = build(random.Random(0), read_checks(CHECKS))
    check(data)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(out_dir / "prompts.jsonl", data["prompts"])
    write_jsonl(out_dir / "checks.jsonl", data["checks"])
    (out_dir / "README.md").write_text(
        README.format(
            n_all=len(data["every"]), n_prompts=len(data["prompts"]), n_checks=len(data["checks"])
        ),
        encoding="utf-8",
    )
    print(f"wrote {out_dir}: prompts={len(data['prompts'])} checks={len(data['checks'])}")


if __name__ == "__main__":
    main(*(Path(arg) for arg in sys.argv[1:2]))
