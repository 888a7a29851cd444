"""`rlhf eval`'s verifiable checks (#51 item 4): math-verify grading called from a worker thread
with a deadline that holds there (math-verify's own signal timeouts do not), exact / contains /
regex, the IFEval-style instruction checks, accuracy and its binomial standard error against
hand counts, and a bad row named by file and line."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rlhf_cli.errors import DataError, EvalError
from rlhf_cli.evals import checks
from rlhf_cli.evals.checks import CHECKS, extract_answer, grade, read_checks
from rlhf_cli.recipe.eval import ChecksSection

REPO = Path(__file__).resolve().parents[2]


def write_rows(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "checks.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def in_a_thread(function, *args):
    """`function(*args)` run in a worker thread, as the eval stage runs its suites."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(function, *args).result()


def test_the_answer_is_the_last_closed_box_else_the_last_number():
    assert extract_answer("first \\boxed{1}, then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_answer("\\boxed{\\frac{x^{2}}{2}} since 3 < 4") == "\\frac{x^{2}}{2}"
    assert extract_answer("\\boxed{5} and a box cut off: \\boxed{\\frac{1}{") == "5"
    assert extract_answer("7 + 12 = 19.") == "19"
    assert extract_answer("about 1,000 apples and -2.5 pears") == "-2.5"
    assert extract_answer("1,000 apples") == "1000"
    assert extract_answer("I do not know.") is None


def test_math_verify_own_timeouts_fail_outside_the_main_thread():
    """The trap (Math-Verify #50, TRL #5281): what `grade` must not rely on."""
    from math_verify import parse

    with pytest.raises(ValueError, match="threaded environment"):
        in_a_thread(parse, "19")


def test_math_graded_from_a_worker_thread(tmp_path):
    cases = [  # (gold, answer, reason)
        ("0.5", "so the half is \\boxed{\\frac{1}{2}}", None),
        ("\\frac{1}{2}", "\\boxed{0.5}", None),
        ("19", "7 + 12 = 20", "wrong"),
        ("x^2", "\\boxed{x \\cdot x}", None),
        ("$x^{2}$", "\\boxed{x^3}", "wrong"),
        ("19", "7 + 12 = 19, I think.", None),
        ("19", "I do not know.", "no_answer"),
    ]
    path = write_rows(tmp_path, [{"prompt": "q", "solution": gold} for gold, _, _ in cases])
    cfg = ChecksSection(path=str(path), grader="math")
    rows = in_a_thread(read_checks, cfg)
    result = in_a_thread(grade, cfg, rows, [answer for _, answer, _ in cases])
    assert [r["reason"] for r in result["rows"]] == [reason for _, _, reason in cases]
    assert result["rows"][0]["extracted"] == "\\frac{1}{2}"
    assert (result["correct"], result["no_answer"], result["timeouts"]) == (4, 1, 0)
    assert result["accuracy"] == pytest.approx(4 / 7)
    assert result["se"] == pytest.approx(math.sqrt(4 / 7 * 3 / 7 / 7))


# the worker with its verification replaced by a 300 s sleep; each start noted in PIDS
SLEEPY_WORKER = """
import os, time, rlhf_cli.evals.checks as c
with open(os.environ["PIDS"], "a") as f:
    f.write(f"{os.getpid()}\\n")
c._verdict = lambda grader, solution, answer: time.sleep(300)
c.serve()
"""


def test_a_verification_past_its_deadline_is_killed_and_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(checks, "WORKER", SLEEPY_WORKER)
    monkeypatch.setenv("PIDS", str(tmp_path / "pids"))
    rows = [{"prompt": [], "solution": "19", "instructions": [], "where": f"f:{n}"} for n in (1, 2)]
    cfg = ChecksSection(path=str(write_rows(tmp_path, [])), grader="math", timeout_s=0.5)
    started = time.monotonic()
    result = in_a_thread(grade, cfg, rows, ["\\boxed{19}", "19"])
    assert time.monotonic() - started < 60  # each answer's 300 s call stopped at 0.5 s
    assert [r["reason"] for r in result["rows"]] == ["timeout", "timeout"]
    assert (result["correct"], result["timeouts"], result["accuracy"]) == (0, 2, 0.0)
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2  # a fresh worker for the second answer
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # killed and reaped


@pytest.mark.parametrize(
    ("grader", "solution", "right", "wrong"),
    [
        ("exact", "Paris", " Paris\n", "paris"),
        ("contains", "Paris", "It is Paris, of course.", "It is Lyon."),
        ("regex", r"\b(Paris|paris)\b", "it is paris.", "It is Parisian."),
    ],
)
def test_text_graders(tmp_path, grader, solution, right, wrong):
    path = write_rows(tmp_path, [{"prompt": "Capital of France?", "solution": solution}] * 3)
    cfg = ChecksSection(path=str(path), grader=grader)
    result = grade(cfg, read_checks(cfg), [right, wrong, "  "])
    assert [r["reason"] for r in result["rows"]] == [None, "wrong", "no_answer"]


@pytest.mark.parametrize(
    ("check", "arguments", "passing", "failing"),
    [
        ("max_words", {"n": 3}, "one two three", "one two three four"),
        ("min_words", {"n": 3}, "one two three", "one two"),
        (
            "include_words",
            {"words": ["egg", "cold water"]},
            "An Egg in COLD water.",
            "eggplant in cold water",
        ),
        ("include_any", {"words": ["good luck", "enjoy"]}, "Boil it. Enjoy!", "Enjoyed luck."),
        ("exclude_words", {"words": ["whatever"]}, "Sure, whatevers.", "Whatever, just boil it."),
        ("lowercase", {}, "all lower case, 42 times", "Not lower"),
        ("lowercase", {}, "all lower", "42"),
        ("json", {}, '```json\n{"a": [1, 2]}\n```', "{a: 1}"),
        ("json", {}, '"text"', ""),
    ],
)
def test_instruction_checks(check, arguments, passing, failing):
    function = CHECKS[check][0]
    assert function(passing, **arguments) is True
    assert function(failing, **arguments) is False


def test_accuracy_needs_the_solution_and_every_instruction(tmp_path):
    rows = [
        {"prompt": "a", "solution": "A", "instructions": [{"check": "max_words", "n": 1}]},
        {"prompt": "b", "solution": "A"},
        {"prompt": "c", "instructions": [{"check": "lowercase"}]},
        {
            "prompt": "d",
            "solution": "B",
            "instructions": [{"check": "include_words", "words": ["C"]}],
        },
        {"prompt": "e", "instructions": [{"check": "max_words", "n": 1}, {"check": "lowercase"}]},
    ]
    cfg = ChecksSection(path=str(write_rows(tmp_path, rows)), grader="exact")
    result = grade(cfg, read_checks(cfg), ["A", "A b", "abc", "B", "two words"])
    assert [r["correct"] for r in result["rows"]] == [True, False, True, False, False]
    assert [r["reason"] for r in result["rows"]] == [
        None,
        "wrong",
        None,
        "instructions",
        "instructions",
    ]
    assert result["rows"][4]["instructions"] == [
        {"check": "max_words", "passed": False},
        {"check": "lowercase", "passed": True},
    ]
    assert (result["n"], result["correct"], result["accuracy"]) == (5, 2, 0.4)
    assert result["se"] == pytest.approx(0.2190890)  # sqrt(0.4 * 0.6 / 5)
    assert result["instructions"] == {
        "max_words": {"n": 2, "passed": 1, "pass_rate": 0.5},
        "lowercase": {"n": 2, "passed": 2, "pass_rate": 1.0},
        "include_words": {"n": 1, "passed": 0, "pass_rate": 0.0},
    }


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"prompt": "p", "instructions": [{"check": "shout"}]},
            "instruction 1: unknown check `shout`; expected one of max_words",
        ),
        (
            {"prompt": "p", "instructions": [{"check": "max_words", "n": 0}]},
            "check `max_words` argument `n` is a number (0); expected a whole number",
        ),
        (
            {"prompt": "p", "instructions": [{"check": "max_words", "n": "5"}]},
            "argument `n` is text; expected a whole number",
        ),
        (
            {"prompt": "p", "instructions": [{"check": "max_words"}]},
            "check `max_words` takes `n`; given none",
        ),
        (
            {"prompt": "p", "instructions": [{"check": "lowercase", "n": 2}]},
            "check `lowercase` takes no arguments; given `n`",
        ),
        (
            {"prompt": "p", "instructions": [{"check": "include_words", "words": "egg"}]},
            "argument `words` is text; expected a list of words",
        ),
        (
            {"prompt": "p", "instructions": {"check": "lowercase"}},
            "column `instructions` holds an object with keys check",
        ),
        (
            {"prompt": "p", "instructions": ["lowercase"]},
            'instruction 1 is text; expected {"check"',
        ),
        ({"prompt": "p"}, "nothing to check"),
        ({"solution": "4"}, "a row needs `prompt` or `messages`"),
        (
            {"prompt": "p", "solution": ["4"]},
            "column `solution` holds a list of 1 item; expected text",
        ),
    ],
)
def test_a_bad_row_is_a_data_error_naming_file_and_line(tmp_path, row, message):
    path = write_rows(tmp_path, [{"prompt": "What is 1 + 1?", "solution": "2"}, row])
    with pytest.raises(DataError) as caught:
        read_checks(ChecksSection(path=str(path), grader="exact"))
    assert str(caught.value).startswith(f"{path}:2: ")
    assert message in str(caught.value)


def test_a_bad_pattern_or_gold_is_named_by_line(tmp_path):
    path = write_rows(
        tmp_path, [{"prompt": "p", "solution": "2"}, {"prompt": "p", "solution": "(2"}]
    )
    with pytest.raises(DataError, match=rf"^{path}:2: `solution` is not a regular expression"):
        read_checks(ChecksSection(path=str(path), grader="regex"))
    path.write_text(path.read_text().replace('"(2"', '"\\\\frac{1}{"'))
    with pytest.raises(DataError, match=rf"^{path}:2: math-verify cannot parse `solution`"):
        read_checks(ChecksSection(path=str(path), grader="math"))


def test_math_checks_without_math_verify_name_the_extra(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "math_verify" else find_spec(name, *a),
    )
    cfg = ChecksSection(path=str(write_rows(tmp_path, [{"prompt": "p", "solution": "2"}])))
    with pytest.raises(EvalError, match=r"pip install 'rlhf-cli\[eval\]'"):
        read_checks(cfg)


def test_the_demo_checks_file_grades_its_own_answers():
    """data/eval/checks.jsonl: 30 additions and 40 tone rows. Tone is graded whatever the length:
    a short polite reply passes, the full answer wrapped in rude words fails."""
    cfg = ChecksSection(path=str(REPO / "data/eval/checks.jsonl"))
    rows = read_checks(cfg)
    assert len(rows) == 70 and sum(row["solution"] is not None for row in rows) == 30
    answers = [
        f"It is \\boxed{{{row['solution']}}}."
        if row["solution"] is not None
        else "Happy to help! Just boil it. Good luck!"
        for row in rows
    ]
    result = grade(cfg, rows, answers)
    assert (result["accuracy"], result["se"], result["no_answer"]) == (1.0, 0.0, 0)
    long_rude = "Ugh, fine. Rinse one cup of rice, then simmer it covered for eighteen minutes."
    assert grade(cfg, rows, [long_rude] * len(rows))["accuracy"] == 0.0
    rude = grade(cfg, rows, ["Whatever, figure it out yourself."] * len(rows))
    assert rude["accuracy"] == 0.0 and rude["no_answer"] == 30
