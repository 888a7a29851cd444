"""`rlhf eval`'s set-up errors: each one line, exit 2, before any model loads or any answer is
generated (no run is needed to see them). The results, the kept answers and the gate's exit 4
on a trained run are in tests/stages/test_eval_stage.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fake_judge import FakeJudge
from typer.testing import CliRunner

from rlhf_cli.cli import app
from rlhf_cli.generation import HFGenerator

KEY_ENV = "RLHF_TEST_EVAL_JUDGE_KEY"


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def assert_one_line_error(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def no_generation(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every generate call, recorded (none expected)."""
    calls: list[Any] = []
    monkeypatch.setattr(HFGenerator, "generate", lambda *args, **kwargs: calls.append(args))
    return calls


@pytest.fixture
def judge() -> Any:
    fake = FakeJudge(lambda a, b: "A", key="sk-eval-cli-test")
    yield fake
    fake.stop()


def test_a_missing_judge_key_is_exit_2_before_any_answer(
    make_recipe, chdir_tmp, judge, no_generation, monkeypatch
) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    recipe = make_recipe({"eval": {"judge": {"url": judge.url, "model": "judge",
                                             "api_key_env": KEY_ENV}}})  # fmt: skip
    result = invoke("eval", "--recipe", str(recipe))
    assert_one_line_error(result, "eval.judge.api_key_env", KEY_ENV, "is not set")
    assert no_generation == [] and judge.requests == []  # no run either: nothing else ran
    assert not (chdir_tmp / "runs").exists()


def test_a_judge_without_the_model_is_exit_2_naming_it(
    make_recipe, chdir_tmp, judge, no_generation, monkeypatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-eval-cli-test")
    recipe = make_recipe({"eval": {"judge": {"url": judge.url, "model": "gpt-judge",
                                             "api_key_env": KEY_ENV}}})  # fmt: skip
    result = invoke("eval", "--recipe", str(recipe))
    assert_one_line_error(result, "does not serve 'gpt-judge'", judge.url)
    assert no_generation == []


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        ([], "eval: no suite to run: set eval.judge, eval.checks or eval.benchmarks"),
        (
            ["eval.benchmarks.tasks=[tiny_arith]", "eval.gate.min_win_rate=0.55"],
            "eval.gate: min_win_rate is set but eval.judge is not (set both)",
        ),
        (
            ["eval.benchmarks.tasks=[tiny_arith]", "eval.gate.max_alignment_tax={gsm8k: -0.02}"],
            "eval.gate: max_alignment_tax names gsm8k, not among eval.benchmarks.tasks "
            "(tiny_arith)",
        ),
    ],
)
def test_a_gate_or_suite_that_cannot_be_measured_is_exit_2(
    make_recipe, chdir_tmp, sets: list[str], needle: str
) -> None:
    args = [arg for value in sets for arg in ("--set", value)]
    result = invoke("eval", "--recipe", str(make_recipe()), *args)
    assert_one_line_error(result, needle)


def test_an_unknown_label_is_exit_2_naming_the_labels(make_recipe, chdir_tmp: Path) -> None:
    checks = chdir_tmp / "checks.jsonl"
    checks.write_text(json.dumps({"prompt": "Say hi", "solution": "hi"}) + "\n")
    recipe = make_recipe({"eval": {"checks": {"path": str(checks), "grader": "contains"}}})
    result = invoke("eval", "nonsense", "--recipe", str(recipe))
    assert_one_line_error(
        result, "'nonsense' is not base, sft, ppo, merged, best, last, iter_N or a model folder"
    )


def test_eval_before_ppo_names_the_command_to_run(make_recipe, chdir_tmp: Path) -> None:
    checks = chdir_tmp / "checks.jsonl"
    checks.write_text(json.dumps({"prompt": "Say hi", "solution": "hi"}) + "\n")
    recipe = make_recipe({"eval": {"checks": {"path": str(checks), "grader": "contains"}}})
    result = invoke("eval", "ppo", "--baseline", "base", "--recipe", str(recipe))
    assert_one_line_error(result, "rlhf eval needs the ppo stage", "run `rlhf ppo` first")


SUMMARIES = {
    "ppo": {
        "judge": {"win_rate": 0.625, "ci_low": 0.5, "ci_high": 0.75, "lc_win_rate": 0.55,
                  "wins": 4, "ties": 2, "losses": 2, "unreadable": 1, "length_unit": "words"},
        "checks": {"accuracy": 0.75, "se": 0.21650635, "correct": 3, "n": 4, "no_answer": 0,
                   "timeouts": 0, "baseline_accuracy": 0.5, "baseline_se": 0.25, "delta": 0.25},
        "benchmarks": {"tiny_arith": {"metric": "exact_match", "score": 0.3, "stderr": 0.1,
                                      "chat_template": True, "tax": -0.05, "tax_stderr": 0.1414}},
    },
    "sft": {"checks": {"accuracy": 0.5, "se": 0.25, "correct": 2, "n": 4, "no_answer": 1,
                       "timeouts": 0}},
}  # fmt: skip


def rendered(draw, *args: Any) -> str:
    from rich.console import Console

    out = Console(record=True, width=200, highlight=False)
    draw(*args, out)
    return out.export_text()


def test_the_eval_table_shows_each_measure_with_its_uncertainty() -> None:
    from rlhf_cli import views

    result = {"run": "tiny", "baseline": "sft", "results": SUMMARIES, "dir": "runs/tiny/eval",
              "gate": {"passed": True, "missed": []}}  # fmt: skip
    text = rendered(views.eval_results, result)
    for needle in (
        "win rate [95% CI]", "0.625 [0.500, 0.750]", "LC win rate (length in words)", "0.550",
        "4 / 2 / 2, 1 unreadable", "0.750 ± 0.217 (3/4)", "baseline accuracy ± se",
        "0.500 ± 0.250", "tiny_arith: exact_match (chat template)", "0.300 ± 0.100",
        "tiny_arith: alignment tax", "-0.050 ± 0.141", "no answer / timeouts", "1 / 0",
        "gate: passed",
    ):  # fmt: skip
        assert needle in text, needle
    assert views.eval_line(SUMMARIES["ppo"]) == (
        "judge 0.625 [0.500, 0.750] (LC 0.550); checks 0.750 ± 0.217; "
        "tiny_arith 0.300 (tax -0.050 ± 0.141)"
    )


def test_compare_shows_the_eval_columns_of_each_policy() -> None:
    from rlhf_cli import views

    text = rendered(views.eval_columns, {"baseline": "sft", "policies": SUMMARIES})
    lines = text.splitlines()
    assert "last rlhf eval (baseline sft)" in lines[0]
    ppo = next(line for line in lines if line.startswith("│ ppo"))
    sft = next(line for line in lines if line.startswith("│ sft"))
    for cell in ("0.625 [0.500, 0.750]", "0.550", "0.750 ± 0.217", "0.300 (tax -0.050 ± 0.141)"):
        assert cell in ppo, cell
    assert [c.strip() for c in sft.strip("│").split("│")] == ["sft", "—", "—", "0.500 ± 0.250", "—"]
