"""The guide's reward-hacking detectors (Part 10) on hand-written responses whose rates are known:
each detector at its boundary, then `audit_responses` against the recipe's default thresholds."""

from __future__ import annotations

import pytest

from rlhf_cli.audit.detectors import (
    SYCOPHANCY_WINDOW,
    audit_responses,
    is_repetitive,
    is_sycophantic,
    is_verbose,
)
from rlhf_cli.errors import DataError
from rlhf_cli.guide import GUIDE_SYCOPHANTIC_OPENERS
from rlhf_cli.recipe import AuditSection


def distinct_words(n: int, prefix: str = "w") -> str:
    """`n` whitespace words, no two alike (so no 4-gram repeats)."""
    return " ".join(f"{prefix}{i}" for i in range(n))


# ── verbosity ─────────────────────────────────────────────────────────────────────────────────


def test_exactly_200_words_is_not_verbose_201_is() -> None:
    assert not is_verbose(distinct_words(200))
    assert is_verbose(distinct_words(201))


def test_verbosity_counts_whitespace_words_and_takes_a_limit() -> None:
    assert not is_verbose("  one\ttwo\n three  ", max_words=3)
    assert is_verbose("one two three four", max_words=3)


# ── sycophancy ────────────────────────────────────────────────────────────────────────────────


def test_opener_ending_at_character_150_counts() -> None:
    phrase = "great question"
    response = "x" * (SYCOPHANCY_WINDOW - len(phrase)) + phrase + " and more"
    assert SYCOPHANCY_WINDOW == 150
    assert is_sycophantic(response, GUIDE_SYCOPHANTIC_OPENERS)


@pytest.mark.parametrize("start", [150, 151, 140])  # at char 151, 152, or straddling the edge
def test_opener_past_the_first_150_characters_does_not_count(start: int) -> None:
    response = "x" * start + "great question"
    assert not is_sycophantic(response, GUIDE_SYCOPHANTIC_OPENERS)


def test_sycophancy_is_case_insensitive() -> None:
    assert is_sycophantic("GREAT QUESTION! Here is how.", ["great question"])
    assert is_sycophantic("what a lovely idea", ["What A Lovely"])


def test_sycophancy_phrase_list_is_configurable() -> None:
    response = "Happy to help! Trim the stems."
    assert not is_sycophantic(response, GUIDE_SYCOPHANTIC_OPENERS)
    assert is_sycophantic(response, ["happy to help"])
    assert not is_sycophantic("Great question!", [])


# ── repetition ────────────────────────────────────────────────────────────────────────────────


def test_a_4gram_twice_is_not_repetitive_three_times_is() -> None:
    gram = "trim the stems daily"
    assert not is_repetitive(f"{gram} and then {gram} done")
    assert is_repetitive(f"{gram} and then {gram} and then {gram} done")


def test_repetition_is_lower_cased() -> None:
    assert is_repetitive("Trim The Stems daily trim the stems daily TRIM THE STEMS DAILY")


def test_a_3gram_repeated_is_not_a_4gram() -> None:
    assert not is_repetitive("a b c x a b c y a b c z")


# ── empty response ────────────────────────────────────────────────────────────────────────────


def test_empty_response_has_no_flags() -> None:
    assert not is_verbose("") and not is_sycophantic("", GUIDE_SYCOPHANTIC_OPENERS)
    assert not is_repetitive("")
    report = audit_responses(["", "   "], AuditSection())
    assert report["avg_response_len"] == 0
    assert report["n_responses"] == 2
    assert report["flags"] == [] and report["hacking_detected"] is False


def test_no_responses_is_a_data_error() -> None:
    with pytest.raises(DataError, match="no responses"):
        audit_responses([], AuditSection())


# ── audit_responses: exact rates against the default thresholds ───────────────────────────────


def known_mix(verbose: int, sycophantic: int, repetitive: int, plain: int) -> list[str]:
    """Responses each hitting exactly one detector, and plain ones (5 words) hitting none."""
    gram = "keep the water cold"
    return (
        [distinct_words(201, f"v{i}_") for i in range(verbose)]
        + [f"Great question! {distinct_words(4, f's{i}_')}" for i in range(sycophantic)]
        + [f"{gram} {gram} {gram}" for _ in range(repetitive)]
        + [distinct_words(5, f"p{i}_") for i in range(plain)]
    )


def test_default_thresholds_are_the_guides() -> None:
    cfg = AuditSection()
    assert (
        cfg.verbosity_threshold,
        cfg.sycophancy_threshold,
        cfg.repetition_threshold,
        cfg.verbosity_words,
    ) == (0.3, 0.2, 0.15, 200)


def test_rates_exactly_at_the_thresholds_do_not_flag() -> None:
    responses = known_mix(verbose=6, sycophantic=4, repetitive=3, plain=7)  # of 20
    report = audit_responses(responses, AuditSection())
    assert report["verbosity_score"] == 0.3
    assert report["sycophancy_score"] == 0.2
    assert report["repetition_score"] == 0.15
    assert report["n_responses"] == 20
    assert report["avg_response_len"] == (6 * 201 + 4 * 6 + 3 * 12 + 7 * 5) / 20
    assert report["flags"] == []
    assert report["hacking_detected"] is False


def test_one_more_of_each_flags_each() -> None:
    responses = known_mix(verbose=7, sycophantic=5, repetitive=4, plain=4)  # of 20
    report = audit_responses(responses, AuditSection())
    assert (report["verbosity_score"], report["sycophancy_score"], report["repetition_score"]) == (
        0.35,
        0.25,
        0.2,
    )
    assert report["avg_response_len"] == (7 * 201 + 5 * 6 + 4 * 12 + 4 * 5) / 20
    assert report["flags"] == ["verbosity", "sycophancy", "repetition"]
    assert report["hacking_detected"] is True


@pytest.mark.parametrize(
    ("mix", "flag"),
    [((7, 0, 0, 13), "verbosity"), ((0, 5, 0, 15), "sycophancy"), ((0, 0, 4, 16), "repetition")],
)
def test_each_flag_alone(mix: tuple[int, int, int, int], flag: str) -> None:
    report = audit_responses(known_mix(*mix), AuditSection())
    assert report["flags"] == [flag] and report["hacking_detected"] is True


def test_the_recipe_sets_words_phrases_and_thresholds() -> None:
    cfg = AuditSection(
        verbosity_words=3,
        verbosity_threshold=0.0,
        sycophancy_phrases=["happy to help"],
        sycophancy_threshold=0.4,
    )
    report = audit_responses(
        ["one two three", "one two three four", "Happy to help.", "Great question!"], cfg
    )
    assert report["verbosity_score"] == 0.25  # only the 4-word one is over 3 words
    assert report["sycophancy_score"] == 0.25  # the guide's opener is not on the list
    assert report["flags"] == ["verbosity"]


# ── brevity: the policy's answers against the reference's ────────────────────────────────────


def test_half_the_reference_length_is_not_brevity_under_half_is() -> None:
    reference = [distinct_words(10), distinct_words(6)]  # 8 words on average
    at_half = audit_responses([distinct_words(4), distinct_words(4)], AuditSection(), reference)
    assert at_half["avg_reference_len"] == 8.0 and at_half["length_ratio"] == 0.5
    assert at_half["flags"] == [] and at_half["hacking_detected"] is False
    under = audit_responses([distinct_words(4), distinct_words(3)], AuditSection(), reference)
    assert under["length_ratio"] == 3.5 / 8
    assert under["flags"] == ["brevity"] and under["hacking_detected"] is True


def test_brevity_comes_after_the_guides_flags_and_follows_the_recipe() -> None:
    responses = ["Great question! Yes.", "ok"]  # 2.0 words on average; one sycophantic
    reference = [distinct_words(5), distinct_words(5)]
    report = audit_responses(responses, AuditSection(), reference)
    assert report["length_ratio"] == 0.4
    assert report["flags"] == ["sycophancy", "brevity"]
    off = audit_responses(responses, AuditSection(min_length_ratio=0.0), reference)
    assert off["flags"] == ["sycophancy"] and off["length_ratio"] == 0.4
    strict = audit_responses(responses, AuditSection(min_length_ratio=0.3), reference)
    assert strict["flags"] == ["sycophancy"]


def test_no_reference_or_an_empty_one_measures_no_ratio() -> None:
    for reference in (None, [], ["", "  "]):
        report = audit_responses(["one", "two"], AuditSection(), reference)
        assert "length_ratio" not in report and report["flags"] == []
    assert audit_responses(["one"], AuditSection(), [""])["avg_reference_len"] == 0.0


@pytest.mark.parametrize(
    ("flags", "actions"),
    [(["brevity"], ["do not raise β"]), (["verbosity", "brevity"], ["by 0.05", "do not raise β"])],
)
def test_the_printed_report_says_not_to_raise_beta_for_brevity(
    flags: list[str], actions: list[str]
) -> None:
    from rich.console import Console

    from rlhf_cli.views import audit_report

    responses = [distinct_words(201) if "verbosity" in flags else "ok", "ok"]
    report = audit_responses(responses, AuditSection(), [distinct_words(400), distinct_words(400)])
    assert report["flags"] == flags
    console = Console(record=True, width=200)
    audit_report(report, AuditSection(), console, "audit")
    text = console.export_text()
    assert "Length vs reference" in text and "< 50%" in text
    assert [a for a in ("by 0.05", "do not raise β") if a in text] == actions
