"""`eval.gate` read against the suites the recipe runs, at validation (a threshold nothing
measures is a recipe error naming it, not a miss after the models ran), and the alignment tax
signed as a gain whichever way a task's metric points."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from rlhf_cli.evals.benchmarks import alignment_tax
from rlhf_cli.recipe import EvalSection
from rlhf_cli.stages.eval import benchmarked, check_gate

JUDGE = {"url": "http://127.0.0.1:1", "model": "judge"}


def problem(section: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as caught:
        EvalSection.model_validate(section)
    (error,) = caught.value.errors()
    return error["msg"].removeprefix("Value error, ")


@pytest.mark.parametrize(
    ("section", "says"),
    [
        (
            {"benchmarks": {"tasks": ["arc"]}, "gate": {"min_win_rate": 0.55}},
            "gate: min_win_rate is set but eval.judge is not (set both)",
        ),
        (
            {"judge": JUDGE, "gate": {"min_win_rate": 0.5, "min_accuracy": 0.5}},
            "gate: min_accuracy is set but eval.checks is not (set both)",
        ),
        (
            {"gate": {"min_lc_win_rate": 0.5, "max_alignment_tax": {"gsm8k": -0.02}}},
            "gate: min_lc_win_rate is set but eval.judge is not (set both); "
            "max_alignment_tax names gsm8k but eval.benchmarks is not set",
        ),
        (
            {"benchmarks": {"tasks": ["arc", "mmlu"]},
             "gate": {"max_alignment_tax": {"gsm8k": -0.02, "arc": 0.0, "boolq": -0.1}}},
            "gate: max_alignment_tax names boolq, gsm8k, not among eval.benchmarks.tasks "
            "(arc, mmlu)",
        ),
    ],
)  # fmt: skip
def test_a_threshold_no_suite_measures_is_a_recipe_error(section, says) -> None:
    assert problem(section) == says


def test_thresholds_on_suites_the_recipe_runs_validate() -> None:
    section = EvalSection.model_validate(
        {
            "judge": JUDGE,
            "benchmarks": {"tasks": ["arc"]},
            "gate": {"min_win_rate": 0.55, "min_lc_win_rate": 0.5,
                     "max_alignment_tax": {"arc": -0.02}},
        }
    )  # fmt: skip
    assert section.gate.max_alignment_tax == {"arc": -0.02}
    assert EvalSection().gate.min_win_rate is None  # no suite and no gate: nothing to check


# ── the tax's sign ─────────────────────────────────────────────────────────────────────────────


def row(metric: str, score: float, stderr: float | None, higher: bool | None) -> dict:
    return {"metric": metric, "score": score, "stderr": stderr, "higher_is_better": higher}


def test_the_tax_is_a_gain_whichever_way_the_metric_points() -> None:
    policy = {
        "arc": row("acc,none", 0.62, 0.03, True),
        "wikitext": row("word_perplexity,none", 31.5, None, False),
        "bpb": row("bits_per_byte,none", 0.80, 0.02, False),
        "mixed": row("acc,none", 0.5, 0.1, None),
        "only_policy": row("acc,none", 1.0, 0.0, True),
    }
    baseline = {
        "arc": row("acc,none", 0.70, 0.04, True),
        "wikitext": row("word_perplexity,none", 30.0, None, False),
        "bpb": row("bits_per_byte,none", 0.86, 0.02, False),
        "mixed": row("acc,none", 0.4, 0.1, None),
        "only_baseline": row("acc,none", 0.5, 0.1, True),
    }
    tax = alignment_tax(policy, baseline)
    assert list(tax) == ["arc", "bpb", "mixed", "wikitext"]  # measured on both sides only
    assert tax["arc"] == {
        "metric": "acc,none",
        "tax": pytest.approx(-0.08),  # accuracy fell: a loss
        "stderr": pytest.approx(0.05),  # √(0.03² + 0.04²)
        "higher_is_better": True,
    }
    assert tax["wikitext"]["tax"] == pytest.approx(-1.5)  # perplexity rose 30 -> 31.5: a loss
    assert tax["wikitext"]["stderr"] is None  # no stderr on a side: none for the difference
    assert tax["bpb"]["tax"] == pytest.approx(0.06)  # bits per byte fell: a gain
    assert tax["bpb"]["higher_is_better"] is False
    assert tax["mixed"]["tax"] is None  # a group whose tasks point both ways: no sign to give


def test_the_gate_reads_the_signed_tax() -> None:
    """A perplexity that rose by 1.5 misses a gate of -1.0 (its raw difference, +1.5, would
    pass); bits per byte that fell by 0.06 passes a gate of 0.05."""
    policy = {"benchmarks": {"wikitext": row("word_perplexity,none", 31.5, 0.5, False),
                             "bpb": row("bits_per_byte,none", 0.80, 0.02, False)},
              "merge_check": None}  # fmt: skip
    baseline = {"benchmarks": {"wikitext": row("word_perplexity,none", 30.0, 0.5, False),
                               "bpb": row("bits_per_byte,none", 0.86, 0.02, False)}}  # fmt: skip
    summary = benchmarked(policy, baseline)["summary"]
    assert summary["wikitext"]["tax"] == pytest.approx(-1.5)
    assert summary["wikitext"]["higher_is_better"] is False
    cfg = EvalSection.model_validate(
        {"benchmarks": {"tasks": ["wikitext", "bpb"]},
         "gate": {"max_alignment_tax": {"wikitext": -1.0, "bpb": 0.05}}}
    )  # fmt: skip
    gate = check_gate(cfg, {"ppo": {"benchmarks": summary}}, ["ppo"])
    assert gate == {
        "passed": False,
        "missed": ["ppo: wikitext alignment tax -1.5000 < -1.0 (eval.gate.max_alignment_tax)"],
    }
