"""Verifiable checks (`eval.checks`): answers graded against a `solution` (TRL's column name) and
against IFEval-style instructions, with accuracy and its binomial standard error.

A row is correct when its solution grades right and all its instructions pass. `math` grading
follows TRL's `accuracy_reward`: the gold is parsed first (a gold math-verify cannot read is a
DataError at `read_checks`, before any answer is generated, not a row silently wrong for ever),
then the answer taken from the last `\\boxed{}`, or failing that the last number; an answer
with neither is counted as `no_answer` and is wrong, never skipped.

Why a process, not math-verify's own timeout: math-verify bounds parse and verify with
`signal.alarm`, which works in the main thread only (Math-Verify #50, TRL PR #5281: called
from a worker thread it raises), and a thread stuck in a pathological sympy call cannot be
killed. So its timeouts are off (`parsing_timeout=None`, `timeout_seconds=None`) and each
answer's parse-and-verify runs in a worker process with a deadline of `timeout_s`; past it the
worker is killed, replaced, and the answer counts as wrong (`timeout`). `regex` grading runs
there too, under the same deadline: a pattern can backtrack for ever as well. The worker is a
plain subprocess, warmed before the first deadline, so its start-up is never charged to an
answer.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf_cli.data.rows import describe, prompt_turns
from rlhf_cli.data.sources import json_lines
from rlhf_cli.errors import DataError
from rlhf_cli.grading import (
    BOXED,
    TIMEOUT,
    WORKER,
    bounded,
    extract_answer,
    require_math_verify,
)
from rlhf_cli.recipe.eval import ChecksSection

# ── instruction checks (IFEval-style), each a pure function of the answer ───────────────────────


def max_words(answer: str, n: int) -> bool:
    return len(answer.split()) <= n


def min_words(answer: str, n: int) -> bool:
    return len(answer.split()) >= n


def _has_word(answer: str, word: str) -> bool:
    """`word` (or a phrase) as whole words, any case: `egg` is not found in `eggplant`."""
    return re.search(rf"(?<!\w){re.escape(word)}(?!\w)", answer, re.IGNORECASE) is not None


def include_words(answer: str, words: list[str]) -> bool:
    return all(_has_word(answer, word) for word in words)


def include_any(answer: str, words: list[str]) -> bool:
    """At least one of `words`: a tone or a register shown by any of its phrases."""
    return any(_has_word(answer, word) for word in words)


def exclude_words(answer: str, words: list[str]) -> bool:
    return not any(_has_word(answer, word) for word in words)


def lowercase(answer: str) -> bool:
    """Letters, all lower case (an answer without a letter does not pass)."""
    return answer.islower()


def valid_json(answer: str) -> bool:
    """The answer is one JSON value; a Markdown code fence around it is allowed, as IFEval's."""
    text = answer.strip().removeprefix("```json").removeprefix("```").removesuffix("```")
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


# name -> (the check, its arguments and their kinds: `count` a positive integer, `words` a
# non-empty list of texts)
CHECKS: dict[str, tuple[Callable[..., bool], dict[str, str]]] = {
    "max_words": (max_words, {"n": "count"}),
    "min_words": (min_words, {"n": "count"}),
    "include_words": (include_words, {"words": "words"}),
    "include_any": (include_any, {"words": "words"}),
    "exclude_words": (exclude_words, {"words": "words"}),
    "lowercase": (lowercase, {}),
    "json": (valid_json, {}),
}


# ── reading the checks file ─────────────────────────────────────────────────────────────────────


def read_checks(cfg: ChecksSection) -> list[dict[str, Any]]:
    """The rows of `cfg.path` (at most `max_rows`): `{"prompt": conversation, "solution": text
    or None, "instructions": [{"check": name, ...arguments}], "where": "file:line"}`. A row
    that cannot be checked as written (no prompt, nothing to check, an unknown check, a bad
    argument, a pattern that does not compile, a gold math-verify cannot parse) is a DataError
    naming its file and line."""
    path = Path(cfg.path)
    rows = []
    for number, values in json_lines(path, lambda exc: f"not valid JSON ({exc.msg})"):
        where = f"{path}:{number}"
        if not isinstance(values, dict):
            raise DataError(f"{where}: a row must be a JSON object")
        rows.append(_row(values, where, cfg.grader))
        if len(rows) == cfg.max_rows:
            break
    if not rows:
        raise DataError(f"{path}: no rows to check")
    if cfg.grader == "math":
        _check_golds([row for row in rows if row["solution"] is not None], cfg.timeout_s)
    return rows


def _row(values: dict[str, Any], where: str, grader: str) -> dict[str, Any]:
    if ("prompt" in values) == ("messages" in values):
        raise DataError(f"{where}: a row needs `prompt` or `messages` (one of them)")
    column = "prompt" if "prompt" in values else "messages"
    solution = _solution(values.get("solution"), where, grader)
    instructions = _instructions(values.get("instructions"), where)
    if solution is None and not instructions:
        raise DataError(f"{where}: nothing to check: give `solution`, `instructions` or both")
    return {"prompt": prompt_turns(values[column], where, column), "solution": solution,
            "instructions": instructions, "where": where}  # fmt: skip


def _solution(value: Any, where: str, grader: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: column `solution` holds {describe(value)}; expected text")
    if grader == "regex":
        try:
            re.compile(value)
        except re.error as exc:
            raise DataError(f"{where}: `solution` is not a regular expression ({exc})") from None
    return value


def _instructions(value: Any, where: str) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise DataError(
            f"{where}: column `instructions` holds {describe(value)}; expected a list of "
            '{"check": name, ...arguments}'
        )
    return [_instruction(item, f"{where}: instruction {n}") for n, item in enumerate(value, 1)]


def _instruction(item: Any, label: str) -> dict[str, Any]:
    if not isinstance(item, dict) or "check" not in item:
        raise DataError(f'{label} is {describe(item)}; expected {{"check": name, ...arguments}}')
    name, arguments = item["check"], _arguments(item)
    if name not in CHECKS:
        shown = name if isinstance(name, str) else describe(name)
        raise DataError(f"{label}: unknown check `{shown}`; expected one of {', '.join(CHECKS)}")
    kinds = CHECKS[name][1]
    if set(arguments) != set(kinds):
        wanted = ", ".join(f"`{k}`" for k in kinds) or "no arguments"
        given = ", ".join(f"`{k}`" for k in arguments) or "none"
        raise DataError(f"{label}: check `{name}` takes {wanted}; given {given}")
    for key, kind in kinds.items():
        _argument(arguments[key], kind, f"{label}: check `{name}` argument `{key}`")
    return dict(item)


def _argument(value: Any, kind: str, label: str) -> None:
    if kind == "count":
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise DataError(f"{label} is {describe(value)}; expected a whole number of 1 or more")
    elif not (
        isinstance(value, list) and value and all(isinstance(w, str) and w.strip() for w in value)
    ):
        raise DataError(f"{label} is {describe(value)}; expected a list of words")


def _check_golds(rows: list[dict[str, Any]], timeout_s: float) -> None:
    """Each math gold parses (in the worker, under the deadline, as answers are graded)."""
    if not rows:
        return
    require_math_verify()
    parsed = bounded([["gold", row["solution"]] for row in rows], timeout_s, WORKER)
    for row, ok in zip(rows, parsed, strict=True):
        if ok is not True:
            why = f"took over {timeout_s:g} s" if ok == TIMEOUT else "found no expression"
            raise DataError(f"{row['where']}: math-verify cannot parse `solution` ({why})")


# ── grading ─────────────────────────────────────────────────────────────────────────────────────


def grade(cfg: ChecksSection, rows: list[dict[str, Any]], answers: list[str]) -> dict[str, Any]:
    """`answers[i]` (to `rows[i]`) graded: `accuracy` and its binomial `se`, the counts
    `no_answer` and `timeouts`, each instruction's pass rate, and per row `correct`, `reason`
    (None when correct; else `wrong`, `no_answer`, `timeout`: no verdict within `timeout_s`, or
    `instructions`), the answer extracted (math) and each instruction's pass. Safe to call from
    any thread."""
    if len(answers) != len(rows):
        raise ValueError(f"{len(answers)} answers to {len(rows)} rows")
    is_math = cfg.grader == "math"
    if is_math and any(row["solution"] is not None for row in rows):
        require_math_verify()
    extracted = [
        extract_answer(answer) if is_math and row["solution"] is not None else None
        for row, answer in zip(rows, answers, strict=True)
    ]
    verdicts = _verdicts(cfg, rows, extracted if is_math else answers)
    results = [
        _row_result(*result) for result in zip(rows, answers, verdicts, extracted, strict=True)
    ]
    return _summary(results, cfg.grader)


def _verdicts(
    cfg: ChecksSection, rows: list[dict[str, Any]], answers: list[str | None]
) -> list[str | None]:
    """Per row: None (no solution), `correct`, `wrong`, `no_answer` or `timeout`; math and
    regex in the bounded worker, exact and contains here (they cannot hang)."""
    out: list[str | None] = [None] * len(rows)
    in_worker = []
    for i, (row, answer) in enumerate(zip(rows, answers, strict=True)):
        if row["solution"] is None:
            continue
        if answer is None or not answer.strip():
            out[i] = "no_answer"
        elif cfg.grader in ("math", "regex"):
            in_worker.append(i)
        else:
            out[i] = _plain_verdict(cfg.grader, row["solution"], answer)
    jobs = [["verdict", cfg.grader, rows[i]["solution"], answers[i]] for i in in_worker]
    verdicts = bounded(jobs, cfg.timeout_s, WORKER)
    for i, verdict in zip(in_worker, verdicts, strict=True):
        out[i] = verdict
    return out


def _plain_verdict(grader: str, solution: str, answer: str) -> str:
    if grader == "exact":
        right = answer.strip() == solution.strip()
    else:  # contains
        right = solution.strip() in answer
    return "correct" if right else "wrong"


def _row_result(
    row: dict[str, Any], answer: str, verdict: str | None, extracted: str | None
) -> dict[str, Any]:
    passes = [
        {"check": i["check"], "passed": CHECKS[i["check"]][0](answer, **_arguments(i))}
        for i in row["instructions"]
    ]
    if verdict not in (None, "correct"):
        reason = verdict
    else:
        reason = None if all(p["passed"] for p in passes) else "instructions"
    return {"where": row["where"], "correct": reason is None, "reason": reason,
            "solution": verdict, "extracted": extracted, "instructions": passes}  # fmt: skip


def _arguments(instruction: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in instruction.items() if k != "check"}


def _summary(results: list[dict[str, Any]], grader: str) -> dict[str, Any]:
    n = len(results)
    correct = sum(r["correct"] for r in results)
    accuracy = correct / n
    instructions: dict[str, dict[str, Any]] = {}
    for passed in (p for r in results for p in r["instructions"]):
        tally = instructions.setdefault(passed["check"], {"n": 0, "passed": 0})
        tally["n"] += 1
        tally["passed"] += passed["passed"]
    for tally in instructions.values():
        tally["pass_rate"] = tally["passed"] / tally["n"]
    return {"grader": grader, "n": n, "correct": correct, "accuracy": accuracy,
            "se": math.sqrt(accuracy * (1 - accuracy) / n),
            "no_answer": sum(r["reason"] == "no_answer" for r in results),
            "timeouts": sum(r["reason"] == TIMEOUT for r in results),
            "instructions": instructions, "rows": results}  # fmt: skip


# ── the bounded worker ──────────────────────────────────────────────────────────────────────────


def serve() -> None:
    """The worker's loop. Its results go to a copy of stdout, and stdout itself to stderr, so
    that nothing a library prints can break the protocol."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeouts are off": on purpose
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's: it kills this worker
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    jobs = {"warm": _warm, "verdict": _verdict, "gold": _gold_parses}
    for line in sys.stdin:
        name, *args = json.loads(line)
        replies.write(json.dumps(jobs[name](*args)) + "\n")
        replies.flush()


def _warm() -> None:
    """A first parse and verify (sympy's imports), where math-verify is installed."""
    if importlib.util.find_spec("math_verify") is not None:
        _math_verdict("1", "1")


def _verdict(grader: str, solution: str, answer: str) -> str:
    """One answer graded against its solution."""
    if grader == "regex":
        return "correct" if re.search(solution, answer) else "wrong"
    return _math_verdict(solution, answer)


def _parse_gold(gold: str) -> list:
    """A gold as written (`19`, `$\\frac{1}{2}$`), else as a boxed expression (`x^2`); the
    expressions math-verify read, without its fallback of the raw text (a gold it cannot read
    would then match only itself, letter for letter)."""
    from math_verify import LatexExtractionConfig, parse

    return parse(gold, fallback_mode="no_fallback", parsing_timeout=None) or parse(
        f"{BOXED}{gold}}}",
        [LatexExtractionConfig()],
        fallback_mode="no_fallback",
        parsing_timeout=None,
    )


def _gold_parses(gold: str) -> bool:
    return bool(_parse_gold(gold))


def _math_verdict(gold: str, answer: str) -> str:
    """The gold parsed first, then the extracted answer, then math-verify's comparison; its own
    signal timeouts off (see the module's docstring)."""
    from math_verify import LatexExtractionConfig, parse, verify

    gold_parsed = _parse_gold(gold)
    answer_parsed = parse(f"{BOXED}{answer}}}", [LatexExtractionConfig()], parsing_timeout=None)
    if not answer_parsed:
        return "no_answer"
    return "correct" if verify(gold_parsed, answer_parsed, timeout_seconds=None) else "wrong"
